"""``python -m posttrain.trainer CONFIG.yaml``: run training, print the TrainingResult as JSON.

Exit status: 0 when the run reached its end, 75 when SIGTERM or SIGUSR2 stopped it after a
checkpoint (run it again to resume), 2 for a bad config or input (or, resident mode, a round that
never came). ``--result-file PATH`` appends
each attempt's TrainingResult to PATH as one JSON line (rank 0 only), so whoever submitted the
run can tell a resumed attempt from a fresh one; rank 0 also appends the attempt's timeline
(start, model loaded, steps, saves, end) beside it (``posttrain.trainer.timeline``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly, start again to resume


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="trainer YAML file (see posttrain.trainer.TrainerConfig)")
    parser.add_argument("--result-file", help="append this attempt's result as one JSON line to this file")
    args = parser.parse_args(argv)
    from posttrain.trainer import timeline

    # rank 0 records the attempt's timeline beside the results file (posttrain.trainer.timeline)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    tl = timeline.open_timeline(timeline.timeline_file_for(args.result_file) if args.result_file and rank0 else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from posttrain.datasets.staging import StagingError
    from posttrain.rollouts.format import RolloutError
    from posttrain.trainer.config import ConfigError, load_trainer_config
    from posttrain.trainer.run import run_training

    try:
        config = load_trainer_config(args.config)
    except ConfigError as e:
        print(f"posttrain.trainer: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGUSR2):  # Kubernetes eviction, Slurm --signal
        signal.signal(sig, lambda signum, frame: stop.set())
    from posttrain.trainer import distributed
    from posttrain.trainer.grpo_update import StepError  # imports torch, which the run needs anyway
    from posttrain.trainer.rounds import RoundError

    try:
        result = run_training(config, stop_event=stop)
    except (ConfigError, StagingError, RolloutError, StepError, RoundError) as e:
        print(f"posttrain.trainer: error: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.shutdown()  # leave the process group (several ranks) before exiting
    tl.mark("end", completed=result.completed, stopped_early=result.stopped_early, global_step=result.global_step)
    print(result.model_dump_json(indent=2))
    if args.result_file and int(os.environ.get("RANK", "0")) == 0:
        append_result(args.result_file, result.model_dump_json())
    return EXIT_STOPPED if result.stopped_early else 0


def append_result(path: str, line: str) -> None:
    """Append one line and fsync it: the submitter may read the file from another node.

    Not ``fsutil.atomic_write``: every attempt of a job adds its line to the same file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


if __name__ == "__main__":
    sys.exit(main())
