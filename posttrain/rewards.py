"""Reward functions with TRL's signature, referenced by import path (``posttrain.rewards:correctness``).

TRL calls ``reward(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and
expects one float (or None) per completion. Completions are strings for plain-text prompts and
``[{"role": "assistant", "content": ...}]`` for conversational ones. Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TOKEN = re.compile(r"[A-Za-z]+|-?\d+")


def completion_text(completion: str | Sequence[dict]) -> str:
    """The text of one completion, whether TRL passed a string or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def format_reward(completions: list, max_chars: int = 32, **kwargs) -> list[float]:
    """Answer-shaped completions: 1.0 for one short non-empty line, 0.5 for short but multi-line, else 0.0."""
    scores = []
    for c in completions:
        text = completion_text(c).strip()
        if not text or len(text) > max_chars:
            scores.append(0.0)
        else:
            scores.append(1.0 if "\n" not in text else 0.5)
    return scores


def correctness_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the first word or number of the completion is the reference ``answer`` column,
    0.5 when the answer appears later, else 0.0 (case-insensitive)."""
    scores = []
    for c, ref in zip(completions, answer, strict=True):
        tokens = [t.lower() for t in _TOKEN.findall(completion_text(c))]
        ref = str(ref).strip().lower()
        if tokens and tokens[0] == ref:
            scores.append(1.0)
        elif ref in tokens:
            scores.append(0.5)
        else:
            scores.append(0.0)
    return scores


def length_reward(completions: list, target_chars: int = 8, **kwargs) -> list[float]:
    """Dense shaping for untrained models: 1.0 at ``target_chars`` characters, falling linearly to 0."""
    return [max(0.0, 1.0 - abs(len(completion_text(c).strip()) - target_chars) / target_chars) for c in completions]
