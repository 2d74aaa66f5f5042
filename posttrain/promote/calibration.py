"""The gate's false-accept rate under no true difference, measured by simulation (docs/promotion.md,
"Calibration"; ``bench/gate_calibration.py`` prints the table, tests/promote/test_gate_calibration.py
checks it).

A trial is one nightly gate whose candidate is exactly as good as the champion: each of K prompts
has a success probability p_i ~ Uniform(0, 1) (prompts differ in difficulty), and each side gets n
rewards per prompt drawn the same way from p_i: Bernoulli rewards (``bernoulli``: 0 or 1, as a
pass/fail reward), or graded ones (``graded``: 0, 0.5 or 1 as ``posttrain.rewards:correctness_reward``
gives, 1 with probability p_i^2, 0.5 with 2 p_i (1 - p_i)). The gate (``decide``, the rule as it
runs) sees them paired by prompt, as the promoter gives them; every accept is a false accept.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from posttrain.promote.decision import GateConfig, decide

RewardKind = Literal["bernoulli", "graded"]


class Calibration(BaseModel):
    """The measured false-accept rate at one K."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: int
    trials: int
    accepted: int
    nominal: float  # 1 - confidence

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    @property
    def standard_error(self) -> float:
        """The binomial s.e. of a rate at the nominal level over this many trials."""
        return math.sqrt(self.nominal * (1.0 - self.nominal) / self.trials)


def null_rewards(rng: np.random.Generator, prompts: int, n: int, kind: RewardKind) -> tuple[dict, dict]:
    """The two sides' rewards of one trial: the same distribution per prompt, drawn independently."""
    p = rng.random(prompts)
    if kind == "bernoulli":
        sides = [(rng.random((prompts, n)) < p[:, None]).astype(float) for _ in range(2)]
    else:  # two Bernoulli(p) halves: 1, 0.5 or 0
        sides = [((rng.random((prompts, n)) < p[:, None]).astype(float)
                  + (rng.random((prompts, n)) < p[:, None]).astype(float)) / 2 for _ in range(2)]
    return tuple({f"prompt-{i:04d}": side[i].tolist() for i in range(prompts)} for side in sides)


def false_accepts(config: GateConfig, prompts: int, trials: int, *, seed: int = 0,
                  kind: RewardKind = "bernoulli") -> Calibration:
    """``trials`` gates with no true difference on ``prompts`` prompts; the gate's seed varies per trial."""
    rng = np.random.default_rng([seed, prompts])
    accepted = 0
    for t in range(trials):
        candidate, champion = null_rewards(rng, prompts, config.samples_per_prompt, kind)
        accepted += decide(config.model_copy(update={"seed": t}), candidate, champion).accepted
    return Calibration(prompts=prompts, trials=trials, accepted=accepted, nominal=1.0 - config.confidence)
