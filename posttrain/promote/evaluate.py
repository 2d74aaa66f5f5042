"""The gate's eval: sample a deployment on the held-out eval prompts and score every completion.

The candidate and the champion are evaluated the same way: the same prompts (the staged eval
set, in its order), ``samples_per_prompt`` completions per prompt, the same sampling settings, and
the same seed per prompt (``prompt_seed``), then the same reward functions. Every reply must come
from the snapshot under evaluation (the deployment stamps it): one from another snapshot fails the
eval (``EvalError``) rather than scoring the wrong model.

An eval's inputs make its **digest** (the eval set's content digest, the sampling settings, n,
the reward functions' import paths, their code and weights, the prompts used); a result is stored
in the store under ``.posttrain/evals/<digest>/<identity>.json`` (create-only), so the champion is
evaluated once per eval set and reward code and reused by every later gate on the same ones
(docs/promotion.md). A reward that is not a finite number fails the eval, naming the function: an
eval with a failure has no result, so nothing of it is stored or reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError, field_validator

from posttrain.chain.format import check_identity
from posttrain.errors import describe_validation_error
from posttrain.rollouts.client import CompletionsClient
from posttrain.rollouts.scoring import REWARD_FUNCS_SCHEMA, RewardError, load_reward_funcs, reward_code_digest, score
from posttrain.rollouts.shard import chat_prompt_ids
from posttrain.storage import NotFound, PreconditionFailed, Store

EVALS = ".posttrain/evals"
FORMAT = "posttrain.eval/1"


class EvalError(Exception):
    """An eval that could not produce its rewards (the gate refuses on it, naming the reason)."""


class EvalSettings(BaseModel):
    """How a snapshot is evaluated: the same for the candidate and the champion."""

    model_config = ConfigDict(extra="forbid")

    samples_per_prompt: int = Field(4, ge=1, le=64, description="Completions sampled per eval prompt.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate on the first N prompts of the eval set "
                                    "(None: all of them).")
    max_tokens: int = Field(32, ge=1, description="Most tokens per eval completion.")
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="Sampling temperature of the eval.")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="Nucleus sampling threshold of the eval.")
    seed: int = Field(0, ge=0, description="Seed of the eval's sampling: prompt i is sampled with a seed derived "
                      "from it and i, the same for the candidate and the champion.")
    reward_funcs: list[str] = Field(min_length=1, description="Reward functions by import path (module:function).",
                                    json_schema_extra=REWARD_FUNCS_SCHEMA)
    reward_weights: list[FiniteFloat] | None = Field(None, description="Weight of each reward function (default 1).")

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, v: list[float] | None, info) -> list[float] | None:  # noqa: ANN001
        funcs = info.data.get("reward_funcs")
        if v is not None and funcs is not None and len(v) != len(funcs):
            raise ValueError(f"{len(v)} weights for {len(funcs)} reward functions")
        return v


class EvalResult(BaseModel):
    """One snapshot's eval: the rewards of each prompt's completions."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["posttrain.eval/1"] = FORMAT
    identity: str = Field(description="The snapshot evaluated (every reply named it).")
    digest: str = Field(description="Digest of the eval's inputs (eval set, settings, reward functions).")
    # finite only: a stored eval with a NaN (or the null JSON makes of it) does not parse, so it is never reused
    rewards: dict[str, list[FiniteFloat]] = Field(description="Prompt id -> the rewards of its completions.")
    mean: FiniteFloat = Field(description="Mean over prompts of the per-prompt mean reward.")
    at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc), description="When it was made.")
    seconds: float = Field(0.0, description="Wall time of the sampling and scoring.")


def prompt_id(row: dict[str, Any], i: int) -> str:
    """A row's id: its ``id`` column when it has one, else its position."""
    value = row.get("id")
    return str(value) if isinstance(value, str | int) and str(value) else f"prompt-{i:05d}"


