"""Store-side leases that keep ``posttrain gc`` and a run's publishers apart.

The publisher's own lock (``lock.py``) is an ``flock`` on its work folder, which gc, reading
only the store, cannot see; nothing else in the store marks a run as being published (step
claims only stop two snapshots of one step). So each run gets leases in the store, beside its
ledger, like a readers-writer lock:

    .posttrain/runs/<run>/leases/publish-<id>.json   one per work folder, shared: a publish step
    .posttrain/runs/<run>/leases/gc.json             exclusive: gc deleting the run's snapshots

A publisher writes its lease (``<id>``: a digest of host and work folder, so a restarted
publisher replaces what its crashed predecessor left), *then* looks for a live gc lease, and
waits while there is one. gc creates ``gc.json`` (create-only, or replacing an expired one by
ETag), *then* lists the publisher leases, and skips the run when one is live. Each side writes
before it reads the other's, so on a store with read-after-write consistency (S3, a folder) at
least one of two racing sides sees the other: they never both go ahead.

What this guarantees: while gc deletes a run's snapshots, no publisher of that run encodes,
uploads or records a snapshot (it waits, at most until gc's lease is released or expires), and
gc never starts on a run while a publish step holds a live lease (gc skips the run). It holds
as long as each holder finishes or renews within its TTL (gc renews before every snapshot it
deletes and stops when a renewal fails or is late) and the machines' clocks agree to well within
the TTLs (expiry is wall-clock time). A publisher's lease outlives a crash for ``PUBLISH_TTL``
(gc skips that run meanwhile), a gc's for ``GC_TTL`` (publishers of that run wait meanwhile).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.chain.policy import ChainHead
from posttrain.publish.ledger import RUNS_PREFIX, check_run_name
from posttrain.storage import NotFound, PreconditionFailed, StorageError, Store

PUBLISH_TTL = 6 * 3600.0  # longer than any one publish step (encode and upload of one checkpoint)
GC_TTL = 600.0  # gc renews it before each snapshot it deletes


class RunBusy(ChainError):
    """Another holder has the run's lease."""


class LeaseLost(ChainError):
    """gc's lease on a run expired or was taken over while it was deleting: it stopped."""


class LeaseRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    holder: str = Field(description="publisher or gc.")
    host: str = Field(description="Host name of the holder.")
    pid: int = Field(description="Process id of the holder.")
    expires_at: float = Field(description="Unix time after which the lease no longer holds.")

    def describe(self, now: float) -> str:
        return f"{self.holder} pid {self.pid} on {self.host}, lease expires in {max(self.expires_at - now, 0):.0f}s"


def leases_prefix(run: str) -> str:
    return f"{RUNS_PREFIX}{check_run_name(run)}/leases/"


def _record(holder: str, ttl: float, clock: Callable[[], float]) -> bytes:
    rec = LeaseRecord(holder=holder, host=socket.gethostname(), pid=os.getpid(), expires_at=clock() + ttl)
    return rec.model_dump_json().encode()


def _live(store: Store, key: str, now: float) -> tuple[LeaseRecord | None, str | None]:
    """The lease at ``key`` and its ETag; the record is None when absent, unreadable or expired."""
    try:
        data, etag = store.get_bytes(key)
    except NotFound:
        return None, None
    try:
        rec = LeaseRecord.model_validate_json(data)
    except ValidationError:
        return None, etag  # a torn or foreign file holds nothing
    return (rec if rec.expires_at > now else None), etag


@contextlib.contextmanager
def publishing(store: Store, run: str, work_dir: Path, *, ttl: float = PUBLISH_TTL, poll: float = 1.0,
               clock: Callable[[], float] = time.time) -> Iterator[None]:
    """Hold the run's shared publisher lease for one publish step; wait while gc holds the run."""
    ident = xxhash.xxh3_64_hexdigest(f"{socket.gethostname()}:{Path(work_dir).resolve()}".encode())
    key = f"{leases_prefix(run)}publish-{ident}.json"
    store.put_bytes(key, _record("publisher", ttl, clock))  # first ours, then look at gc's (module docstring)
    try:
        while _live(store, leases_prefix(run) + "gc.json", clock())[0] is not None:
            time.sleep(poll)
        yield
    finally:
        with contextlib.suppress(StorageError):  # never hide the step's own error; a leftover lease expires
            store.delete([key])


class GcLease:
    """gc's exclusive lease on one run: ``acquire`` (raises ``RunBusy``), ``renew``, ``release``."""

    def __init__(self, store: Store, run: str, *, ttl: float = GC_TTL, clock: Callable[[], float] = time.time):
        self.store, self.run, self.ttl, self.clock = store, run, ttl, clock
        self.key = leases_prefix(run) + "gc.json"
        self._etag: str | None = None
        self._deadline = 0.0

    def acquire(self) -> GcLease:
        now = self.clock()
        body = _record("gc", self.ttl, self.clock)
        try:
            etag = self.store.put_bytes(self.key, body, if_none_match=True)
        except PreconditionFailed:
            held, stale = _live(self.store, self.key, now)
            if held is not None:
                raise RunBusy(f"run {self.run}: held by another {held.describe(now)}") from None
            try:  # expired: take it over, unless someone else just did
                etag = self.store.put_bytes(self.key, body, if_match=stale) if stale else \
                    self.store.put_bytes(self.key, body, if_none_match=True)
            except PreconditionFailed:
                raise RunBusy(f"run {self.run}: another gc took its lease meanwhile") from None
        self._etag, self._deadline = etag, now + self.ttl
        for key in self.store.list(leases_prefix(self.run) + "publish-"):  # after ours is written
            held, _ = _live(self.store, key, self.clock())
            if held is not None:
                self.release()
                raise RunBusy(f"run {self.run}: being published ({held.describe(self.clock())})")
        return self

    def renew(self) -> None:
        """Extend the lease; ``LeaseLost`` when it may have expired or is someone else's now."""
        now = self.clock()
        if self._etag is None or now >= self._deadline - 1.0:
            raise LeaseLost(f"run {self.run}: gc's lease ran out (over {self.ttl:g}s without renewal); stopped")
        try:
            self._etag = self.store.put_bytes(self.key, _record("gc", self.ttl, self.clock), if_match=self._etag)
        except PreconditionFailed:
            self._etag = None
            raise LeaseLost(f"run {self.run}: gc's lease was taken over; stopped") from None
        self._deadline = now + self.ttl

    def release(self) -> None:
        if self._etag is None:
            return
        try:
            _, etag = self.store.get_bytes(self.key)
        except NotFound:
            etag = None
        if etag is not None and etag.strip('"') == self._etag.strip('"'):
            self.store.delete([self.key])  # only our own: an expired one may have been taken over
        self._etag = None


def base_retired(store: Store, head: ChainHead | None, step: int) -> bool:
    """Whether the snapshot a publisher would build ``step``'s delta on is gone from the store (gc
    retired it): its index, the commit marker, is deleted first, so with it present the snapshot
    and its whole chain prefix are whole. The head's own step is a redo, not a new delta."""
    if head is None or head.step >= step:
        return False
    return not store.exists(f"{head.identity}/{INDEX_NAME}")
