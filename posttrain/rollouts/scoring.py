"""Scoring rollouts: reward functions named by import path, weighted sums, group advantages.

Reward functions have TRL's signature (``posttrain.rewards``); the trainer's GRPO run and the
rollout shards load them through ``load_reward_funcs``, so a bad name fails the same way in both.
Pure Python: no torch.
"""

from __future__ import annotations

import importlib
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

ScaleRewards = Literal["group", "batch", "none"]


#: A reward function's import path, ``module:function``. "(?!\n)": a schema's pattern is checked with
#: Python's re.search (Prefect's jsonschema), where "$" alone also matches before a final newline.
REWARD_FUNC_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$(?!\n)"
#: Schema of a list of reward functions: a deployment refuses a malformed path when the run is created.
REWARD_FUNCS_SCHEMA = {"items": {"type": "string", "pattern": REWARD_FUNC_PATTERN}}


def load_reward_funcs(paths: list[str]) -> list[Callable[..., list[float | None]]]:
    """The functions named by ``'module:function'`` import paths; a ValueError names
    ``reward_funcs[i]`` and what is wrong with it."""
    funcs = []
    for i, path in enumerate(paths):
        module, _, name = path.partition(":")
        if not module or not name:
            raise ValueError(f"reward_funcs[{i}] {path!r}: expected module:function")
        try:
            func = getattr(importlib.import_module(module), name, None)
        except ImportError as e:
            raise ValueError(f"reward_funcs[{i}] {path!r}: cannot import {module!r} ({e})") from None
        if not callable(func):
            raise ValueError(f"reward_funcs[{i}] {path!r}: {module!r} has no function {name!r}")
        funcs.append(func)
    return funcs


def score(funcs, weights: list[float] | None, prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list]) -> list[float]:
    weights = weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    total = [0.0] * len(completions)
    for f, w in zip(funcs, weights, strict=True):
        values = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        for i, v in enumerate(values):
            if v is not None and not math.isnan(v):
                total[i] += w * float(v)
    return total


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    scale: ScaleRewards = "group",
    eps: float = 1e-4,
) -> list[float]:
    """A_i = (r_i - mean of i's group) / (std + eps), as TRL computes it.

    ``scale``: "group" divides by the group's sample std, "batch" by the std of all rewards,
    "none" not at all (Dr. GRPO). A group of one gets advantage 0.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    means, stds = {}, {}
    for g, idx in members.items():
        values = [rewards[i] for i in idx]
        means[g] = sum(values) / len(values)
        stds[g] = _sample_std(values)
    batch_std = _sample_std(list(rewards))
    advantages = []
    for r, g in zip(rewards, group_ids, strict=True):
        a = r - means[g]
        if scale == "group":
            a /= stds[g] + eps
        elif scale == "batch":
            a /= batch_std + eps
        advantages.append(a)
    return advantages


def _sample_std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


