"""Counts in messages agree with their nouns: "1 checkpoint", "2 checkpoints" (issue 37: "1 trainer
attempts", "1 checkpoints published")."""

from __future__ import annotations

from posttrain.words import plural


def test_one_is_singular_and_every_other_count_plural():
    assert [plural(n, "checkpoint") for n in (0, 1, 2)] == ["0 checkpoints", "1 checkpoint", "2 checkpoints"]
    assert plural(1, "trainer attempt") == "1 trainer attempt"
    assert [plural(n, "process", "processes") for n in (1, 3)] == ["1 process", "3 processes"]