def prompt_seed(seed: int, i: int) -> int:
    """The sampling seed of prompt ``i``: the same on both sides of the gate."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:7], "big")


def eval_rows(rows: list[dict[str, Any]], settings: EvalSettings) -> list[dict[str, Any]]:
    """The prompts the eval uses: the first ``max_prompts`` rows; ``EvalError`` for duplicate ids."""
    chosen = rows[: settings.max_prompts] if settings.max_prompts else rows
    ids = [prompt_id(r, i) for i, r in enumerate(chosen)]
    dup = next((x for x in ids if ids.count(x) > 1), None)
    if dup is not None:
        raise EvalError(f"eval set: prompt id {dup!r} appears more than once")
    return chosen


def eval_digest(dataset_digest: str, settings: EvalSettings, prompts: int) -> str:
    """The digest of an eval's inputs: equal digests sample and score the same way. The reward
    functions count by their code as well as their import paths (``reward_code_digest``), so an
    eval stored before their code changed is not compared with one made after."""
    text = json.dumps({"format": FORMAT, "dataset": dataset_digest, "prompts": prompts,
                       "settings": settings.model_dump(mode="json"),
                       "reward_code": reward_code_digest(settings.reward_funcs)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def evaluate(rows: list[dict[str, Any]], settings: EvalSettings, client: CompletionsClient, tokenizer, *,
             identity: str, digest: str, progress: Callable[[int, int], None] | None = None,
             served: str | None = "") -> EvalResult:
    """Sample and score ``rows`` on the deployment behind ``client``, which must serve ``identity``
    (or, when ``served`` is given other than "", answer as serving ``served``: None for its boot weights,
    which no snapshot identity names)."""
    check_identity(identity)
    expected = identity if served == "" else served
    t0 = time.perf_counter()
    funcs = load_reward_funcs(settings.reward_funcs)
    rows = eval_rows(rows, settings)
    out: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        messages = row["prompt"]
        ids = chat_prompt_ids(tokenizer, messages)
        reply = client.complete(ids, n=settings.samples_per_prompt, max_tokens=settings.max_tokens,
                                temperature=settings.temperature, top_p=settings.top_p,
                                seed=prompt_seed(settings.seed, i))
        if (reply.snapshot_identity or None) != (expected or None):
            raise EvalError(f"expected replies from {f'snapshot {expected}' if expected else 'the boot weights'}, "
                            f"but the deployment answered from "
                            f"{reply.snapshot_identity or 'an unknown snapshot'} (another hot-load meanwhile?)")
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in reply]
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        extra = {k: [v] * len(texts) for k, v in row.items() if k != "prompt"}
        try:
            rewards = score(funcs, settings.reward_weights, [messages] * len(texts), completions,
                            [c.token_ids for c in reply], extra, names=settings.reward_funcs)
        except RewardError as e:
            raise EvalError(f"prompt {prompt_id(row, i)}: {e}") from None
        out[prompt_id(row, i)] = [float(r) for r in rewards]
        if progress is not None:
            progress(i + 1, len(rows))
    if not out:
        raise EvalError("the eval set has no prompts")
    mean = sum(sum(v) / len(v) for v in out.values()) / len(out)
    return EvalResult(identity=identity, digest=digest, rewards=out, mean=mean, seconds=time.perf_counter() - t0)


class EvalStore:
    """Stored eval results, ``.posttrain/evals/<digest>/<identity>.json`` in the chain's store."""

    def __init__(self, store: Store):
        self.store = store

    @staticmethod
    def key(digest: str, identity: str) -> str:
        return f"{EVALS}/{digest}/{check_identity(identity)}.json"

    def get(self, digest: str, identity: str) -> EvalResult | None:
        """The stored result, or None; a damaged one is None too (it is evaluated again)."""
        try:
            data, _ = self.store.get_bytes(self.key(digest, identity))
            result = EvalResult.model_validate_json(data)
        except (NotFound, ValidationError):
            return None
        return result if (result.digest, result.identity) == (digest, identity) else None

    def put(self, result: EvalResult) -> EvalResult:
        """Store ``result`` create-only; when one is there already, that one is kept and returned."""
        try:
            self.store.put_bytes(self.key(result.digest, result.identity),
                                 result.model_dump_json(indent=1).encode(), if_none_match=True)
        except PreconditionFailed:
            return self.get(result.digest, result.identity) or result
        return result


def parse_settings(values: dict[str, Any]) -> EvalSettings:
    """EvalSettings from plain values; a one-line ``ValueError`` naming the setting."""
    try:
        return EvalSettings.model_validate(values)
    except ValidationError as e:
        raise ValueError(describe_validation_error(e)) from None
