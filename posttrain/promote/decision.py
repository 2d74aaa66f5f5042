"""The promotion gate's decision rule: is the candidate better (or not worse) than the champion?

The rule, exactly as implemented (docs/promotion.md, "The decision rule"):

1. Both sides were evaluated on the same K prompts with ``samples_per_prompt`` (n) rewards per
   prompt. Each side's score on prompt i is the mean of its n rewards: c_i for the candidate,
   h_i for the champion. The paired difference is d_i = c_i - h_i.
2. A paired sign-flip (randomization) test, inverted into a lower confidence bound. With no true
   difference the two sides of a prompt are exchangeable, so each d_i is as likely to have either
   sign. A flip negates d on a subset of the prompts; its value m_b is the mean of d over the
   prompts it flips (-inf for the empty subset: the observed signs). For any shift m, flip b's sum
   of signed (d - m) is at least the observed one exactly when m_b <= m, so the test's p-value at
   m is p(m) = #{b: m_b <= m} / N over its N flips:
   - all N = 2^K subsets once (exact, no randomness) when 2^K <= 16 * B, B = ``bootstrap_samples``;
   - else N = B + 1: the observed signs and B random flips, prompt i flipped where row b of
     ``rng.random((B, K))`` is below 0.5 (``rng`` as in step 4, after the bootstrap's draws; in row
     chunks, which draws the same numbers). Such a p-value is valid for any B.
3. LB is the value at index floor((1 - confidence) * N) of the sorted m_b: the smallest shift the
   test does not reject at level 1 - confidence (p(m) <= 1 - confidence rejects). superiority
   accepts when LB > margin; non-inferiority when LB > -margin. Anything else (LB equal to the
   threshold included) is a refusal. The percentile bootstrap this replaced was liberal on few
   prompts (8.2% false accepts at K = 8 for 5% nominal); the test holds its level at every K
   when the two sides are exchangeable, i.e. at margin 0 (docs/promotion.md, "Calibration",
   measured by bench/gate_calibration.py and tests/promote/test_gate_calibration.py). At a margin
   above 0 it assumes the differences shifted by the margin are symmetric, which bounded rewards
   need not be: that case is not calibrated yet.
4. Reported with it: both means with two-sided ``confidence`` percentile bootstrap intervals (the
   (B, K) prompt indices ``rng.integers(0, K, (B, K))`` of ``rng = numpy.random.default_rng(seed)``,
   in row chunks), the mean difference with its two-sided interval from the same flips (the test
   inverted at (1 - confidence) / 2 on each side), K, n, the rule, margin, confidence, seed and a
   one-line reason.

Unanimous prompts give the test its smallest p-value, 2^-K: ``GateConfig`` refuses a ``min_prompts``
with 2^-min_prompts > (1 - confidence) / 2 (6 at 0.95), with which the gate could never bound the
difference whatever the rewards.

Before any of that: a candidate or champion that could not be evaluated (None) is refused;
fewer than ``min_prompts`` paired prompts is refused ("too few"); zero prompts, different prompt
sets on the two sides, a prompt without exactly n rewards or a non-finite reward raise
``GateError`` (the eval is broken, not the candidate). With no champion at all (the deployment's
first promotion) the champion is what production serves, its boot weights (``first_promotion:
beat_boot``, the default: the same rule against them), or ``first_promotion`` accepts a candidate
whose own eval is valid (``own_eval``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

Rule = Literal["superiority", "non-inferiority"]
Rewards = Mapping[str, Sequence[float]]  # prompt id -> the n rewards of its samples

# Rewards of the built-in functions (posttrain.rewards) lie in [0, 1]: a margin of 1 already spans
# their whole range, so a larger one can only be a typo.
MAX_MARGIN = 1.0
# The tail quantile must rest on enough resamples to be stable: (1 - confidence) * B >= this.
MIN_TAIL_RESAMPLES = 10
# Index draws per chunk of resamples: bounds the memory to tens of MiB whatever K and B.
CHUNK_DRAWS = 1 << 20
# The sign-flip test enumerates all 2^K flips while they are at most this many times B (exact and,
# at the K that matter most, deterministic); above, B random ones hit "no flip" with odds < 1/16.
EXACT_FLIPS_PER_SAMPLE = 16


class GateError(ValueError):
    """The eval results cannot be judged (no prompts, different prompt sets, a bad reward)."""


class GateConfig(BaseModel):
    """How the gate compares a candidate with the champion (docs/promotion.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # superiority by default: the promise is that a checkpoint reaches production only when
    # it is better. Non-inferiority compares each candidate with the champion of the day, so a run
    # of candidates each up to `margin` worse may drift production down ("bio-creep"): opt in.
    rule: Rule = Field("superiority", description="superiority: the candidate must beat the champion by more "
                       "than margin; non-inferiority: it must not be worse than the champion minus margin.")
    margin: float = Field(0.0, ge=0.0, le=MAX_MARGIN, allow_inf_nan=False,
                          description=f"Margin in reward units, 0 to {MAX_MARGIN:g} (see rule).")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, allow_inf_nan=False, description="Level of the one-sided lower confidence "
                              "bound of the mean difference, in (0.5, 1).")
    bootstrap_samples: int = Field(10_000, ge=1_000, le=1_000_000, description="Random sign flips of the test, "
                                   "and bootstrap resamples of the prompts for the intervals of the means.")
    seed: int = Field(0, ge=0, description="Seed of the numpy Generator of the sign flips and the bootstrap: the "
                      "same inputs give the same decision.")
    min_prompts: int = Field(8, ge=2, description="Fewest paired prompts the gate judges on; fewer is a refusal.")
    samples_per_prompt: int = Field(4, ge=1, description="Rewards (sampled completions) per prompt on each side.")
    first_promotion: Literal["beat_boot", "own_eval"] = Field(
        "beat_boot", description="A deployment's first candidate (its history has no champion): beat_boot holds "
        "it to the rule against what production serves, its boot weights, evaluated on production itself, so "
        "a run that made the model worse is never promoted; own_eval accepts it on its own eval alone (for a "
        "production whose boot weights are no baseline, or that cannot be sampled).")

    @model_validator(mode="after")
    def _tail_is_sampled(self) -> GateConfig:
        tail = (1.0 - self.confidence) * self.bootstrap_samples
        if tail < MIN_TAIL_RESAMPLES:
            raise ValueError(f"confidence {self.confidence:g} with bootstrap_samples {self.bootstrap_samples} leaves "
                             f"{tail:.1f} resamples below the bound; raise bootstrap_samples to at least "
                             f"{int(np.ceil(MIN_TAIL_RESAMPLES / (1.0 - self.confidence)))}")
        # unanimous prompts give the sign-flip test a p-value of 2^-K: too few could never accept
        fewest = fewest_prompts(self.confidence)
        if self.min_prompts < fewest:
            raise ValueError(f"min_prompts {self.min_prompts} is too few for confidence {self.confidence:g}: even "
                             f"{self.min_prompts} prompts all in the candidate's favour cannot bound the difference; "
                             f"raise min_prompts to at least {fewest}")
        return self

    @property
    def threshold(self) -> float:
        """What the lower bound must exceed."""
        return self.margin if self.rule == "superiority" else -self.margin


