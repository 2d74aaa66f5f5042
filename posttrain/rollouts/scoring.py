"""Scoring rollouts: reward functions named by import path, weighted sums, group advantages.

Reward functions have TRL's signature (``posttrain.rewards``); the trainer's GRPO run and the
rollout shards load them through ``load_reward_funcs``, so a bad name fails the same way in both.
``reward_code_digest`` says which code they are (the eval gate keys stored evals by it). A reward
that is not a finite number (NaN, inf: a reward service's outage) is a ``RewardError`` naming the
function, never a number; None is TRL's "this function does not score this completion" and adds
nothing. Pure Python: no torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import marshal
import math
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from types import ModuleType
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
        _source_digest(_defining_module(path, func))  # the source as imported, before it can change on disk
        funcs.append(func)
    return funcs


class RewardError(ValueError):
    """A reward function returned something that is not a reward: NaN, inf, a non-number, or not one
    value per completion. The message names the function."""


# The digest of each reward module's source as this process first saw it (at its import by
# load_reward_funcs, or at the first digest): the code that runs, even if the file changes later.
_SOURCE_DIGESTS: weakref.WeakKeyDictionary[ModuleType, str] = weakref.WeakKeyDictionary()


def reward_code_digest(paths: list[str]) -> str:
    """A digest of the reward functions' code: each path with the source of the module that defines
    the function (any change to that module, a helper included, changes it); the compiled code of
    the function itself when its module has no source file. A ValueError as ``load_reward_funcs``."""
    h = hashlib.sha256()
    for path, func in zip(paths, load_reward_funcs(paths), strict=True):
        h.update(f"{path}\0{_code_digest(path, func)}\0".encode())
    return h.hexdigest()[:32]


def _code_digest(path: str, func: Callable) -> str:
    digest = _source_digest(_defining_module(path, func))
    if digest is not None:
        return digest
    code = getattr(func, "__code__", None)
    if code is None:
        raise ValueError(f"reward_funcs {path!r}: neither its module's source nor its code can be digested")
    return "code:" + hashlib.sha256(marshal.dumps(code)).hexdigest()


def _defining_module(path: str, func: Callable) -> ModuleType:
    """The module whose code the function is (a re-exported function's own module), else the one imported."""
    return sys.modules.get(getattr(func, "__module__", None) or "") or sys.modules[path.partition(":")[0]]


def _source_digest(module: ModuleType) -> str | None:
    """The digest of ``module``'s source file as this process first read it; None without one."""
    digest = _SOURCE_DIGESTS.get(module)
    if digest is None:
        file = getattr(module, "__file__", None)
        try:
            digest = "source:" + hashlib.sha256(Path(file).read_bytes()).hexdigest() if file else None
        except OSError:
            return None
        if digest is not None:
            digest = _SOURCE_DIGESTS.setdefault(module, digest)
    return digest


def reward_name(func: Callable) -> str:
    """``module:function`` of a reward function, as reward_funcs names it."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__qualname__
    return f"{getattr(func, '__module__', None) or '?'}:{name}"


def score(funcs, weights: list[float] | None, prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list], names: list[str] | None = None) -> list[float]:
    """The weighted sum of the reward functions' values for each completion; ``RewardError`` naming the
    function (``names``, its import paths; else its own module:name) when one returns a non-finite or
    non-numeric value, or not one value per completion."""
    weights = weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights {weights}: every weight must be a finite number")
    names = names or [reward_name(f) for f in funcs]
    total = [0.0] * len(completions)
    for f, name, w in zip(funcs, names, weights, strict=True):
        values = _checked(name, f(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                  **columns), len(completions))
        for i, v in enumerate(values):
            if v is not None:  # None is TRL's "this function does not score this completion"
                total[i] += w * v
    return total


def finite_rewards(func: Callable, name: str) -> Callable:
    """``func`` for TRL's trainer, raising ``RewardError`` (naming ``name``) where TRL would turn a
    NaN into "no reward" and sum it as 0; sync or async, as ``func`` is."""
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            return _checked(name, await func(*args, **kwargs))
        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return _checked(name, func(*args, **kwargs))
    return checked


def _checked(name: str, values, expected: int | None = None) -> list[float | None]:
    """A reward function's values as floats (None kept); ``RewardError`` for anything else."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward function {name} returned {type(values).__name__}, not a list of rewards") from None
    if expected is not None and len(values) != expected:
        raise RewardError(f"reward function {name} returned {len(values)} values for {expected} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        try:
            x = None if v is None else float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name} returned {v!r:.40} for completion {i}, not a number") from None
        if x is not None and not math.isfinite(x):
            raise RewardError(f"reward function {name} returned {x} for completion {i}: a reward must be a finite "
                              "number (a reward service outage?)")
        out.append(x)
    return out


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


