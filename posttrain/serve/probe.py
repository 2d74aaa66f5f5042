"""Does the engine hold the weights it was told to load? The snapshot's probe answers that.

A shape check, or answers that merely changed, do not prove it: engines keep cached weights,
drop a tensor silently, serve a stale graph. Each checkpoint carries ``posttrain.probe.json``
(``posttrain.chain.probe``): fixed prompts, their greedy completions on the saved weights and
each completion token's logprob. After a switch the gateway has the engine score every probe
sequence (``prompt + expected completion``, teacher-forced: prompt logprobs) and :func:`judge`
compares those with the version's expected answers and with the previous version's.

The reference engine scores in process (:func:`score_with_model`); a vLLM server scores through
its completions endpoint (:func:`completions_body`, :func:`parse_prompt_logprobs`). No HTTP and no
engine imports here; torch only inside :func:`score_with_model`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.chain.probe import PROBE_NAME, Probe, probe_bytes, read_probe
from posttrain.serve.checks import model_depth

log = logging.getLogger(__name__)

__all__ = ["PROBE_NAME", "Probe", "Verdict", "completions_body", "judge", "judge_folder", "parse_prompt_logprobs",
           "probe_bytes", "read_probe", "score_with_model", "tolerance", "versions_distance"]

# The largest absolute difference allowed between an engine's logprob of a probe token and the
# trainer's, by dtype of the weights. Measured on the tiny model (posttrain.models.tiny, seeds 0-2,
# hidden 64 tied and hidden 128 untied, transformers 5.24 / torch 2.13 CPU; max over the 4x8 probe
# tokens, every token's |logprob| about 5; bench/probe_tolerance.py repeats them):
#   float32: the same computation again, and all four sequences in one batch against one at a time:
#            0.0 exactly. vLLM's float32 CPU build matches transformers within 1e-6 (repo notes,
#            test_vllm_process asserts 1e-5). 1e-3 leaves 100x that for other kernels and batch
#            shapes; one training step of the tiny model moves the answers by more.
#   bfloat16: the same bf16 weights computed in bf16 against computed in float32 (what another
#            kernel's accumulation order or precision does): 0.0049 at most (float32 weights cast
#            to bf16 against float32: 0.0048). bf16 keeps 8 significant bits (relative rounding
#            2^-9) and a deep model accumulates more than 2 layers: 0.1, 20x the measured.
#   float16: the same measurements: 0.00065 and 0.00071 at most; 3 more significant bits than
#            bf16: 0.02, 28x the measured.
# The tiny model's answers are nearly uniform (logprobs near -log(vocab)) and only 2 layers deep,
# so its bf16/fp16 spread understates a real model's: re-measure on one before tightening these.
# Versions closer than the tolerance cannot be told apart; the tolerance check still refuses an
# engine whose weights are further from the version's than that.
TOLERANCES = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.02}
# Another engine's kernels on a deep model: each layer adds its rounding, so the spread grows with depth.
# Measured on SmolLM2-135M-Instruct (30 layers, bfloat16 weights): vLLM's CPU build computing in
# bfloat16 against the trainer's probe (transformers on the saved bfloat16 weights) differed by 0.269
# at most over the 4x8 probe tokens, 0.009 a layer (the reference server, transformers again: 0.0).
# Per layer, 3x that for bfloat16 (30 layers: 0.9), and float16's 3 more significant bits: 8x less.
# A snapshot one small step from the last is then closer than the tolerance, and the probe cannot
# tell the two apart: where the engine reads its weights back, the digests do (docs/serving.md); the
# probe still refuses an engine on weights far from the version's (another model, a stale LM head).
PER_LAYER_TOLERANCES = {"bfloat16": 0.03, "float16": 0.004}


def tolerance(dtype: str, layers: int | None = None) -> float:
    """The allowed max absolute logprob difference for weights of ``dtype`` (float32, bfloat16, float16)
    computed by another engine's kernels; ``layers``: the model's depth, when known (a deep model in a
    coarse dtype is allowed more: ``PER_LAYER_TOLERANCES``)."""
    name = str(dtype).removeprefix("torch.")
    try:
        base = TOLERANCES[name]
    except KeyError:
        raise ValueError(f"no probe tolerance for dtype {dtype!r} (float32, bfloat16, float16)") from None
    return max(base, PER_LAYER_TOLERANCES.get(name, 0.0) * layers) if layers else base


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`judge`: ``ok``, and when not, ``reason`` in one line."""

    ok: bool
    reason: str
    max_difference: float  # the engine's largest difference from the version's expected answers
    tolerance: float
    prompt: int | None = None  # the probe prompt the reason is about

    def __bool__(self) -> bool:
        return self.ok