Interval = tuple[float, float]


class Decision(BaseModel):
    """The gate's verdict and the numbers behind it; ``to_json`` goes into the promotion history."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accepted: bool = Field(description="Whether the candidate may be promoted.")
    reason: str = Field(description="One line: accepted/refused and why.")
    rule: Rule = Field(description="The rule applied.")
    margin: float = Field(description="Margin in reward units.")
    confidence: float = Field(description="Level of the lower bound and of the intervals.")
    bootstrap_samples: int = Field(description="Bootstrap resamples.")
    seed: int = Field(description="Seed of the bootstrap.")
    candidate: str | None = Field(None, description="The candidate snapshot's identity, when given.")
    champion: str | None = Field(None, description="The champion snapshot's identity; None for a first promotion.")
    prompts: int = Field(0, description="Paired prompts judged on.")
    samples_per_prompt: int = Field(description="Rewards per prompt on each side.")
    candidate_mean: float | None = Field(None, description="Candidate's mean over prompts of per-prompt mean reward.")
    champion_mean: float | None = Field(None, description="Champion's mean reward, the same way.")
    difference: float | None = Field(None, description="candidate_mean - champion_mean.")
    candidate_interval: Interval | None = Field(None, description="Two-sided percentile bootstrap interval of "
                                                "candidate_mean.")
    champion_interval: Interval | None = Field(None, description="Two-sided percentile bootstrap interval of "
                                               "champion_mean.")
    difference_interval: Interval | None = Field(None, description="Two-sided interval of difference: the sign-flip "
                                                 "test inverted (records before it: percentile bootstrap).")
    lower_bound: float | None = Field(None, description="One-sided lower confidence bound of the difference: the "
                                      "sign-flip test inverted (records before it: percentile bootstrap).")
    threshold: float | None = Field(None, description="What lower_bound had to exceed: margin or -margin.")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Decision:
        return cls.model_validate_json(data)

    def markdown_table(self, *, reason: bool = True) -> str:
        """The decision as a Markdown table (a Prefect artifact); without the reason's row when the
        page shows it already (a long line runs off the UI's table)."""
        pct = f"{self.confidence * 100:g}%"

        def num(x: float | None, iv: Interval | None = None, signed: bool = False) -> str:
            if x is None:
                return "-"
            fmt = "{:+.3f}" if signed else "{:.3f}"
            return fmt.format(x) + (f" [{fmt.format(iv[0])}, {fmt.format(iv[1])}]" if iv else "")

        rows = [
            ("Decision", "accepted" if self.accepted else "refused"),
            ("Candidate", f"`{self.candidate}`" if self.candidate else "-"),
            ("Champion", f"`{self.champion}`" if self.champion else "none"),
            ("Rule", f"{self.rule}, margin {self.margin:g}"),
            ("Prompts x samples", f"{self.prompts} x {self.samples_per_prompt}"),
            (f"Candidate mean reward ({pct} interval)", num(self.candidate_mean, self.candidate_interval)),
            (f"Champion mean reward ({pct} interval)", num(self.champion_mean, self.champion_interval)),
            (f"Difference ({pct} interval)", num(self.difference, self.difference_interval, signed=True)),
            (f"{pct} lower bound of the difference (one-sided)",
             "-" if self.lower_bound is None else
             f"{self.lower_bound:+.3f} {'>' if self.accepted else '<='} {self.threshold:+.3f} (threshold)"),
            ("Sign flips, bootstrap", f"{self.bootstrap_samples} of each, seed {self.seed}"),
            *([("Reason", self.reason.replace("|", "\\|"))] if reason else []),
        ]
        return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def decide(config: GateConfig, candidate_rewards: Rewards | None, champion_rewards: Rewards | None, *,
           candidate: str | None = None, champion: str | None = None, champion_name: str | None = None) -> Decision:
    """Judge the candidate against the champion on paired per-prompt rewards.

    ``None`` for a side means it could not be evaluated: a refusal. A deployment without any
    champion goes through ``first_promotion`` instead (or, with ``first_promotion: beat_boot``,
    here with ``champion`` None and ``champion_name`` saying what production serves), so that a
    missing champion eval is never mistaken for a first promotion."""
    base = _base(config, candidate, champion)
    named = champion_name or (f"the champion {champion}" if champion else "the champion")
    cand = None if candidate_rewards is None else _prompt_means("candidate", candidate_rewards, config)
    champ = None if champion_rewards is None else _prompt_means("champion", champion_rewards, config)
    if cand is None:
        return Decision(**base, reason="refused: the candidate could not be evaluated")
    if champ is None:
        return Decision(**base, reason=f"refused: {named} could not be evaluated, so the candidate cannot be compared")
    _same_prompts(cand, champ)
    if (short := _too_few(config, len(cand))) is not None:
        return Decision(**base, prompts=len(cand), reason=short)
    ids = sorted(cand)  # a fixed order, whatever order each side's mapping came in
    c = np.array([cand[p] for p in ids])
    h = np.array([champ[p] for p in ids])
    rng = np.random.default_rng(config.seed)
    boot = bootstrap_means(np.stack([c, h], axis=1), config.bootstrap_samples, rng)
    flips = flip_means(c - h, config.bootstrap_samples, rng)
    alpha = 1.0 - config.confidence
    lower = _lower_bound(flips, alpha)
    difference_interval = (_lower_bound(flips, alpha / 2), -_lower_bound(-flips, alpha / 2))
    if not np.isfinite([lower, *difference_interval]).all():  # min_prompts makes this (near) impossible
        return Decision(**base, prompts=len(ids), reason=f"refused: the sign-flip test cannot bound the difference "
                        f"on {len(ids)} prompts with {config.bootstrap_samples} flips; raise min_prompts")
    accepted = lower > config.threshold  # both finite: every reward was checked finite
    sign = ">" if accepted else "<="
    bound = (f"margin {config.margin:g}" if config.rule == "superiority" else f"-margin {-config.margin:+g}")
    whose = (champion_name + ("'" if champion_name.endswith("s") else "'s")) if champion_name else "the champion's"
    reason = (f"{'accepted' if accepted else 'refused'}: the candidate's mean reward is {c.mean():.3f} vs "
              f"{whose} {h.mean():.3f} over {len(ids)} prompts x {config.samples_per_prompt} samples; the "
              f"{config.confidence * 100:g}% lower bound of the difference is {lower:+.3f} {sign} {bound} "
              f"({config.rule})")
    return Decision(
        **{**base, "accepted": accepted}, reason=reason, prompts=len(ids),
        candidate_mean=float(c.mean()), champion_mean=float(h.mean()), difference=float((c - h).mean()),
        candidate_interval=_interval(boot[:, 0], config.confidence),
        champion_interval=_interval(boot[:, 1], config.confidence),
        difference_interval=difference_interval, lower_bound=lower, threshold=config.threshold,
    )


def first_promotion(config: GateConfig, candidate_rewards: Rewards | None, *, candidate: str | None = None) -> Decision:
    """The deployment has no champion: accept a candidate whose own eval is valid and large enough."""
    base = _base(config, candidate, None)
    if candidate_rewards is None:
        return Decision(**base, reason="refused: the candidate could not be evaluated (first promotion)")
    cand = _prompt_means("candidate", candidate_rewards, config)
    if (short := _too_few(config, len(cand))) is not None:
        return Decision(**base, prompts=len(cand), reason=short)
    c = np.array([cand[p] for p in sorted(cand)])
    boot = bootstrap_means(c[:, None], config.bootstrap_samples, np.random.default_rng(config.seed))
    return Decision(
        **{**base, "accepted": True}, prompts=len(c), candidate_mean=float(c.mean()),
        candidate_interval=_interval(boot[:, 0], config.confidence),
        reason=(f"accepted: first promotion, the deployment has no champion to compare with; the candidate's own "
                f"eval succeeded (mean reward {c.mean():.3f} over {len(c)} prompts x {config.samples_per_prompt} "
                "samples)"),
    )


def already_champion(config: GateConfig, identity: str, deployment: str) -> Decision:
    """The decision for a candidate that is the champion already (a retried promotion): nothing to compare."""
    return Decision(**{**_base(config, identity, identity), "accepted": True},
                    reason=f"accepted: {identity} is the champion of {deployment} already; nothing to compare")


def fewest_prompts(confidence: float) -> int:
    """The fewest prompts with which the sign-flip test bounds the difference on both sides at
    ``confidence``: 2^-K <= (1 - confidence) / 2 (K prompts give it 2^K flips, of which one is the
    observed signs). Fewer could never accept, whatever the rewards."""
    return int(np.ceil(np.log2(2.0 / (1.0 - confidence)) - 1e-9))


def bootstrap_means(values: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``values`` (K prompts x columns) over ``samples`` resamples of its rows with replacement.

    The indices are ``rng.integers(0, K, (samples, K))``, drawn in row chunks (Generator draws the
    same numbers either way) so memory stays bounded."""
    k = values.shape[0]
    out = np.empty((samples, values.shape[1]))
    rows = max(1, CHUNK_DRAWS // k)
    for start in range(0, samples, rows):
        stop = min(samples, start + rows)
        idx = rng.integers(0, k, size=(stop - start, k))
        for col in range(values.shape[1]):  # a gather per column: several times faster than of rows
            out[start:stop, col] = values[:, col][idx].mean(axis=1)
    return out


def flip_means(d: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """The values m_b of the sign flips of ``d`` (module docstring, step 2): the mean of ``d`` over
    the prompts a flip negates, -inf for the flip of none. All 2^K flips when 2^K <= 16 x
    ``samples``, else the observed signs and ``samples`` random flips from ``rng``."""
    k = d.shape[0]
    exact = 2**k <= EXACT_FLIPS_PER_SAMPLE * samples
    total = 2**k if exact else samples + 1
    out = np.empty(total)
    out[0] = -np.inf  # no prompt flipped: exact enumeration's pattern 0, or the observed signs
    rows = max(1, CHUNK_DRAWS // k)
    for start in range(1, total, rows):
        stop = min(total, start + rows)
        if exact:
            flipped = (np.arange(start, stop)[:, None] >> np.arange(k)) & 1 == 1
        else:
            flipped = rng.random((stop - start, k)) < 0.5
        count = flipped.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[start:stop] = np.where(count > 0, (flipped.astype(float) @ d) / np.maximum(count, 1), -np.inf)
    return out


def _lower_bound(flips: np.ndarray, alpha: float) -> float:
    """The sign-flip test's lower confidence bound at level ``alpha``: the smallest shift m whose
    p-value #{values <= m} / N is above alpha, i.e. the value at index floor(alpha * N) in sorted
    order. For the upper end, pass -flips: -inf (no prompt flipped, which always counts) stays -inf."""
    flips = np.where(np.isinf(flips), -np.inf, flips)
    j = int(np.floor(alpha * flips.size + 1e-9))
    return float(np.partition(flips, j)[j])


def _base(config: GateConfig, candidate: str | None, champion: str | None) -> dict:
    return dict(accepted=False, rule=config.rule, margin=config.margin, confidence=config.confidence,
                bootstrap_samples=config.bootstrap_samples, seed=config.seed, candidate=candidate,
                champion=champion, samples_per_prompt=config.samples_per_prompt)


def _interval(boot: np.ndarray, confidence: float) -> Interval:
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(boot, [tail, 1.0 - tail])
    return float(lo), float(hi)


def _too_few(config: GateConfig, k: int) -> str | None:
    if k >= config.min_prompts:
        return None
    return f"refused: too few eval prompts: {k} paired prompts, fewer than min_prompts {config.min_prompts}"


def _prompt_means(side: str, rewards: Rewards, config: GateConfig) -> dict[str, float]:
    """Each prompt's mean reward, after checking it has exactly n finite rewards."""
    if not isinstance(rewards, Mapping):
        raise GateError(f"the {side}'s rewards must map prompt ids to lists of rewards, not {type(rewards).__name__}")
    if not rewards:
        raise GateError(f"the gate has zero eval prompts for the {side}: it needs at least min_prompts "
                        f"{config.min_prompts} prompts (is the eval prompt set empty?)")
    n = config.samples_per_prompt
    means = {}
    for prompt, values in rewards.items():
        try:
            arr = np.asarray(values, dtype=float)
        except (TypeError, ValueError):
            raise GateError(f"{side} prompt {prompt!r}: rewards must be numbers, got {values!r:.80}") from None
        if arr.ndim != 1 or arr.size != n:
            raise GateError(f"{side} prompt {prompt!r} has {arr.size if arr.ndim == 1 else 'non-list'} rewards; "
                            f"samples_per_prompt is {n}")
        if not np.isfinite(arr).all():
            bad = arr[~np.isfinite(arr)][0]
            raise GateError(f"{side} prompt {prompt!r} has a non-finite reward ({bad}); every reward must be finite")
        means[str(prompt)] = float(arr.mean())
    return means


def _same_prompts(cand: Mapping[str, float], champ: Mapping[str, float]) -> None:
    only_cand, only_champ = sorted(set(cand) - set(champ)), sorted(set(champ) - set(cand))
    if not only_cand and not only_champ:
        return

    def some(ids: list[str]) -> str:
        return ", ".join(repr(p) for p in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")

    parts = [f"only the {side} has {len(ids)} ({some(ids)})"
             for side, ids in (("candidate", only_cand), ("champion", only_champ)) if ids]
    raise GateError("the candidate and the champion were evaluated on different prompts: " + "; ".join(parts)
                    + "; the paired test needs the same prompts on both sides")
