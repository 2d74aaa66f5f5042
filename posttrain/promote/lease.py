"""One writer per production deployment: the lease that promotion and rollback hold while they
decide, record and switch production (docs/promotion.md, "One writer per deployment").

    <prefix>/.posttrain/deployments/<deployment>/lease.json

It is a ``posttrain.storage.lease.StoreLease`` (create-only, an expired one taken over by its
ETag), renewed by a thread of the holder every quarter of its TTL, so a holder that dies lets
go within the TTL and a slow hot-load keeps it. A second operation on the same deployment
loses at once (``DeploymentBusy``: who holds it, until when), unless it is a retry of the run
that holds it (the same run, unique to a flow run and kept by its retries): that one takes it over.

The record carries ``pending``, the identity production is being switched to: it is written
before the history record and cleared once production serves what the history says. A lease
left with ``pending`` (its holder was killed, or a failed switch could not restore the
champion) tells the next holder to make production serve the history's champion first.

gc does not take these leases; it skips a run while any of them is live
(``live_deployment_leases``), and a holder waits while any run's gc lease is live
(``posttrain.publish.lease.live_gc_leases``): each side writes its own lease before it reads
the other's, so one of two racing sides always sees the other.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

from posttrain import redact
from posttrain.promote.history import check_deployment
from posttrain.storage import StorageError, Store
from posttrain.storage.lease import LeaseBusy, LeaseLost, LeaseRecord, StoreLease, live_lease

log = redact.logger(__name__)  # a store error may carry a URL

DEPLOYMENTS = ".posttrain/deployments/"
LEASE_NAME = "lease.json"
DEPLOYMENT_TTL = 120.0  # renewed every TTL/4 while held: a dead holder lets go within this


class DeploymentBusy(LeaseBusy):
    """Another operation holds the deployment's lease: this one lost, and changed nothing."""


def lease_key(deployment: str) -> str:
    return f"{DEPLOYMENTS}{check_deployment(deployment)}/{LEASE_NAME}"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class DeploymentLease(StoreLease):
    """The lease of one production deployment; ``holding`` takes it and keeps it renewed."""

    busy = DeploymentBusy

    def __init__(self, store: Store, deployment: str, holder: str, *, run: str | None = None,
                 ttl: float = DEPLOYMENT_TTL, clock: Callable[[], float] = time.time):
        super().__init__(store, lease_key(deployment), holder, what=f"deployment {deployment}", ttl=ttl, run=run,
                         clock=clock)
        self.deployment = deployment
        self._lock = threading.Lock()
        self._lost: Exception | None = None

    def busy_message(self, held: LeaseRecord, now: float) -> str:
        who = f"{held.holder} {held.run}" if held.run else held.holder
        return (f"deployment {self.deployment} is held by {who} (pid {held.pid} on {held.host}) until "
                f"{_utc(held.expires_at)} ({max(held.expires_at - now, 0):.0f}s); nothing was changed")

    @property
    def left_pending(self) -> str | None:
        """The switch an earlier holder left unfinished (the lease it took over says so), if any."""
        return self.replaced.pending if self.replaced is not None else None

    def renew(self) -> None:
        with self._lock:
            super().renew()

    def release(self) -> None:
        with self._lock:
            super().release()

    def mark(self, pending: str | None) -> None:
        """Write ``pending`` into the lease now (``None`` clears it): production is being switched to it."""
        with self._lock:
            self.check()
            self.pending = pending
            super().renew()

    def check(self) -> None:
        """Raise why the lease was lost, if it was (a renewal failed or came too late)."""
        if self._lost is not None:
            raise self._lost
        if not self.held:
            raise self.lost(f"deployment {self.deployment}: its lease is no longer held; stopped")

    def keep_renewed(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl / 4):
            try:
                self.renew()
            except LeaseLost as e:  # taken over, or not renewed within the TTL: the holder must stop
                self._lost = e
                return
            except (StorageError, OSError) as e:  # one failed write: the lease holds until its deadline, try again
                log.warning("deployment %s: renewing its lease failed (%s); trying again in %gs", self.deployment,
                            e, self.ttl / 4)


@contextlib.contextmanager
def holding(store: Store, deployment: str, holder: str, *, run: str | None = None, ttl: float = DEPLOYMENT_TTL,
            clock: Callable[[], float] = time.time) -> Iterator[DeploymentLease]:
    """Hold ``deployment``'s lease (``DeploymentBusy`` when another holds it), renewed in the
    background; released at the end, or left expired with ``pending`` when that is still set."""
    lease = DeploymentLease(store, deployment, holder, run=run, ttl=ttl, clock=clock)
    lease.acquire(reclaim=lambda held: run is not None and held.run == run)  # a retry of the holder's run
    stop = threading.Event()
    renewer = threading.Thread(target=lease.keep_renewed, args=(stop,), daemon=True,
                               name=f"lease-{deployment}")
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(StorageError):  # never hide the operation's own error; a lease expires
            lease.release()


def live_deployment_leases(store: Store, now: float) -> dict[str, LeaseRecord]:
    """deployment -> its live lease, of every deployment in the store."""
    out = {}
    for key in store.list(DEPLOYMENTS):
        rest = key[len(DEPLOYMENTS):]
        if rest.endswith("/" + LEASE_NAME) and rest.count("/") == 1:
            held, _ = live_lease(store, key, now)
            if held is not None:
                out[rest.split("/", 1)[0]] = held
    return out
