"""Exclusive leases held in an object store: one holder at a time for whatever a key stands for.

A lease is a small JSON record (holder, host, pid, expiry, and what the holder wants the next
one to know) at one key. ``StoreLease.acquire`` writes it create-only (``if_none_match``); a
lease found there is taken over only once it has expired (or when the caller says it may be
reclaimed: a retry of the run that holds it), by its ETag, so of two takers one wins.
``renew`` and ``release`` go by the ETag the holder wrote last, so a holder whose lease was
taken over never renews or deletes the new holder's. Expiry is wall-clock time: the machines'
clocks must agree to well within the TTL.

The run leases of gc and the publishers (``posttrain.publish.lease``) and the deployment lease
of promotion and rollback (``posttrain.promote.lease``) are built on it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.storage.base import Store
from posttrain.storage.errors import NotFound, PreconditionFailed, StorageError

class LeaseBusy(StorageError):
    """Another holder has the lease."""


class LeaseLost(StorageError):
    """A lease expired or was taken over while its holder worked under it: the holder stopped."""


class LeaseRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    holder: str = Field(description="publisher, gc, or the operation holding a deployment (promotion, rollback).")
    host: str = Field(description="Host name of the holder.")
    pid: int = Field(description="Process id of the holder.")
    expires_at: float = Field(description="Unix time after which the lease no longer holds.")
    run: str | None = Field(None, description="The run (flow run) holding it, when one does: its retry may take it.")
    pending: str | None = Field(None, description="A deployment lease: the identity production is being switched "
                                "to, set before the record is written and cleared when production serves it.")

    def describe(self, now: float) -> str:
        who = f"{self.holder} {self.run}" if self.run else self.holder
        return f"{who} pid {self.pid} on {self.host}, lease expires in {max(self.expires_at - now, 0):.0f}s"


def record_bytes(holder: str, ttl: float, clock: Callable[[], float], **fields: object) -> bytes:
    rec = LeaseRecord(holder=holder, host=socket.gethostname(), pid=os.getpid(), expires_at=clock() + ttl, **fields)
    return rec.model_dump_json().encode()


def read_lease(store: Store, key: str) -> tuple[LeaseRecord | None, str | None]:
    """The lease at ``key`` (live or expired) and its ETag; the record is None when absent or unreadable."""
    try:
        data, etag = store.get_bytes(key)
    except NotFound:
        return None, None
    try:
        return LeaseRecord.model_validate_json(data), etag
    except ValidationError:
        return None, etag  # a torn or foreign file holds nothing


def live_lease(store: Store, key: str, now: float) -> tuple[LeaseRecord | None, str | None]:
    """The lease at ``key`` and its ETag; the record is None when absent, unreadable or expired."""
    rec, etag = read_lease(store, key)
    return (rec if rec is not None and rec.expires_at > now else None), etag


class StoreLease:
    """An exclusive lease at one key of a store: ``acquire`` writes it create-only, or takes over an
    expired one by its ETag (raises ``busy`` while another holder's is live); ``renew`` and
    ``release`` go by the ETag it wrote, so a lease taken over meanwhile is never touched.
    ``replaced`` is the expired record it took over, if any: its holder ended without releasing it;
    the ``pending`` that record carries is carried over, until the new holder clears it."""

    busy: type[LeaseBusy] = LeaseBusy
    lost: type[LeaseLost] = LeaseLost

    def __init__(self, store: Store, key: str, holder: str, *, what: str, ttl: float, run: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.store, self.key, self.holder, self.what, self.ttl, self.clock = store, key, holder, what, ttl, clock
        self.flow_run = run
        self.replaced: LeaseRecord | None = None
        self.pending: str | None = None
        self._etag: str | None = None
        self._deadline = 0.0

    def _body(self) -> bytes:
        return record_bytes(self.holder, self.ttl, self.clock, run=self.flow_run, pending=self.pending)

    def busy_message(self, held: LeaseRecord, now: float) -> str:
        return f"{self.what}: held by {held.describe(now)}"

    def acquire(self, *, reclaim: Callable[[LeaseRecord], bool] = lambda _held: False) -> StoreLease:
        """Take the lease; a live one is taken over only when ``reclaim`` says so (a retry of its run)."""
        now = self.clock()
        body = self._body()
        try:
            etag = self.store.put_bytes(self.key, body, if_none_match=True)
        except PreconditionFailed:
            held, stale = read_lease(self.store, self.key)
            if held is not None and held.expires_at > now and not reclaim(held):
                raise self.busy(self.busy_message(held, now)) from None
            if held is not None and held.pending is not None:  # what it left unfinished stays marked
                self.pending = held.pending
                body = self._body()
            try:  # expired (or reclaimed): take it over, unless someone else just did
                etag = self.store.put_bytes(self.key, body, if_match=stale) if stale else \
                    self.store.put_bytes(self.key, body, if_none_match=True)
            except PreconditionFailed:
                raise self.busy(f"{self.what}: another holder took its lease meanwhile") from None
            self.replaced = held
        self._etag, self._deadline = etag, now + self.ttl
        return self

    @property
    def held(self) -> bool:
        return self._etag is not None

    def renew(self) -> None:
        """Extend the lease (writing ``pending`` too); ``LeaseLost`` when it may have expired or is
        someone else's now."""
        now = self.clock()
        if self._etag is None or now >= self._deadline - 1.0:
            self._etag = None
            raise self.lost(f"{self.what}: {self.holder}'s lease ran out (over {self.ttl:g}s without renewal); "
                            "stopped")
        try:
            self._etag = self.store.put_bytes(self.key, self._body(), if_match=self._etag)
        except PreconditionFailed:
            self._etag = None
            raise self.lost(f"{self.what}: {self.holder}'s lease was taken over; stopped") from None
        self._deadline = now + self.ttl

    def release(self) -> None:
        """Delete the lease if it is still ours; with ``pending`` set, leave it behind expired instead,
        so that the next holder finds what was left unfinished."""
        if self._etag is None:
            return
        try:
            _, etag = self.store.get_bytes(self.key)
        except NotFound:
            etag = None
        if etag is not None and etag.strip('"') == self._etag.strip('"'):  # only our own: it may have been taken over
            if self.pending is None:
                self.store.delete([self.key])
            else:
                rec = LeaseRecord.model_validate_json(self._body()).model_copy(update={"expires_at": self.clock()})
                with contextlib.suppress(PreconditionFailed):
                    self.store.put_bytes(self.key, rec.model_dump_json().encode(), if_match=self._etag)
        self._etag = None
