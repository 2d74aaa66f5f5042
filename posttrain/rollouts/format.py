"""Rollouts sampled elsewhere (an inference deployment) that a ``mode: step`` run trains on.

One JSONL line per completion. Every line is validated before training starts; problems are
reported together, by line number. Pure Python.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from posttrain.errors import validation_problems
from posttrain.fsutil import atomic_open

MAX_REPORTED_PROBLEMS = 20


class RolloutError(ValueError):
    """The rollouts file cannot be trained on; ``problems`` lists every fault by line."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class Rollout(BaseModel):
    """One sampled completion with its behaviour log-probs and reward."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(min_length=1, description="Token ids of the rendered prompt.")
    completion_ids: list[int] = Field(min_length=1, description="Token ids of the sampled completion.")
    logprobs: list[float] = Field(
        description="Behaviour log-prob of each completion token under the sampling policy "
        "(after temperature, as the inference server reports it)."
    )
    reward: float = Field(description="Scalar reward of the completion.")
    group_id: str | int = Field(description="Completions of one prompt share a group id; advantages are per group.")
    policy_version: int = Field(ge=0, description="Version of the policy that sampled the completion.")
    snapshot_identity: str | None = Field(
        None, description="Snapshot identity of the weights that sampled the completion, as the deployment "
        "stamped its reply (unset in files written before it was recorded).")
    sample_id: str | None = Field(None, description="Optional id of the sample, for tracing.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything else worth keeping (not used).")

    @model_validator(mode="after")
    def _consistent(self) -> Rollout:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for {len(self.completion_ids)} completion tokens"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        bad = [lp for lp in self.logprobs if not (math.isfinite(lp) and lp <= 1e-4)]
        if bad:
            raise ValueError(f"logprobs must be finite and <= 0, got {bad[:3]}")
        if min(self.prompt_ids + self.completion_ids) < 0:
            raise ValueError("token ids must be non-negative")
        return self


def load_rollouts(path: str | os.PathLike[str]) -> tuple[list[Rollout], str]:
    """All rollouts of a JSONL file and the file's SHA-256; RolloutError lists bad lines."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RolloutError(f"{path}: no such rollouts file") from None
    problems: list[str] = []
    rollouts: list[Rollout] = []
    for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rollouts.append(Rollout.model_validate(json.loads(line)))
        except json.JSONDecodeError as e:
            problems.append(f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})")
        except ValidationError as e:
            problems += [f"line {lineno}: {problem}" for problem in validation_problems(e)]
    if not problems and not rollouts:
        problems.append("no rollouts")
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        listing = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        raise RolloutError(f"{path}: {len(problems)} problem(s):\n{listing}", problems)
    return rollouts, hashlib.sha256(data).hexdigest()


def write_rollouts(path: str | os.PathLike[str], rollouts: list[Rollout]) -> Path:
    """Write rollouts as JSONL, the format ``mode: step`` reads, atomically (a retried writer
    finds the file whole or absent)."""
    with atomic_open(path) as f:
        for r in rollouts:
            f.write(json.dumps(r.model_dump(mode="json", exclude_defaults=True)) + "\n")
    return Path(path)
