"""One rollout shard: sample completions from the deployment, score them, write rollouts.

Every rollout carries the policy version that sampled it and the snapshot identity the deployment
stamped on the reply. When the shard expects an identity (the one the flow hot-loaded for the
round), a reply from any other version fails the shard at once with ``SnapshotMismatch``: its
rollouts would be attributed to the wrong policy. The shard's output file is written atomically,
so a retried shard either finds it complete or writes it anew.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.fsutil import atomic_open
from posttrain.rollouts.client import CompletionsClient
from posttrain.rollouts.format import Rollout, write_rollouts
from posttrain.rollouts.scoring import REWARD_FUNCS_SCHEMA, group_advantages, load_reward_funcs, score


class SnapshotMismatch(Exception):
    """A reply was sampled by another snapshot than the one the shard expects (someone hot-loaded
    another version mid-round, or the deployment does not say what it serves). Not transient:
    sampling again would not make the rollouts the round's."""

    def __init__(self, spec: ShardSpec, served: str | None):
        self.round, self.shard, self.expected, self.served = spec.round, spec.shard, spec.identity, served
        super().__init__(
            f"shard {spec.shard} of round {spec.round}: expected replies from snapshot {spec.identity!r} "
            f"(policy v{spec.policy_version}), but the deployment answered from "
            + (f"snapshot {served!r}" if served else "an unknown snapshot (no snapshot_identity in its reply)")
            + "; was another version hot-loaded into the deployment mid-round?")


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the group size).")
    max_completion_length: int = Field(32, ge=1, description="Most tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["posttrain.rewards:correctness_reward"],
        description="Reward functions by import path (module:function), with TRL's signature.",
        json_schema_extra=REWARD_FUNCS_SCHEMA,
    )
    reward_weights: list[float] | None = Field(None, description="Weight of each reward function (default 1).")


class ShardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    round: int = Field(ge=0, description="GRPO round.")
    shard: int = Field(ge=0, description="Shard index within the round.")
    rows: list[dict[str, Any]] = Field(description="Prompt rows: 'prompt' messages plus extra columns.")
    policy_version: int = Field(ge=0, description="Version of the weights the deployment serves.")
    identity: str | None = Field(
        None, description="Snapshot identity the deployment must answer from (the one hot-loaded for the round); "
        "None: not checked, each rollout records what the reply says.")
    out_path: Path = Field(description="Rollouts JSONL written by the shard.")


class ShardResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    round: int
    shard: int
    path: Path
    samples: int
    reward_mean: float
    reward_std: float
    advantage_abs_mean: float
    policy_version: int
    snapshot_identity: str | None = None
    seconds: float
    worker: str | None = None  # the process that ran the shard, "host:pid"


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversational prompt through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def run_shard(spec: ShardSpec, settings: RolloutSettings, client: CompletionsClient, tokenizer) -> ShardResult:

    t0 = time.perf_counter()
    funcs = load_reward_funcs(settings.reward_funcs)
    rollouts: list[Rollout] = []
    identities: set[str | None] = set()
    for i, row in enumerate(spec.rows):
        messages = row["prompt"]
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        choices = client.complete(prompt_ids, n=settings.num_generations, max_tokens=settings.max_completion_length,
                                  temperature=settings.temperature, top_p=settings.top_p)
        served = choices.snapshot_identity
        if spec.identity is not None and served != spec.identity:
            raise SnapshotMismatch(spec, served)
        identities.add(served)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in choices]
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        extra = {k: [v] * len(choices) for k, v in row.items() if k != "prompt"}
        rewards = score(funcs, settings.reward_weights, [messages] * len(choices), completions,
                        [c.token_ids for c in choices], extra, names=settings.reward_funcs)
        group = f"r{spec.round}-s{spec.shard}-p{i}"
        for j, (c, r) in enumerate(zip(choices, rewards, strict=True)):
            if not c.token_ids:
                continue
            rollouts.append(Rollout(prompt_ids=prompt_ids, completion_ids=c.token_ids, logprobs=c.logprobs,
                                    reward=r, group_id=group, policy_version=spec.policy_version,
                                    snapshot_identity=served, sample_id=f"{group}-c{j}", metadata={"text": texts[j]}))
    advantages = group_advantages([r.reward for r in rollouts], [r.group_id for r in rollouts]) if rollouts else []
    write_rollouts(spec.out_path, rollouts)
    rewards = [r.reward for r in rollouts]
    return ShardResult(
        round=spec.round, shard=spec.shard, path=spec.out_path, samples=len(rollouts),
        reward_mean=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        advantage_abs_mean=statistics.fmean(abs(a) for a in advantages) if advantages else 0.0,
        policy_version=spec.policy_version,
        snapshot_identity=spec.identity if spec.identity is not None else _single(identities),
        seconds=time.perf_counter() - t0, worker=f"{socket.gethostname()}:{os.getpid()}",
    )


def _single(identities: set[str | None]) -> str | None:
    return next(iter(identities)) if len(identities) == 1 else None


def merge_rollouts(paths: list[Path], out: Path) -> Path:
    """Concatenate shard files into the round's rollouts file (atomically)."""
    with atomic_open(out) as f:
        for p in paths:
            for line in Path(p).read_text().splitlines():
                if line.strip():
                    json.loads(line)  # a torn shard file fails here, not in training
                    f.write(line + "\n")
    return out
