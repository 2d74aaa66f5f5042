"""Faults the reference server can inject, so clients' recovery is tested against the real server.

Enabled only by an explicit server option (``--test-hooks`` or ``--faults``). Each fault fires
``count`` times, on the next matching event, then is gone.
"""

from __future__ import annotations

import threading
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = Field(1, ge=1, description="How many matching events it applies to.")


class FailHotLoad(_Fault):
    """The next hot-load (of this type, when given) FAILS with ``reason``; the old weights keep serving."""

    kind: Literal["fail_hotload"]
    reason: str = Field("injected hot-load failure", description="Message put in the operation's conditions.")
    snapshot_type: str | None = Field(None, description="Only hot-loads of this type (SNAPSHOT_TYPE_...).")


class ReplicaError(_Fault):
    """The next hot-load COMPLETES, but its first replica goes to ERROR with ``reason`` (weights unchanged)."""

    kind: Literal["replica_error"]
    reason: str = Field("injected replica error", description="The replica's errorReason.")


class DropCreateReply(_Fault):
    """The next create makes the operation, then closes the connection without answering."""

    kind: Literal["drop_create_reply"]


class DelayHotLoad(_Fault):
    """The next hot-load stays RUNNING ``seconds`` longer: before it fetches anything, or, with
    ``after_fetched`` N, once it has fetched the first N snapshots of its chain (a reader half-way
    through a chain, for tests of what may change in the store meanwhile)."""

    kind: Literal["delay_hotload"]
    seconds: float = Field(ge=0, le=600, description="Extra seconds the load takes.")
    after_fetched: int = Field(0, ge=0, description="Pause after fetching this many snapshots of the chain "
                               "(0: before fetching; more than the chain holds: after the whole chain).")


class HttpError(_Fault):
    """The next matching requests answer ``status`` (with Retry-After when given) and do nothing."""

    kind: Literal["http_error"]
    status: int = Field(503, ge=400, le=599, description="HTTP status to answer.")
    method: str | None = Field(None, description="Only this method (GET, POST).")
    path_prefix: str | None = Field(None, description="Only paths starting with this.")
    retry_after: float | None = Field(None, ge=0, description="Retry-After header, in seconds.")


class StaleWeights(_Fault):
    """Reference engine: the next hot-load (of ``identity``, when given) leaves the loaded model holding
    the PREVIOUS version's values: every tensor (an engine that did not take the update), or only those
    named in ``tensors`` (an engine that dropped a tensor: it keeps the value it held). The engine's
    readback must refuse the load."""

    kind: Literal["stale_weights"]
    identity: str | None = Field(None, description="Only the hot-load of this snapshot identity.")
    tensors: list[str] | None = Field(None, min_length=1, description="Only these parameters keep the previous "
                                      "values (default: all of them).")


class CachedWeights(_Fault):
    """Reference engine: the next hot-load (of ``identity``, when given) serves weights loaded from
    another folder than the one it was given (an engine re-serving weights it cached): ``folder``, or
    the folder of the version served now. The engine's readback must refuse the load."""

    kind: Literal["cached_weights"]
    identity: str | None = Field(None, description="Only the hot-load of this snapshot identity.")
    folder: str | None = Field(None, description="The folder whose weights are served instead (default: the "
                               "version served now).")


Fault = Annotated[
    Union[FailHotLoad, ReplicaError, DropCreateReply, DelayHotLoad, HttpError, StaleWeights, CachedWeights],
    Field(discriminator="kind"),
]
FAULT_LIST = TypeAdapter(list[Fault])


class FaultBox:
    """Pending faults; thread-safe."""

    def __init__(self, faults: list | None = None):
        self._lock = threading.Lock()
        self._faults: list = list(faults or [])

    def add(self, faults: list) -> None:
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending(self) -> list[dict]:
        with self._lock:
            return [f.model_dump() for f in self._faults]

    def take(self, kind: str, *, snapshot_type: str | None = None, method: str | None = None,
             path: str | None = None, identity: str | None = None):
        """The first pending fault of ``kind`` matching the event, used up once; None if none."""
        with self._lock:
            for fault in self._faults:
                if fault.kind != kind:
                    continue
                if getattr(fault, "identity", None) not in (None, identity):
                    continue
                if isinstance(fault, FailHotLoad) and fault.snapshot_type not in (None, snapshot_type):
                    continue
                if isinstance(fault, HttpError):
                    if fault.method and method and fault.method.upper() != method.upper():
                        continue
                    if fault.path_prefix and not (path or "").startswith(fault.path_prefix):
                        continue
                fault.count -= 1
                if fault.count <= 0:
                    self._faults.remove(fault)
                return fault
        return None
