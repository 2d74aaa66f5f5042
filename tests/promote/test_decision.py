"""The gate's decision rule: a paired sign-flip test of per-prompt mean rewards, inverted into a one-sided
lower bound; percentile bootstrap intervals of the two means."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from pydantic import ValidationError

from posttrain.errors import describe_validation_error
from posttrain.promote import decision as gate
from posttrain.promote.decision import Decision, GateConfig, GateError, decide, first_promotion


def eval_rewards(rng: np.random.Generator, skill: np.ndarray, n: int) -> dict[str, list[float]]:
    """n Bernoulli rewards per prompt; ``skill`` is each prompt's success probability."""
    return {f"prompt-{i:03d}": rng.binomial(1, np.clip(p, 0, 1), n).astype(float).tolist()
            for i, p in enumerate(skill)}


def pair(seed: int, k: int, n: int, lift: float) -> tuple[dict, dict]:
    """Champion and candidate rewards on the same k prompts; the candidate's skill is ``lift`` higher."""
    rng = np.random.default_rng(seed)
    skill = rng.uniform(0.2, 0.8, k)  # prompts differ in difficulty: the pairing removes that variance
    return eval_rewards(rng, skill + lift, n), eval_rewards(rng, skill, n)


def one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


def test_a_clearly_better_candidate_is_accepted_under_superiority() -> None:
    cand, champ = pair(1, k=40, n=4, lift=0.25)
    d = decide(GateConfig(rule="superiority", margin=0.02), cand, champ, candidate="step-2", champion="step-1")
    assert d.accepted and d.lower_bound > 0.02 and d.threshold == 0.02
    assert d.candidate_mean > d.champion_mean and d.difference == pytest.approx(d.candidate_mean - d.champion_mean)
    lo, hi = d.difference_interval
    assert lo < d.difference < hi and lo <= d.lower_bound
    assert (d.prompts, d.samples_per_prompt, d.candidate, d.champion) == (40, 4, "step-2", "step-1")
    assert one_line(d.reason).startswith("accepted: the candidate's mean reward is ")
    assert f"{d.lower_bound:+.3f} > margin 0.02 (superiority)" in d.reason


def test_an_equal_candidate_is_refused_under_superiority_but_not_inferior_within_a_margin() -> None:
    # the same rewards on both sides, and two independent evals of the same skill
    same, _ = pair(2, k=60, n=4, lift=0.0)
    cand, champ = pair(3, k=200, n=8, lift=0.0)
    for c, h in ((same, same), (cand, champ)):
        n = len(next(iter(c.values())))
        sup = decide(GateConfig(rule="superiority", margin=0.0, samples_per_prompt=n), c, h)
        ni = decide(GateConfig(rule="non-inferiority", margin=0.1, samples_per_prompt=n), c, h)
        assert not sup.accepted and sup.reason.startswith("refused: ") and "(superiority)" in sup.reason
        assert ni.accepted and ni.threshold == -0.1 and ni.lower_bound > -0.1
        assert "> -margin -0.1 (non-inferiority)" in ni.reason
    # identical sides: every resampled difference is 0, and a bound equal to the threshold is no proof
    assert decide(GateConfig(), same, same).lower_bound == 0.0


def test_a_worse_candidate_is_refused_under_both_rules() -> None:
    cand, champ = pair(4, k=40, n=4, lift=-0.25)
    for config in (GateConfig(rule="superiority"), GateConfig(rule="non-inferiority", margin=0.05)):
        d = decide(config, cand, champ)
        assert not d.accepted and d.lower_bound < -0.05 and d.reason.startswith("refused: ")


def test_the_same_seed_gives_the_same_decision() -> None:
    rng = np.random.default_rng(5)  # continuous rewards: two seeds' bounds fall on different values
    cand, champ = ({f"p{i}": rng.uniform(0, 1, 2).tolist() for i in range(24)} for _ in range(2))  # random flips
    a = decide(GateConfig(seed=7, samples_per_prompt=2), cand, champ)
    assert decide(GateConfig(seed=7, samples_per_prompt=2), dict(reversed(cand.items())), champ) == a  # any order
    assert decide(GateConfig(seed=8, samples_per_prompt=2), cand, champ).lower_bound != a.lower_bound


