"""A GRPO round's prompts and shards, and the statistics of its rewards (no Prefect here)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from posttrain.rollouts.shard import ShardResult, ShardSpec


def round_prompts(rows: list[dict[str, Any]], round: int, per_round: int) -> list[dict[str, Any]]:
    """The round's prompts: the dataset read in order, wrapping around."""
    start = round * per_round
    return [rows[(start + i) % len(rows)] for i in range(per_round)]


def shard_specs(rows: list[dict[str, Any]], *, round: int, per_round: int, shards: int, policy_version: int,
                round_dir: Path, identity: str | None = None) -> list[ShardSpec]:
    """The round's shards; ``identity`` is the snapshot the deployment was hot-loaded with for the
    round: every reply a shard samples must come from it (see ``run_shard``)."""
    prompts = round_prompts(rows, round, per_round)
    chunks = [prompts[i::shards] for i in range(shards) if prompts[i::shards]]
    return [ShardSpec(round=round, shard=s, rows=chunk, policy_version=policy_version, identity=identity,
                      out_path=round_dir / f"shard-{s:03d}.jsonl") for s, chunk in enumerate(chunks)]


def pooled_rewards(shards: list[ShardResult]) -> tuple[int, float, float, float]:
    """Samples, mean and standard deviation of all the round's rewards (pooled from the shards),
    and the spread (standard deviation) of the shards' means."""
    n = sum(s.samples for s in shards)
    if n == 0:
        return 0, 0.0, 0.0, 0.0
    mean = sum(s.reward_mean * s.samples for s in shards) / n
    var = sum(s.samples * (s.reward_std**2 + (s.reward_mean - mean) ** 2) for s in shards) / n
    means = [s.reward_mean for s in shards if s.samples]
    m = sum(means) / len(means)
    spread = math.sqrt(sum((x - m) ** 2 for x in means) / len(means))
    return n, mean, math.sqrt(var), spread
