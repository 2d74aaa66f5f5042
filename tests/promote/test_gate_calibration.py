"""The gate's stated error rate is its real one: with no true difference (the same reward distribution
on both sides, Bernoulli rewards averaged over n = 4 samples, paired by prompt), superiority at margin 0
accepts at most 1 - confidence of the time, within 2 standard errors, at every K from the fewest
min_prompts allows up to 200. The percentile bootstrap it replaced accepted 8.2% at K = 8 (5% nominal).
The full table (2,000 trials per K, both reward kinds, B = 10,000) is bench/gate_calibration.py's."""

from __future__ import annotations

import pytest

from posttrain.promote.calibration import false_accepts
from posttrain.promote.decision import GateConfig, fewest_prompts

# B = 1,000 (the fewest allowed) keeps this to seconds; the test's p-value is valid for any B
CONFIG = GateConfig(rule="superiority", margin=0.0, confidence=0.95, bootstrap_samples=1_000,
                    min_prompts=fewest_prompts(0.95), samples_per_prompt=4)
# every K up to 16, then a spread to 200; fewer trials where a gate costs more
TRIALS = {**{k: 1_000 for k in range(fewest_prompts(0.95), 17)}, 20: 1_000, 30: 1_000, 50: 600, 100: 400, 200: 300}


@pytest.mark.parametrize("prompts", sorted(TRIALS))
def test_no_true_difference_is_accepted_at_most_at_the_nominal_rate(prompts: int) -> None:
    measured = false_accepts(CONFIG, prompts, TRIALS[prompts], seed=33)
    assert measured.rate <= measured.nominal + 2 * measured.standard_error, measured


def test_the_fewest_prompts_min_prompts_allows_can_still_accept_a_clear_difference() -> None:
    k = fewest_prompts(0.95)
    cand = {f"p{i}": [1.0] * 4 for i in range(k)}
    champ = {f"p{i}": [0.0, 0.0, 1.0, 0.0] for i in range(k)}
    from posttrain.promote.decision import decide

    assert decide(CONFIG, cand, champ).accepted
