"""``python -m posttrain.trainer CONFIG.yaml``: run training, print the TrainingResult as JSON.

Exit status: 0 when the run reached its end, 75 when SIGTERM or SIGUSR2 stopped it after a
checkpoint (run it again to resume), 2 for a bad config or input.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly, start again to resume


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="trainer YAML file (see posttrain.trainer.TrainerConfig)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from posttrain.datasets.staging import StagingError
    from posttrain.trainer.config import ConfigError, load_trainer_config
    from posttrain.trainer.rollouts import RolloutError
    from posttrain.trainer.run import run_training

    try:
        config = load_trainer_config(args.config)
    except ConfigError as e:
        print(f"posttrain.trainer: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGUSR2):  # Kubernetes eviction, Slurm --signal
        signal.signal(sig, lambda signum, frame: stop.set())
    from posttrain.trainer.step import StepError  # imports torch, which the run needs anyway

    try:
        result = run_training(config, stop_event=stop)
    except (ConfigError, StagingError, RolloutError, StepError) as e:
        print(f"posttrain.trainer: error: {e}", file=sys.stderr)
        return 2
    print(result.model_dump_json(indent=2))
    return EXIT_STOPPED if result.stopped_early else 0


if __name__ == "__main__":
    sys.exit(main())