def test_on_few_prompts_every_flip_is_counted_once_so_the_seed_does_not_matter() -> None:
    cand, champ = pair(5, k=12, n=2, lift=0.1)  # 2^12 flips <= 16 x B: enumerated exactly
    bounds = {decide(GateConfig(seed=s, samples_per_prompt=2), cand, champ).lower_bound for s in range(3)}
    assert len(bounds) == 1


def signed_sum_p_value(d: np.ndarray, signs: np.ndarray, m: float) -> float:
    """The sign-flip test's p-value at shift m, from its definition: the share of sign vectors (rows of
    ``signs``, the observed all-plus row among them) whose signed sum of (d - m) is at least the observed."""
    observed = (d - m).sum()
    return float(np.mean((signs * (d - m)).sum(axis=1) >= observed - 1e-12))


def assert_bound_inverts_the_test(lower: float, d: np.ndarray, signs: np.ndarray, alpha: float) -> None:
    """``lower`` is where the test stops rejecting: rejected just below it, not at it."""
    assert signed_sum_p_value(d, signs, lower - 1e-9) <= alpha < signed_sum_p_value(d, signs, lower)


def test_the_lower_bound_inverts_the_exact_sign_flip_test_of_a_small_example() -> None:
    cand, champ = pair(6, k=7, n=3, lift=0.15)
    config = GateConfig(confidence=0.9, samples_per_prompt=3, min_prompts=7)
    d_i = np.array([np.mean(cand[p]) - np.mean(champ[p]) for p in sorted(cand)])
    signs = np.array(list(itertools.product([1.0, -1.0], repeat=7)))  # all 128 sign vectors
    decision = decide(config, cand, champ)
    assert_bound_inverts_the_test(decision.lower_bound, d_i, signs, 0.1)
    assert decision.accepted == (signed_sum_p_value(d_i, signs, 0.0) <= 0.1)
    lo, hi = decision.difference_interval
    assert_bound_inverts_the_test(lo, d_i, signs, 0.05)
    assert_bound_inverts_the_test(-hi, -d_i, signs, 0.05)  # the upper end: the same test on -d


def test_the_lower_bound_inverts_the_random_sign_flip_test_computed_directly() -> None:
    cand, champ = pair(16, k=24, n=3, lift=0.1)
    config = GateConfig(seed=11, bootstrap_samples=5000, confidence=0.9, samples_per_prompt=3)
    d_i = np.array([np.mean(cand[p]) - np.mean(champ[p]) for p in sorted(cand)])
    rng = np.random.default_rng(11)
    rng.integers(0, 24, size=(5000, 24))  # the bootstrap's indices come first
    signs = np.where(rng.random((5000, 24)) < 0.5, -1.0, 1.0)
    signs = np.vstack([np.ones(24), signs])  # the observed signs count too: p = (1 + #) / (B + 1)
    assert_bound_inverts_the_test(decide(config, cand, champ).lower_bound, d_i, signs, 0.1)


def test_unanimous_prompts_are_accepted_once_there_are_enough_of_them() -> None:
    # every prompt in the candidate's favour: p = 2^-K, so 6 prompts pass at 95% (1/64) and 5 (1/32) would
    # not be two-sided; GateConfig refuses min_prompts 5 rather than a gate that can never bound both ends
    cand = {f"p{i}": [0.9] for i in range(6)}
    champ = {f"p{i}": [0.4 + 0.01 * i] for i in range(6)}
    d = decide(GateConfig(min_prompts=6, samples_per_prompt=1), cand, champ)
    # the 64 flips' values sorted: -inf (none flipped), 0.45, 0.455 (two flipped), 0.46, ...; three of 64 (4.7%)
    # are <= any m below 0.46, so the test rejects up to there: LB = 0.46, the two-sided 2.5% end 0.45
    assert d.accepted and d.lower_bound == pytest.approx(0.46) and d.difference_interval[0] == pytest.approx(0.45)
    assert not decide(GateConfig(min_prompts=6, samples_per_prompt=1, margin=0.46), cand, champ).accepted
    assert gate.fewest_prompts(0.95) == 6 and gate.fewest_prompts(0.9) == 5 and gate.fewest_prompts(0.99) == 8


