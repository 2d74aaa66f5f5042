"""The promotion gate's false-accept rate with no true difference, per number of eval prompts K.

    python bench/gate_calibration.py [--trials 2000] [--kind bernoulli|graded] [--prompts 6 8 30 ...]

Each trial is a gate (``posttrain.promote.decision.decide``, the default ``GateConfig``: superiority,
margin 0, confidence 0.95, 10,000 flips) between two sides with the same reward distribution:
per-prompt success probabilities p_i ~ Uniform(0, 1), n = 4 rewards per prompt and side
(``posttrain.promote.calibration``). Prints K, trials, false accepts, their rate, its s.e. at the
nominal 5%, and whether the rate is within nominal + 2 s.e. (docs/promotion.md, "Calibration").
"""

from __future__ import annotations

import argparse
import time

from posttrain.promote.calibration import false_accepts
from posttrain.promote.decision import GateConfig, fewest_prompts

PROMPTS = [*range(fewest_prompts(0.95), 17), 20, 30, 50, 100, 200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--kind", choices=["bernoulli", "graded"], default="bernoulli")
    parser.add_argument("--prompts", type=int, nargs="+", default=PROMPTS)
    args = parser.parse_args()
    config = GateConfig(min_prompts=fewest_prompts(0.95))
    print(f"rewards: {args.kind}, n = {config.samples_per_prompt}; {config.rule}, margin {config.margin:g}, "
          f"confidence {config.confidence:g}, {config.bootstrap_samples} flips")
    print("| K | trials | false accepts | rate | s.e. | within 5% + 2 s.e. |")
    print("|---|---|---|---|---|---|")
    for k in args.prompts:
        t0 = time.perf_counter()
        m = false_accepts(config, k, args.trials, kind=args.kind)
        ok = m.rate <= m.nominal + 2 * m.standard_error
        print(f"| {k} | {m.trials} | {m.accepted} | {m.rate:.1%} | {m.standard_error:.1%} | {'yes' if ok else 'NO'} |"
              f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
