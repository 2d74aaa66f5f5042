"""Turns for the rollout shards' subflow writes to Prefect's API, per process.

A subflow's start is about eight API calls (the parent task run that tracks it, a look-up of an
earlier run, the flow, the flow run, its name, Running, a read); its end is one (Completed).
The shards of a round are mapped at once, so without turns every shard starts its subflow at the
same moment, and none samples until the server has got through nearly all of them: on PostgreSQL
at 64 shards, 4-9 s from the hot-load to the first sample on a 2-CPU machine. With turns, a few
shards start at a time; the first ones sample while the next ones start.

On SQLite, two of those calls are transactions that read before they write, and SQLite (WAL)
fails such a transaction at once with "database is locked" when another connection commits
between its read and its write: HTTP 503, and Prefect's client backs off 2, 4, 8 s. So there
one shard starts at a time, and a shard takes a turn for its Completed write too.

``POSTTRAIN_PREFECT_DB`` names the server's database, as for scripts/services/start-prefect.sh:
sqlite (the default, and the embedded server's), or postgres or a postgresql URL.
``POSTTRAIN_SUBFLOW_STARTS`` sets how many shards of a process start at once (measured best on a
2-CPU server: 2 on PostgreSQL; see bench/prefect_overhead.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# How long a shard waits for a turn before it goes anyway: longer than any start takes, so that
# a slow server does not release every waiting shard at once.
TURN_WAIT_S = 30.0
STARTS_ON_POSTGRES = 2


def sqlite_server() -> bool:
    return os.environ.get("POSTTRAIN_PREFECT_DB", "sqlite").strip().lower() in ("", "sqlite")


def starts_at_once() -> int:
    """How many shards of this process start their subflows at once."""
    value = os.environ.get("POSTTRAIN_SUBFLOW_STARTS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"POSTTRAIN_SUBFLOW_STARTS must be a whole number >= 1, not {value!r}")
        return int(value)
    return 1 if sqlite_server() else STARTS_ON_POSTGRES


class Turns:
    """A shard task takes a turn on entering (``shard_task``), gives it back when its subflow's
    body starts (``started``), and on SQLite takes one again before its subflow completes
    (``finishing``); the task's end gives back whatever it holds. Outside a shard task (a subflow
    run on its own) there are no turns: nothing would give them back."""

    def __init__(self) -> None:
        self._semaphores: dict[int, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _semaphore(self) -> threading.BoundedSemaphore:
        n = starts_at_once()
        with self._lock:
            return self._semaphores.setdefault(n, threading.BoundedSemaphore(n))

    def held(self) -> bool:
        return getattr(self._local, "held", None) is not None

    def _take(self) -> None:
        if getattr(self._local, "in_task", False) and not self.held():
            semaphore = self._semaphore()
            if semaphore.acquire(timeout=TURN_WAIT_S):
                self._local.held = semaphore

    def _give_back(self) -> None:
        semaphore, self._local.held = getattr(self._local, "held", None), None
        if semaphore is not None:
            semaphore.release()

    @contextmanager
    def shard_task(self) -> Iterator[None]:
        self._local.in_task = True
        self._take()
        try:
            yield
        finally:
            self._local.in_task = False
            self._give_back()

    def started(self) -> None:
        self._give_back()

    def finishing(self) -> None:
        if sqlite_server():
            self._take()


TURNS = Turns()
