"""The ledger in the store: one entry per published snapshot, one claim per step, the run's chain
settings, and a ``latest`` pointer.

Layout under the store's prefix (next to the snapshot folders, which consumers address by
identity and never list), one folder per run, since runs share a deployment's prefix:

    .posttrain/runs/<run>/run.json                  the run's chain flavour and policy, written once
    .posttrain/runs/<run>/steps/<step>.json         the step's snapshot and content digest, written once
    .posttrain/runs/<run>/ledger/<identity>.json    a published snapshot: kind, base, step, files
    .posttrain/runs/<run>/latest.json               the newest published snapshot, advanced conditionally

A run name is one path segment (``RUN_NAME_RE``), so no run's folder lies inside another's; the
step claim is written with ``if_none_match``, so a step has one snapshot whoever publishes it.
"""

from __future__ import annotations

import json
import re
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.chain.errors import ChainError
from posttrain.chain.policy import ChainPolicy
from posttrain.storage import NotFound, PreconditionFailed, Store

RUNS_PREFIX = ".posttrain/runs/"
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class LedgerError(ChainError):
    """The ledger refuses a write (another policy, another snapshot of the step) or cannot be read."""


def check_run_name(run: str) -> str:
    """A run name is one path segment: 1-128 of letters, digits, ``_``, ``.``, ``-``, starting alphanumeric."""
    if not isinstance(run, str) or not RUN_NAME_RE.fullmatch(run):  # match's "$" lets a final newline through
        raise LedgerError(f"run name {run!r} must be 1-128 letters, digits, '_', '.' or '-', starting with a "
                          "letter or digit (one path segment)")
    return run


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
    content: str | None = Field(None, description="Content digest of the model version (chain.format.content_digest).")
    published_at: float = Field(default_factory=time.time, description="Unix time of publication.")


class StepClaim(BaseModel):
    """The one snapshot of a step (a later full snapshot of the same weights may join it, same content)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(description="Training step.")
    identity: str = Field(description="The snapshot published for it.")
    content: str = Field(description="Content digest of its weights.")


class RunSettings(BaseModel):
    """What decides a run's identities besides the weights: one per run, whatever the work folder."""

    model_config = ConfigDict(extra="forbid")

    flavor: str = Field(description="Chain flavour.")
    policy: ChainPolicy = Field(description="The chain policy.")

    def describe(self) -> str:
        return (f"flavor {self.flavor}, max_deltas {self.policy.max_deltas}, "
                f"delta_budget {self.policy.delta_budget:g}")


class Latest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    identity: str = Field(description="Newest published snapshot.")
    step: int = Field(description="Its training step.")
    kind: str = Field(description="full or delta.")


class Ledger:
    def __init__(self, store: Store, run: str):
        self.store = store
        self.run = check_run_name(run)
        self.root = f"{RUNS_PREFIX}{run}/"
        self.prefix = f"{self.root}ledger/"
        self.latest_key = f"{self.root}latest.json"
        self.settings_key = f"{self.root}run.json"

    def _read(self, key: str, model: type[BaseModel]):  # noqa: ANN202 - an instance of model
        try:
            data, _ = self.store.get_bytes(key)
        except NotFound:
            return None
        try:
            return model.model_validate_json(data)
        except ValidationError as e:
            raise LedgerError(f"{self.store.uri}: {key} is not a valid {model.__name__} "
                              f"({e.error_count()} errors, first: {e.errors()[0]['msg']})") from None

    def put(self, entry: LedgerEntry) -> None:
        self.store.put_bytes(self.prefix + f"{entry.identity}.json", entry.model_dump_json(indent=2).encode())

    def get(self, identity: str) -> LedgerEntry | None:
        return self._read(self.prefix + f"{identity}.json", LedgerEntry)

    def entries(self) -> list[LedgerEntry]:
        out = []
        for key in self.store.list(self.prefix):
            name = key[len(self.prefix):]
            if name.endswith(".json") and "/" not in name:
                entry = self._read(key, LedgerEntry)
                if entry is not None:
                    out.append(entry)
        return sorted(out, key=lambda e: (e.step, e.published_at))

    # -- the run's settings and its steps ------------------------------------------------------

    def claim_settings(self, settings: RunSettings) -> None:
        """Record the run's flavour and policy on its first publication; refuse others later."""
        for _ in range(3):
            current = self._read(self.settings_key, RunSettings)
            if current is not None:
                if current != settings:
                    raise LedgerError(f"run {self.run} is published with {current.describe()}; this publisher has "
                                      f"{settings.describe()} (a run keeps one chain policy: use a new run name)")
                return
            try:
                self.store.put_bytes(self.settings_key, settings.model_dump_json().encode(), if_none_match=True)
                return
            except PreconditionFailed:
                continue  # written meanwhile: compare with it
        raise LedgerError(f"{self.settings_key}: could not be read or written")

    def step_key(self, step: int) -> str:
        return f"{self.root}steps/{step:012d}.json"

    def claim(self, step: int) -> StepClaim | None:
        return self._read(self.step_key(step), StepClaim)

    def claim_step(self, claim: StepClaim) -> StepClaim:
        """Write the step's claim unless there is one; the claim that holds after."""
        try:
            self.store.put_bytes(self.step_key(claim.step), claim.model_dump_json().encode(), if_none_match=True)
            return claim
        except PreconditionFailed:
            held = self.claim(claim.step)
            if held is None:
                raise LedgerError(f"{self.step_key(claim.step)}: exists but cannot be read") from None
            return held

    def unclaim(self, step: int, identity: str) -> None:
        held = self.claim(step)
        if held is not None and held.identity == identity:
            self.store.delete([self.step_key(step)])

    # -- latest ----------------------------------------------------------------------------

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


def published_steps(store: Store, run: str) -> dict[int, list[str]]:
    """Step -> identities in the run's ledger (more than one means a duplicate)."""
    out: dict[int, list[str]] = {}
    for e in Ledger(store, run).entries():
        out.setdefault(e.step, []).append(e.identity)
    return out
