"""The seam between the publisher and an inference engine: ``HotLoader`` and what it returns.

A hot-loader makes a deployment serve a snapshot of the chain (docs/delta-format.md)
that the publisher has already written to the deployment's store. ``CoreWeaveHotLoader``
(``posttrain.inference.hotload``) is the implementation for the CoreWeave ``v1alpha1``
contract, which posttrain's reference server (``posttrain serve``) speaks too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from posttrain.errors import TransientError

PublishFull = Callable[[], str]
"""Publishes a full snapshot of the current weights to the deployment's store; returns its identity."""


class ReplicaStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Replica name as the service reports it.")
    zone: str = Field("", description="Zone of the replica, when reported.")
    state: str = Field(description="READY, LOADING, ERROR, ...")
    current_snapshot_identity: str = Field("", description="Snapshot the replica serves now.")
    error_reason: str = Field("", description="Why the replica is in ERROR, when it is.")


class HotLoadResult(BaseModel):
    """A hot-load that converged: every replica serves ``identity``."""

    model_config = ConfigDict(extra="forbid")

    operation_id: str = Field(description="Id of the hot-load operation that converged.")
    identity: str = Field(description="Snapshot identity the deployment now serves.")
    snapshot_type: str = Field(description="SNAPSHOT_TYPE_FULL or SNAPSHOT_TYPE_INCREMENTAL.")
    state: str = Field(description="Terminal state of the operation (HOT_LOAD_STATE_COMPLETED).")
    seconds: float = Field(description="Wall time from the call to convergence, fallback included.")
    replicas: list[ReplicaStatus] = Field(description="Every replica as last seen.")
    attempts: int = Field(
        description="Create calls sent for the operation that converged (0: an existing operation was adopted)."
    )
    retries: int = Field(0, description="HTTP calls repeated after a connection error, timeout, 429 or 5xx.")
    adopted: bool = Field(False, description="The operation existed already (found by its id) and was not created.")
    fell_back: bool = Field(False, description="The incremental hot-load failed and a full snapshot was loaded.")
    failed_identity: str | None = Field(None, description="The incremental snapshot that failed, when fell_back.")
    failure_reason: str | None = Field(None, description="Why the incremental hot-load failed, when fell_back.")


class HotLoadError(Exception):
    """Base class: the deployment does not serve the requested snapshot."""


class HotLoadFailed(HotLoadError):
    """The service ran the hot-load and it failed: the operation FAILED or CANCELED, or a replica is in ERROR."""

    def __init__(self, message: str, *, operation_id: str | None = None, reason: str = ""):
        super().__init__(message)
        self.operation_id = operation_id
        self.reason = reason


class HotLoadTimeout(HotLoadError, TransientError):
    """The hot-load did not converge within the timeout; the operation may still be running."""


class HotLoadAPIError(HotLoadError):
    """A call to the service failed: an HTTP error, retries exhausted, or a malformed reply."""

    def __init__(self, message: str, *, status: int | None = None, code: int | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


class HotLoadUnavailable(HotLoadAPIError, TransientError):
    """A call that may succeed when repeated failed: a connection error, a timeout, HTTP 429 or 5xx.

    ``status`` is None for a connection error or timeout; ``retry_after`` is the server's
    Retry-After in seconds, when it sent one.
    """

    def __init__(self, message: str, *, status: int | None = None, code: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message, status=status, code=code)
        self.retry_after = retry_after


@runtime_checkable
class HotLoader(Protocol):
    """Makes a deployment serve a snapshot that is already in its store."""

    def hot_load(
        self,
        identity: str,
        *,
        base_identity: str | None = None,
        publish_full: PublishFull | None = None,
    ) -> HotLoadResult:
        """Load ``identity`` (a delta against ``base_identity`` when given, else a full snapshot).

        When an incremental load fails and ``publish_full`` is given, the implementation may
        publish a full snapshot through it and load that instead (``fell_back``).
        Raises HotLoadError.
        """
        ...