@pytest.mark.parametrize("k", [9, 24])  # exact flips, random flips
def test_drawing_the_resamples_in_chunks_changes_nothing(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    cand, champ = pair(7, k=k, n=1, lift=0.1)
    config = GateConfig(samples_per_prompt=1, bootstrap_samples=2000)
    whole = decide(config, cand, champ)
    monkeypatch.setattr(gate, "CHUNK_DRAWS", 5 * k)  # 5 resamples a chunk
    assert decide(config, cand, champ) == whole


def test_a_real_difference_is_found_on_30_prompts() -> None:
    config = GateConfig(rule="superiority", margin=0.0, confidence=0.95, bootstrap_samples=2000)
    powered = sum(decide(config.model_copy(update={"seed": s}), *pair(2000 + s, k=30, n=4, lift=0.2)).accepted
                  for s in range(20))
    assert powered >= 18, powered


def test_too_few_prompts_is_a_refusal_naming_min_prompts() -> None:
    cand, champ = pair(8, k=5, n=4, lift=0.5)
    d = decide(GateConfig(min_prompts=8), cand, champ)
    assert not d.accepted and d.prompts == 5 and d.lower_bound is None
    assert one_line(d.reason) == "refused: too few eval prompts: 5 paired prompts, fewer than min_prompts 8"
    assert not first_promotion(GateConfig(min_prompts=8), cand).accepted


@pytest.mark.parametrize("side", ["candidate", "champion"])
def test_zero_prompts_is_an_error(side: str) -> None:
    cand, champ = pair(9, k=8, n=4, lift=0.0)
    args = ({}, champ) if side == "candidate" else (cand, {})
    with pytest.raises(GateError, match=f"zero eval prompts for the {side}: it needs at least min_prompts 8") as e:
        decide(GateConfig(), *args)
    one_line(str(e.value))


def test_different_prompt_sets_are_an_error_naming_the_prompts() -> None:
    cand, champ = pair(10, k=10, n=4, lift=0.0)
    champ["prompt-extra"] = champ.pop("prompt-003")
    with pytest.raises(GateError) as e:
        decide(GateConfig(), cand, champ)
    assert one_line(str(e.value)) == (
        "the candidate and the champion were evaluated on different prompts: only the candidate has 1 "
        "('prompt-003'); only the champion has 1 ('prompt-extra'); the paired test needs the same prompts on both "
        "sides")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_an_error_naming_the_prompt(bad: float) -> None:
    cand, champ = pair(11, k=10, n=4, lift=0.0)
    champ["prompt-004"][2] = bad
    with pytest.raises(GateError, match=r"champion prompt 'prompt-004' has a non-finite reward \((nan|inf)\)") as e:
        decide(GateConfig(), cand, champ)
    one_line(str(e.value))


def test_a_prompt_without_n_rewards_is_an_error_naming_samples_per_prompt() -> None:
    cand, champ = pair(12, k=10, n=4, lift=0.0)
    cand["prompt-001"] = cand["prompt-001"][:3]
    with pytest.raises(GateError, match="candidate prompt 'prompt-001' has 3 rewards; samples_per_prompt is 4"):
        decide(GateConfig(samples_per_prompt=4), cand, champ)


@pytest.mark.parametrize("fields,setting", [
    ({"margin": 1.5}, "margin"), ({"margin": -0.01}, "margin"), ({"margin": float("nan")}, "margin"),
    ({"confidence": 0.5}, "confidence"), ({"confidence": 1.0}, "confidence"), ({"confidence": 0.3}, "confidence"),
    ({"bootstrap_samples": 10}, "bootstrap_samples"), ({"min_prompts": 1}, "min_prompts"),
    ({"confidence": float("nan")}, "confidence"), ({"margin": float("inf")}, "margin"),
    ({"samples_per_prompt": 0}, "samples_per_prompt"), ({"rule": "better"}, "rule"), ({"margins": 0.1}, "margins"),
])
def test_a_setting_out_of_range_is_a_one_line_error_naming_it(fields: dict, setting: str) -> None:
    with pytest.raises(ValidationError) as e:
        GateConfig(**fields)
    assert one_line(describe_validation_error(e.value)).startswith(f"{setting}: ")


def test_a_confidence_the_bootstrap_cannot_resolve_names_bootstrap_samples() -> None:
    with pytest.raises(ValidationError, match="raise bootstrap_samples to at least 10000") as e:
        GateConfig(confidence=0.999, bootstrap_samples=5000)
    one_line(describe_validation_error(e.value))
    GateConfig(confidence=0.999, bootstrap_samples=10_000, min_prompts=11)


def test_a_min_prompts_that_could_never_accept_is_refused_naming_the_fewest() -> None:
    with pytest.raises(ValidationError, match="raise min_prompts to at least 6") as e:
        GateConfig(min_prompts=5)
    one_line(describe_validation_error(e.value))
    with pytest.raises(ValidationError, match="raise min_prompts to at least 8"):
        GateConfig(min_prompts=7, confidence=0.99)
    GateConfig(min_prompts=6)


def test_a_side_that_could_not_be_evaluated_is_refused() -> None:
    cand, champ = pair(13, k=10, n=4, lift=0.5)
    d = decide(GateConfig(), cand, None, champion="step-1")
    assert not d.accepted and d.reason == ("refused: the champion step-1 could not be evaluated, so the candidate "
                                           "cannot be compared")
    assert not decide(GateConfig(), None, champ).accepted
    assert "candidate could not be evaluated" in decide(GateConfig(), None, champ).reason


def test_a_first_promotion_is_accepted_on_the_candidates_own_eval() -> None:
    cand, _ = pair(14, k=10, n=4, lift=0.0)
    d = first_promotion(GateConfig(), cand, candidate="step-1")
    assert d.accepted and d.champion is None and d.champion_mean is None and d.lower_bound is None
    assert d.reason.startswith("accepted: first promotion, the deployment has no champion to compare with; the "
                               "candidate's own eval succeeded")
    lo, hi = d.candidate_interval
    assert lo <= d.candidate_mean <= hi
    assert not first_promotion(GateConfig(), None).accepted
    cand["prompt-000"][0] = float("nan")
    with pytest.raises(GateError, match="prompt-000"):
        first_promotion(GateConfig(), cand)


def test_the_decision_round_trips_as_json_and_renders_as_a_table() -> None:
    cand, champ = pair(15, k=16, n=4, lift=0.4)
    d = decide(GateConfig(margin=0.02), cand, champ, candidate="step-2", champion="step-1")
    assert Decision.from_json(d.to_json()) == d
    data = json.loads(d.to_json())
    assert data["accepted"] is True and data["rule"] == "superiority" and len(data["difference_interval"]) == 2
    table = d.markdown_table().splitlines()
    assert table[:3] == ["| | |", "|---|---|", "| Decision | accepted |"]
    assert "| Champion | `step-1` |" in table and "| Prompts x samples | 16 x 4 |" in table
    assert f"| 95% lower bound of the difference (one-sided) | {d.lower_bound:+.3f} > +0.020 (threshold) |" in table
    assert table[-1] == f"| Reason | {d.reason} |"


@pytest.mark.parametrize(("confidence", "fewest"), [(0.95, 6), (0.999, 11)])
def test_a_min_prompts_that_could_never_accept_is_refused(confidence, fewest):
    """With K prompts all in the candidate's favour the sign-flip p-value is 2^-K: below the fewest
    that can reach the confidence the gate could only refuse, so the setting is refused, naming it."""
    GateConfig(confidence=confidence, min_prompts=fewest)
    with pytest.raises(ValidationError, match="min_prompts"):
        GateConfig(confidence=confidence, min_prompts=fewest - 1)
