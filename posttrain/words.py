"""Counts in messages: ``plural(1, "checkpoint")`` is "1 checkpoint", ``plural(2, "checkpoint")``
"2 checkpoints" (the log lines, artifact descriptions and CLI output said "1 checkpoints")."""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``many``, or ``noun`` + "s") unless ``count`` is 1."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
