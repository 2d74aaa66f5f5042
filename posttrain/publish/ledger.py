"""The ledger in the store: one entry per published snapshot and a ``latest`` pointer.

Layout under the store's prefix (next to the snapshot folders, which consumers address by
identity and never list), one folder per run, since runs share a deployment's prefix:

    .posttrain/runs/<run>/ledger/<identity>.json   a published snapshot: kind, base, step, files
    .posttrain/runs/<run>/latest.json              the newest published snapshot, advanced conditionally
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, ConfigDict, Field

from posttrain.storage import NotFound, PreconditionFailed, Store

RUNS_PREFIX = ".posttrain/runs/"


class PublishedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(description="Bytes.")
    xxh3_128: str = Field(description="xxh3-128 of the file's bytes.")


class LedgerEntry(BaseModel):
    """A snapshot whose every file, index last, is in the store."""

    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="Snapshot folder under the prefix.")
    kind: str = Field(description="full or delta.")
    base: str | None = Field(description="Version a delta builds on.")
    step: int = Field(description="Training step of the weights.")
    run: str = Field(description="Run the chain belongs to.")
    files: dict[str, PublishedFile] = Field(description="Every file of the snapshot, the index included.")
    raw_bytes: int = Field(description="Bytes of the model version.")
    stored_bytes: int = Field(description="Bytes of the snapshot's files.")
    changed_tensors: int = Field(description="Tensors the snapshot stores.")
    total_tensors: int = Field(description="Tensors of the model.")
    density: float = Field(description="Share of the model's bytes that changed.")
    published_at: float = Field(default_factory=time.time, description="Unix time of publication.")


class Latest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="Newest published snapshot.")
    step: int = Field(description="Its training step.")
    kind: str = Field(description="full or delta.")


class Ledger:
    def __init__(self, store: Store, run: str):
        self.store = store
        self.run = run
        self.prefix = f"{RUNS_PREFIX}{run}/ledger/"
        self.latest_key = f"{RUNS_PREFIX}{run}/latest.json"

    def put(self, entry: LedgerEntry) -> None:
        self.store.put_bytes(self.prefix + f"{entry.identity}.json", entry.model_dump_json(indent=2).encode())

    def get(self, identity: str) -> LedgerEntry | None:
        try:
            data, _ = self.store.get_bytes(self.prefix + f"{identity}.json")
        except NotFound:
            return None
        return LedgerEntry.model_validate_json(data)

    def entries(self) -> list[LedgerEntry]:
        out = []
        for key in self.store.list(self.prefix):
            if key.endswith(".json"):
                out.append(LedgerEntry.model_validate_json(self.store.get_bytes(key)[0]))
        return sorted(out, key=lambda e: (e.step, e.published_at))

    def latest(self) -> tuple[Latest | None, str | None]:
        try:
            data, etag = self.store.get_bytes(self.latest_key)
        except NotFound:
            return None, None
        return Latest.model_validate_json(data), etag

    def advance(self, new: Latest) -> None:
        """Point ``latest`` at ``new`` unless it already points at it or at a later step."""
        for _ in range(5):
            current, etag = self.latest()
            if current is not None and (current.identity == new.identity or current.step > new.step):
                return
            body = json.dumps(new.model_dump()).encode()
            try:
                if etag is None:
                    self.store.put_bytes(self.latest_key, body, if_none_match=True)
                else:
                    self.store.put_bytes(self.latest_key, body, if_match=etag)
                return
            except PreconditionFailed:
                continue  # moved under us, or our own retried write landed: look again
        raise PreconditionFailed(f"{self.latest_key}: kept changing while advancing it to {new.identity}")

    def delete(self, identity: str) -> None:
        self.store.delete([self.prefix + f"{identity}.json"])
