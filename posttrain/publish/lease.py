"""Store-side leases that keep ``posttrain gc`` and a run's publishers apart.

The publisher's own lock (``lock.py``) is an ``flock`` on its work folder, which gc, reading
only the store, cannot see; nothing else in the store marks a run as being published (step
claims only stop two snapshots of one step). So each run gets leases in the store, beside its
ledger, like a readers-writer lock:

    .posttrain/runs/<run>/leases/publish-<id>.json   one per work folder, shared: a publish step
    .posttrain/gc-leases/<run>.json                  exclusive: gc deleting the run's snapshots

gc's leases share one folder of their own so that promotion and rollback, which wait for any gc,
list only them, not every run's ledger (a listing that grew with the store; bench/growth.py store).

A publisher writes its lease (``<id>``: a digest of host and work folder, so a restarted
publisher replaces what its crashed predecessor left), *then* looks for a live gc lease, and
waits while there is one. gc creates ``<run>.json`` (``posttrain.storage.lease.StoreLease``:
create-only, or replacing an expired one by ETag), *then* lists the publisher leases, and skips
the run when one is live. Each side writes before it reads the other's, so on a store with
read-after-write consistency (S3, a folder) at least one of two racing sides sees the other:
they never both go ahead. Promotion and rollback do the same against gc: they write their
deployment's lease (``posttrain.promote.lease``), then wait while any run's gc lease is live
(``live_gc_leases``); gc, holding a run's lease, skips the run while a deployment lease is live.

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
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.errors import ChainError
from posttrain.chain.policy import ChainHead
from posttrain.publish.ledger import RUNS_PREFIX, check_run_name
from posttrain.storage import StorageError, Store
from posttrain.storage.lease import LeaseBusy, LeaseRecord, StoreLease, live_lease, record_bytes
from posttrain.storage.lease import LeaseLost as StoreLeaseLost

__all__ = ["GC_LEASES_PREFIX", "GC_TTL", "PUBLISH_TTL", "GcLease", "LeaseLost", "LeaseRecord", "RunBusy", "base_retired", "leases_prefix",
           "live_gc_leases", "publishing"]

PUBLISH_TTL = 6 * 3600.0  # longer than any one publish step (encode and upload of one checkpoint)
GC_TTL = 600.0  # gc renews it before each snapshot it deletes


class RunBusy(LeaseBusy, ChainError):
    """Another holder has the run's lease."""


class LeaseLost(StoreLeaseLost, ChainError):
    """gc's lease on a run expired or was taken over while it was deleting: it stopped."""


GC_LEASES_PREFIX = ".posttrain/gc-leases/"


def leases_prefix(run: str) -> str:
    return f"{RUNS_PREFIX}{check_run_name(run)}/leases/"


def gc_lease_key(run: str) -> str:
    return f"{GC_LEASES_PREFIX}{check_run_name(run)}.json"


@contextlib.contextmanager
def publishing(store: Store, run: str, work_dir: Path, *, ttl: float = PUBLISH_TTL, poll: float = 1.0,
               clock: Callable[[], float] = time.time) -> Iterator[None]:
    """Hold the run's shared publisher lease for one publish step; wait while gc holds the run."""
    ident = xxhash.xxh3_64_hexdigest(f"{socket.gethostname()}:{Path(work_dir).resolve()}".encode())
    key = f"{leases_prefix(run)}publish-{ident}.json"
    store.put_bytes(key, record_bytes("publisher", ttl, clock))  # first ours, then look at gc's (module docstring)
    try:
        while live_lease(store, gc_lease_key(run), clock())[0] is not None:
            time.sleep(poll)
        yield
    finally:
        with contextlib.suppress(StorageError):  # never hide the step's own error; a leftover lease expires
            store.delete([key])


class GcLease(StoreLease):
    """gc's exclusive lease on one run: ``acquire`` (raises ``RunBusy``), ``renew`` (``LeaseLost``), ``release``."""

    busy, lost = RunBusy, LeaseLost

    def __init__(self, store: Store, run: str, *, ttl: float = GC_TTL, clock: Callable[[], float] = time.time):
        super().__init__(store, gc_lease_key(run), "gc", what=f"run {run}", ttl=ttl, clock=clock)
        self.run = run

    def busy_message(self, held: LeaseRecord, now: float) -> str:
        return f"{self.what}: held by another {held.describe(now)}"

    def acquire(self, **kw: Callable[[LeaseRecord], bool]) -> GcLease:
        super().acquire(**kw)
        for key in self.store.list(leases_prefix(self.run) + "publish-"):  # after ours is written
            held, _ = live_lease(self.store, key, self.clock())
            if held is not None:
                self.release()
                raise RunBusy(f"run {self.run}: being published ({held.describe(self.clock())})")
        return self


def live_gc_leases(store: Store, now: float) -> dict[str, LeaseRecord]:
    """run -> its live gc lease, of every run in the store (a listing of gc's leases only)."""
    out = {}
    for key in store.list(GC_LEASES_PREFIX):
        name = key[len(GC_LEASES_PREFIX):]
        if name.endswith(".json") and "/" not in name:
            held, _ = live_lease(store, key, now)
            if held is not None:
                out[name.removesuffix(".json")] = held
    return out


def base_retired(store: Store, head: ChainHead | None, step: int) -> bool:
    """Whether the snapshot a publisher would build ``step``'s delta on is gone from the store (gc
    retired it): its index, the commit marker, is deleted first, so with it present the snapshot
    and its whole chain prefix are whole. The head's own step is a redo, not a new delta."""
    if head is None or head.step >= step:
        return False
    return not store.exists(f"{head.identity}/{INDEX_NAME}")
