"""When to write a full snapshot instead of a delta."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from posttrain.chain.format import MAX_CHAIN_DELTAS


class ChainPolicy(BaseModel):
    """Chain policy: the first snapshot is full, and so is every snapshot that a consumer would
    otherwise pay too much to reach."""

    model_config = ConfigDict(extra="forbid")

    max_deltas: int = Field(
        MAX_CHAIN_DELTAS, ge=0, le=MAX_CHAIN_DELTAS,
        description=f"Deltas after a full snapshot before the next full one (consumers resolve at most "
        f"{MAX_CHAIN_DELTAS}).",
    )
    delta_budget: float = Field(
        1.0, gt=0,
        description="Compressed delta bytes allowed since the last full snapshot, as a multiple of that full "
        "snapshot's size; past it a new full snapshot is written, so a fresh consumer downloads at most about "
        "(1 + delta_budget) full models.",
    )


class ChainHead(BaseModel):
    """What the producer must remember about the newest snapshot of a chain."""

    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="Folder name of the newest snapshot.")
    version: str = Field(description="Its version as deltas name it (the identity, or six digits for slime).")
    step: int = Field(description="Training step of the weights it holds.")
    full_identity: str = Field(description="The full snapshot the newest snapshot resolves from.")
    full_bytes: int = Field(description="Stored bytes of that full snapshot.")
    deltas_since_full: int = Field(description="Deltas written after that full snapshot.")
    delta_bytes_since_full: int = Field(description="Their stored bytes, added up.")
    layout_digest: str = Field(description="Digest of tensor names, shapes and dtypes.")
    digests: dict[str, str] = Field(description="xxh3-128 of every tensor's bytes in the newest version.")


@dataclass(frozen=True)
class Decision:
    kind: Literal["full", "delta"]
    reason: str


def layout_digest(layout: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    items = sorted((name, dtype, list(shape)) for name, (dtype, shape) in layout.items())
    return xxhash.xxh3_128_hexdigest(json.dumps(items).encode())


def plan(policy: ChainPolicy, head: ChainHead | None, *, layout: str, has_base: bool, restart: bool) -> Decision:
    if head is None:
        return Decision("full", "first snapshot of the chain")
    if restart:
        return Decision("full", "explicit restart")
    if not has_base:
        return Decision("full", "no base checkpoint with the head's exact bytes (producer restarted)")
    if layout != head.layout_digest:
        return Decision("full", "tensor names, shapes or dtypes changed")
    if head.deltas_since_full >= policy.max_deltas:
        return Decision("full", f"{head.deltas_since_full} deltas since the last full snapshot (max_deltas)")
    if head.delta_bytes_since_full >= policy.delta_budget * head.full_bytes:
        return Decision("full", "delta bytes since the last full snapshot reached the budget")
    return Decision("delta", f"delta {head.deltas_since_full + 1} against {head.identity}")


def over_budget(policy: ChainPolicy, head: ChainHead, delta_bytes: int) -> bool:
    """A delta that would take the bytes since the last full snapshot past the budget."""
    return head.delta_bytes_since_full + delta_bytes > policy.delta_budget * head.full_bytes
