"""A reward for tests of the eval gate: how closely a completion follows a reference continuation.

``reference_match`` scores the share of the ``reference_ids`` column's tokens that the completion
reproduces at the same positions: 1.0 for the model that wrote the references (greedy), near 0 for
another. It makes "better" and "worse" checkpoints of a tiny random model deterministic."""

from __future__ import annotations


def reference_match(completion_ids: list, reference_ids: list, **kwargs) -> list[float]:
    scores = []
    for ids, ref in zip(completion_ids, reference_ids, strict=True):
        ref = list(ref)
        scores.append(sum(a == b for a, b in zip(ids, ref, strict=False)) / len(ref) if ref else 0.0)
    return scores