def _differences(scored: list[list[float]], probe: Probe, what: str) -> list[float]:
    """Per prompt, the largest |scored - expected|; ValueError when the shapes do not match."""
    if len(scored) != len(probe.logprobs):
        raise ValueError(f"{what}: {len(scored)} scored sequences for a probe of {len(probe.logprobs)} prompts")
    out = []
    for i, (got, want) in enumerate(zip(scored, probe.logprobs, strict=True)):
        if len(got) != len(want):
            raise ValueError(f"{what}: probe prompt {i} has {len(want)} completion tokens, {len(got)} were scored")
        # NaN or an infinity on either side is infinitely far: a NaN difference compares below any tolerance
        out.append(max((abs(float(g) - w) if math.isfinite(g) and math.isfinite(w) else math.inf
                        for g, w in zip(got, want, strict=True))))
    return out


def _first_non_finite(rows: list[list[float]]) -> tuple[int, float] | None:
    """The first prompt whose row holds NaN or an infinity, with that value; None when all are finite."""
    for i, row in enumerate(rows):
        for x in row:
            if not math.isfinite(x):
                return i, float(x)
    return None


def _non_finite_name(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{'-' if x < 0 else ''}infinity"


def versions_distance(new: Probe, previous: Probe) -> float:
    """How far apart two versions' expected answers are, where they can be compared: for each
    prompt both probes share, the largest logprob difference over the completion tokens before
    the greedy completions part. 0.0 when nothing is comparable (then the two cannot be told apart
    from their probes alone); infinite when a compared logprob is NaN or infinite."""
    dist = 0.0
    for p, c, lp in zip(new.prompts, new.completions, new.logprobs, strict=True):
        for q, d, lq in zip(previous.prompts, previous.completions, previous.logprobs, strict=True):
            if p != q:
                continue
            for a, b, x, y in zip(c, d, lp, lq, strict=False):
                if a != b:
                    break
                if not (math.isfinite(x) and math.isfinite(y)):
                    return math.inf
                dist = max(dist, abs(x - y))
    return dist


def judge(
    scored_new: list[list[float]],
    new: Probe,
    scored_previous: list[list[float]] | None,
    previous: Probe | None,
    *,
    version: str | None = None,
    previous_version: str | None = None,
    engine_dtype: str | None = None,
    layers: int | None = None,
) -> Verdict:
    """Whether an engine holds ``new``'s weights, from its logprobs of each probe sequence's
    completion tokens (``scored_new`` for ``new.sequences()``, ``scored_previous`` for
    ``previous.sequences()``).

    It does when its answers are within :func:`tolerance` of ``new``'s expected answers on every
    prompt, and, when there is a previous probe whose expected answers differ from ``new``'s by
    more than the tolerance, they are closer to ``new``'s than to the previous version's.
    ``version``/``previous_version`` name the versions in the reason; ``engine_dtype``, the dtype
    the engine computes in, when it may be coarser than the weights' (the larger tolerance wins);
    ``layers``: the model's depth, for an engine whose kernels are not the trainer's (:func:`tolerance`).
    """
    tol = tolerance(new.dtype, layers)
    dtype = new.dtype
    if engine_dtype is not None and tolerance(engine_dtype, layers) > tol:
        tol, dtype = tolerance(engine_dtype, layers), str(engine_dtype).removeprefix("torch.")
    if layers and tol > tolerance(dtype):
        dtype = f"{dtype} at {layers} layers"  # the reason names what the tolerance was derived from
    name = f"version {version}" if version else "the new version"
    diffs = _differences(scored_new, new, "the engine's scores")
    refused = _refuse_non_finite(scored_new, new, scored_previous, previous, name, tol, dtype)
    if refused is not None:
        return refused
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    dist_new = diffs[worst]
    if dist_new > tol:
        return Verdict(False, f"the engine's answers to probe prompt {worst} differ from {name}'s by {dist_new:.3g} "
                              f"(tolerance {tol:g} for {dtype}): it does not hold {name}'s weights",
                       dist_new, tol, worst)
    if previous is not None and scored_previous is not None:
        prev_name = f"version {previous_version}" if previous_version else "the previous version"
        prev_diffs = _differences(scored_previous, previous, "the engine's scores of the previous probe")
        dist_prev = max(prev_diffs)
        if versions_distance(new, previous) > tol and dist_prev <= dist_new:
            return Verdict(False, f"the engine's answers to probe prompt {worst} differ from {name}'s by "
                                  f"{dist_new:.3g}, not less than from {prev_name}'s ({dist_prev:.3g} at most; tolerance "
                                  f"{tol:g} for {dtype}): it still holds {prev_name}'s weights", dist_new, tol, worst)
    return Verdict(True, f"the engine's answers are within {dist_new:.3g} of {name}'s (tolerance {tol:g} for {dtype})",
                   dist_new, tol, worst)


def judge_folder(score: Callable[[tuple[list[int], int]], list[float]], folder: Path, previous: Path | None, *,
                 engine_dtype: str | None = None) -> Verdict | None:
    """:func:`judge` an engine on the probe the trainer stored in ``folder`` (and ``previous``'s, when it has
    one): ``score`` gives the engine's teacher-forced logprobs of one probe sequence. The model's depth
    comes from ``folder``'s config. None when ``folder`` has no probe (another producer's snapshot);
    a malformed probe of ``folder`` raises ValueError naming the file, one of ``previous`` is not compared."""
    probe = read_probe(folder)
    if probe is None:
        return None
    try:
        before = read_probe(previous) if previous is not None else None
    except ValueError as e:
        log.warning("not comparing with the previous version's probe: %s", e)
        before = None
    scored = [score(sequence) for sequence in probe.sequences()]
    scored_before = [score(sequence) for sequence in before.sequences()] if before is not None else None
    return judge(scored, probe, scored_before, before, version=folder.name,
                 previous_version=previous.name if previous is not None else None,
                 engine_dtype=engine_dtype, layers=model_depth(folder))


def _refuse_non_finite(scored_new: list[list[float]], new: Probe, scored_previous: list[list[float]] | None,
                       previous: Probe | None, name: str, tol: float, dtype: str) -> Verdict | None:
    """A failed verdict when a logprob to compare is NaN or infinite (no distance to it means anything);
    None when all are finite."""
    checks = [(new.logprobs, f"{name}'s expected answer", "its probe cannot say which weights the engine holds"),
              (scored_new, "the engine's answer", f"it does not hold {name}'s weights")]
    if previous is not None and scored_previous is not None:
        checks += [(previous.logprobs, "the previous version's expected answer", "the previous version's probe "
                    "cannot be compared with"),
                   (scored_previous, "the engine's answer (scoring the previous version's probe)", "its "
                    "weights are broken")]
    for rows, what, meaning in checks:
        found = _first_non_finite(rows)
        if found is not None:
            prompt, value = found
            return Verdict(False, f"{what} to probe prompt {prompt} is {_non_finite_name(value)} (tolerance {tol:g} "
                                  f"for {dtype}): {meaning}", math.inf, tol, prompt)
    return None


def score_with_model(model, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """Teacher-forced logprobs of each sequence's completion tokens (those from its start index on)
    under an in-process torch causal LM, one sequence at a time, log-softmax in float32: the
    computation the trainer's expected answers come from."""
    from posttrain.trainer.probe import teacher_forced_logprobs

    return teacher_forced_logprobs(model, [(list(ids), int(start)) for ids, start in sequences])


def completions_body(model_name: str, sequence: list[int] | tuple[list[int], int]) -> dict[str, Any]:
    """An OpenAI-style completions request that has a vLLM server score ``sequence`` (token ids, or
    a ``(ids, start)`` pair of ``Probe.sequences()``): its prompt logprobs, one token generated."""
    ids = sequence[0] if isinstance(sequence, tuple) else sequence
    return {"model": model_name, "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "prompt_logprobs": 1}


def _entry_logprob(entry: object, where: str) -> float:
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: not a logprob ({entry!r})")
    return float(value)


def parse_prompt_logprobs(reply: dict[str, Any], start: int, sequence: list[int] | None = None) -> list[float]:
    """The logprobs of the prompt tokens from index ``start`` on, from a vLLM completions reply's
    ``choices[0].prompt_logprobs`` (None for the first token, then per position a dict mapping
    token-id strings to ``{"logprob": x, "rank": r, ...}`` or to a number).

    vLLM lists the top-1 token beside the prompt's own token when they differ: the entry of the
    actual token is taken, by its id from ``sequence`` (the prompt's ids), else from the reply's
    ``prompt_token_ids``, else as the one entry whose rank is not 1. ValueError when the reply has
    no such list or an entry cannot be told apart.
    """
    try:
        choice = reply["choices"][0]
        positions = choice["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the completions reply has no choices[0].prompt_logprobs (does the server support "
                         "prompt_logprobs?)") from None
    if not isinstance(positions, list) or not 1 <= start <= len(positions):
        raise ValueError(f"the reply's prompt_logprobs cannot start at token {start}")
    ids = sequence if sequence is not None else choice.get("prompt_token_ids")
    out = []
    for t in range(start, len(positions)):
        where = f"prompt_logprobs[{t}]"
        entries = positions[t]
        if not isinstance(entries, dict) or not entries:
            raise ValueError(f"{where}: no logprobs for the prompt token")
        if isinstance(ids, list) and t < len(ids):
            key = str(ids[t])
            if key not in entries:
                raise ValueError(f"{where}: no entry for the prompt's token {ids[t]} (got {sorted(entries)})")
            out.append(_entry_logprob(entries[key], where))
            continue
        if len(entries) == 1:
            out.append(_entry_logprob(next(iter(entries.values())), where))
            continue
        own = [e for e in entries.values() if isinstance(e, dict) and e.get("rank") not in (None, 1)]
        if len(own) != 1:
            raise ValueError(f"{where}: {len(entries)} entries and no way to tell the prompt's own token; "
                             "pass the sequence's token ids")
        out.append(_entry_logprob(own[0], where))
    return out
