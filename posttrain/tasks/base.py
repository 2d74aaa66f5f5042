"""What every task shares: the ``Task`` object, the hash split into train and eval, seeded sampling,
and the checks every reward function makes on its arguments.

A task's problems come in strata (for arithmetic: an operation and the operands' digit counts). Each
problem has a key ("23 + 58"); the SHA-256 of ``"<task>|<key>"`` puts it in eval (EVAL_PERCENT of
the problems) or in train, whatever the seed or the number of rows asked for, so no train row is
ever an eval problem. ``rows`` takes the strata in turn, drawing each one's problems of the split
without replacement; a stratum whose problems are all used sits out, and a problem repeats only
once every problem of the split is in the rows (then all are reshuffled). Pure Python.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from posttrain.rewards import completion_text

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
#: The share of each stratum's problems (by hash, so about this share) that only the eval split has.
EVAL_PERCENT = 20


def split_of(task: str, key: str) -> Split:
    """The split problem ``key`` of ``task`` belongs to: a property of the problem, not of a seed."""
    bucket = int.from_bytes(hashlib.sha256(f"{task}|{key}".encode()).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


@dataclass(frozen=True)
class Task:
    """A task with verifiable rewards: seeded prompt rows and the reward functions that score them.

    ``strata`` lists the problem keys of each stratum; ``make_row(key)`` builds a row's columns
    besides ``task`` (``prompt`` and ``answer`` at least). ``reward_funcs`` are import paths
    (``module:function``) for a trainer's ``reward_funcs``, ``reward_weights`` their default weights.
    """

    name: str
    description: str
    reward_funcs: tuple[str, ...]
    reward_weights: tuple[float, ...]
    strata: Callable[[], Sequence[Sequence[str]]]
    make_row: Callable[[str], dict[str, Any]]

    def __post_init__(self) -> None:
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"task {self.name!r}: {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward functions")

    def pools(self, split: Split) -> list[list[str]]:
        """Each stratum's problem keys in ``split``, in the strata's order."""
        return [list(p) for p in _pools(self, _checked_split(split))]

    def rows(self, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` rows of ``split``; the same (split, n, seed) always gives the same rows."""
        split = _checked_split(split)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a whole number >= 1, got {n!r}")
        rng = random.Random(f"{self.name}|{split}|{seed}")
        pools = _pools(self, split)
        queues: list[list[str]] = [[] for _ in pools]
        keys: list[str] = []
        s = 0
        while len(keys) < n:
            if not any(queues):  # every problem of the split used: a fresh shuffle of each stratum
                for q, pool in zip(queues, pools, strict=True):
                    q[:] = pool
                    rng.shuffle(q)
            if queues[s]:  # a stratum with all its problems used sits out until the others are too
                keys.append(queues[s].pop())
            s = (s + 1) % len(pools)
        rng.shuffle(keys)
        return [{**self.make_row(key), "task": self.name} for key in keys]

    def write_jsonl(self, path: str | Path, split: Split, n: int, seed: int = 0) -> Path:
        """Write ``rows(split, n, seed)`` as JSONL (one row a line), ready for ``stage_dataset``."""
        rows = self.rows(split, n, seed)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return path


@cache
def _pools(task: Task, split: Split) -> tuple[tuple[str, ...], ...]:
    pools = tuple(tuple(k for k in stratum if split_of(task.name, k) == split) for stratum in task.strata())
    if not pools or not all(pools):
        raise ValueError(f"task {task.name!r}: a stratum has no {split} problems")
    return pools


def _checked_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return split  # type: ignore[return-value]


def completion_texts(func: str, completions: Sequence[Any], **columns: Sequence[Any]) -> list[str]:
    """The text of each completion (a string or a list of chat messages), after checking that every
    column has one value per completion; a ValueError or TypeError naming ``func`` otherwise."""
    if isinstance(completions, str | bytes) or not isinstance(completions, Sequence):
        raise TypeError(f"{func}: completions must be a list, got {type(completions).__name__}")
    for name, values in columns.items():
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise TypeError(f"{func}: {name} must be a list (one per completion), got {type(values).__name__}")
        if len(values) != len(completions):
            raise ValueError(f"{func}: {len(completions)} completions but {len(values)} {name} values")
    texts = []
    for i, c in enumerate(completions):
        if not isinstance(c, str) and not (isinstance(c, list) and all(isinstance(m, dict) for m in c)):
            raise TypeError(f"{func}: completion {i} is {type(c).__name__}, not a string or a list of chat messages")
        texts.append(completion_text(c))
    return texts


def whole_number(func: str, column: str, i: int, value: Any) -> int:
    """A reference column's value as an int ("7" or 7); a ValueError naming the row otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{func}: {column}[{i}] is {value!r}, not a whole number")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{func}: {column}[{i}] is {value!r}, not a whole number") from None
