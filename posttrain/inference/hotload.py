"""Hot-load client for the CoreWeave ``v1alpha1`` contract (docs/hotload-api.md).

What it adds to the known client (Axolotl 0.21): retries with backoff on connection errors,
timeouts, 429 and 5xx only; a deterministic ``hotLoadId``, so an operation whose create reply
was lost is found again instead of created twice; no create while an earlier hot-load of the
deployment is unfinished; and a fallback to a full snapshot when an incremental load fails.

This module holds the operation logic (claim an operation id, create, follow, wait for the
operation and the replicas, fall back). The HTTP layer (auth header, retries, Retry-After,
error decoding, token scrubbing) is ``posttrain.inference.http``; the configuration is
``posttrain.inference.config`` (``HotLoadConfig`` is importable from here too).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import requests

from posttrain import redact
from posttrain.chain.errors import FormatError
from posttrain.chain.format import check_identity
from posttrain.inference.config import HotLoadConfig
from posttrain.inference.contract import (
    HotLoadAPIError,
    HotLoadFailed,
    HotLoadResult,
    HotLoadTimeout,
    HotLoadUnavailable,
    PublishFull,
    ReplicaStatus,
)
from posttrain.inference.http import HotLoadHTTP
from posttrain.inference.protocol import (
    API_PREFIX,
    CACHE_PRESERVE,
    CACHE_RESET_ALL,
    CHECKSUM_ADLER32,
    COMPRESSION_ZSTD,
    GRPC_ALREADY_EXISTS,
    GRPC_FAILED_PRECONDITION,
    REPLICA_ERROR,
    REPLICA_READY,
    STATE_COMPLETED,
    TERMINAL_STATES,
    TYPE_FULL,
    TYPE_INCREMENTAL,
    unwrap_hot_load,
)

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)

# hotLoadId = uuid5(namespace, "<deployment>/<identity>/<attempt>"): the same call finds the same operation
HOT_LOAD_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/posttrain/hotload-id")
MAX_EARLIER_ATTEMPTS = 1000


def operation_id_for(deployment_id: str, identity: str, attempt: int) -> str:
    """The ``hotLoadId`` of the ``attempt``-th hot-load of ``identity`` on the deployment."""
    return str(uuid.uuid5(HOT_LOAD_ID_NAMESPACE, f"{deployment_id}/{identity}/{attempt}"))


class CoreWeaveHotLoader:
    """``HotLoader`` for the CoreWeave hot-load API and ``posttrain serve``.

    One instance serves one deployment; it is not meant to be shared between threads.
    """

    def __init__(
        self,
        config: HotLoadConfig,
        *,
        publish_full: PublishFull | None = None,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.publish_full = publish_full
        self._http = HotLoadHTTP(config, session=session, sleep=sleep, clock=clock)
        self._clock = clock

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoreWeaveHotLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CoreWeaveHotLoader(api_url={self.config.api_url!r}, deployment_id={self.config.deployment_id!r})"

    # ------------------------------------------------------------------ the operation
    def hot_load(
        self,
        identity: str,
        *,
        base_identity: str | None = None,
        publish_full: PublishFull | None = None,
    ) -> HotLoadResult:
        """Make every replica serve ``identity``; a delta against ``base_identity`` when given.

        Raises HotLoadFailed (the operation failed, or a replica is in ERROR), HotLoadTimeout,
        or HotLoadAPIError.
        """
        _check_identity(identity, "identity")
        if base_identity is not None:
            _check_identity(base_identity, "base_identity")
        t0 = self._clock()
        self._http.retries = 0
        kind = TYPE_INCREMENTAL if base_identity is not None else TYPE_FULL
        try:
            return self._load(identity, kind, base_identity, t0)
        except HotLoadFailed as e:
            if kind != TYPE_INCREMENTAL or not self.config.fallback_to_full:
                raise
            publish = publish_full or self.publish_full
            if publish is None:
                raise HotLoadFailed(f"{e}; no publish_full callback was given to fall back to a full snapshot",
                                    operation_id=e.operation_id, reason=e.reason) from None
            failure = e
        log.warning("incremental hot-load of %s failed (%s); publishing a full snapshot to fall back to",
                    identity, self._http.scrub(failure.reason or str(failure)))
        full_identity = publish()
        _check_identity(full_identity, "identity returned by publish_full")
        result = self._load(full_identity, TYPE_FULL, None, self._clock())
        return result.model_copy(update=dict(
            fell_back=True, failed_identity=identity, failure_reason=failure.reason or str(failure),
            seconds=self._clock() - t0, retries=self._http.retries,
        ))

    def _load(self, identity: str, kind: str, base: str | None, t0: float) -> HotLoadResult:
        deadline = t0 + self.config.timeout
        self._http.deadline = deadline  # no call's retries (Retry-After included) wait past it
        try:
            op_id, existing = self._claim_operation_id(identity)
            if existing is not None:
                log.info("hot-load %s of %s exists already; following it", op_id, identity)
                return self._follow(existing, identity, t0, deadline, attempts=0, adopted=True)
            op, creates, adopted = self._create(op_id, identity, kind, base, deadline)
            return self._follow(op, identity, t0, deadline, attempts=creates, adopted=adopted)
        finally:
            self._http.deadline = None

    def _claim_operation_id(self, identity: str) -> tuple[str, dict | None]:
        """The first attempt number whose operation id is free, or an existing operation to follow.

        An operation of an earlier attempt that is still running, or that completed and still
        describes what every replica serves, is followed instead of creating another.
        """
        for attempt in range(MAX_EARLIER_ATTEMPTS):
            op_id = operation_id_for(self.config.deployment_id, identity, attempt)
            op = self.get_operation(op_id)
            if op is None:
                return op_id, None
            self._check_spec(op, identity, op_id)
            state = _state(op)
            if state not in TERMINAL_STATES:
                return op_id, op
            if state == STATE_COMPLETED and _converged(self.replicas(op_id), identity):
                return op_id, op
        raise HotLoadAPIError(f"{MAX_EARLIER_ATTEMPTS} earlier hot-loads of {identity} on deployment "
                              f"{self.config.deployment_id}; giving up")

    def _create(self, op_id: str, identity: str, kind: str, base: str | None,
                deadline: float) -> tuple[dict, int, bool]:
        """Create the operation once: returns (operation, create calls sent, adopted)."""
        body: dict[str, Any] = {
            "deploymentId": self.config.deployment_id,
            "identity": identity,
            "type": kind,
            "promptCachePolicy": self.config.prompt_cache_policy,
            "hotLoadId": op_id,
        }
        if kind == TYPE_INCREMENTAL:
            body["incrementalSnapshotMetadata"] = {
                "previousSnapshotIdentity": base,
                "compressionFormat": COMPRESSION_ZSTD,
                "checksumFormat": CHECKSUM_ADLER32,
            }
        seen = self._wait_idle(identity, deadline)
        if isinstance(seen, dict):  # an unfinished hot-load of this identity: follow it, create nothing
            return seen, 0, True
        creates = 0
        while True:
            creates += 1
            log.info("creating hot-load %s: %s %s on deployment %s", op_id, kind, identity,
                     self.config.deployment_id)
            try:
                reply = self._http.request("create hot-load", "POST", API_PREFIX, json=body, retry=False)
            except HotLoadUnavailable as e:
                # the create may have happened before the reply was lost: look before creating again
                found = self.get_operation(op_id) or self._find_new(identity, seen)
                if found is not None:
                    log.info("hot-load %s was created although its reply was lost (%s)", _op_id(found), e)
                    return found, creates, True
                if creates >= self.config.max_attempts:
                    raise HotLoadUnavailable(f"create hot-load for deployment {self.config.deployment_id} failed "
                                             f"after {creates} attempts: {e}", status=e.status, code=e.code) from None
                self._http.backoff(creates, e.retry_after, deadline, f"create hot-load: {e}")
                continue
            except HotLoadAPIError as e:
                if e.status == 409 and e.code in (None, GRPC_ALREADY_EXISTS):
                    found = self.get_operation(op_id)
                    if found is not None:
                        self._check_spec(found, identity, op_id)
                        return found, creates, True
                if e.status in (400, 409) and e.code in (None, GRPC_FAILED_PRECONDITION, 10) \
                        and creates < self.config.max_attempts:
                    # one hot-load at a time: if another started meanwhile, wait for it and try again
                    again = self._wait_idle(identity, deadline, only_if_busy=True)
                    if isinstance(again, dict):
                        return again, creates, True
                    if again is not None:
                        seen = again
                        continue
                raise
            op = unwrap_hot_load(reply)
            if not _op_id(op):
                raise HotLoadAPIError(f"create hot-load for deployment {self.config.deployment_id}: "
                                      "the reply names no operation id (hotLoad.spec.id)")
            self._check_spec(op, identity, _op_id(op))
            return op, creates, False

    def _follow(self, op: dict, identity: str, t0: float, deadline: float, *, attempts: int,
                adopted: bool) -> HotLoadResult:
        op_id = _op_id(op)
        op = self._wait_terminal(op, identity, deadline)
        state = _state(op)
        if state != STATE_COMPLETED:
            reason = _conditions_text(op) or state
            raise HotLoadFailed(self._http.scrub(f"hot-load {op_id} of {identity} on deployment "
                                            f"{self.config.deployment_id} ended {state}: {reason}"),
                                operation_id=op_id, reason=self._http.scrub(reason))
        while True:
            replicas = self.replicas(op_id)
            broken = [r for r in replicas if r.state == REPLICA_ERROR]
            if broken:
                reason = "; ".join(f"{r.name}: {r.error_reason or 'no reason given'}" for r in broken)
                raise HotLoadFailed(self._http.scrub(f"hot-load {op_id} of {identity} on deployment "
                                                f"{self.config.deployment_id}: replica in ERROR: {reason}"),
                                    operation_id=op_id, reason=self._http.scrub(reason))
            if _converged(replicas, identity):
                log.info("deployment %s serves %s (hot-load %s, %.1fs)", self.config.deployment_id, identity,
                         op_id, self._clock() - t0)
                return HotLoadResult(
                    operation_id=op_id, identity=identity, snapshot_type=str(_spec(op).get("type", "")),
                    state=state, seconds=self._clock() - t0, replicas=replicas, attempts=attempts,
                    retries=self._http.retries, adopted=adopted,
                )
            if self._clock() >= deadline:
                states = ", ".join(f"{r.name}={r.state}/{r.current_snapshot_identity or '-'}" for r in replicas)
                raise HotLoadTimeout(f"hot-load {op_id} completed but deployment {self.config.deployment_id} did "
                                     f"not converge to {identity} within {self.config.timeout:.0f}s "
                                     f"(replicas: {states or 'none'})")
            self._http.pause(self.config.poll_interval, deadline)

    def _wait_terminal(self, op: dict, identity: str, deadline: float) -> dict:
        op_id = _op_id(op)
        while _state(op) not in TERMINAL_STATES:
            if self._clock() >= deadline:
                raise HotLoadTimeout(f"hot-load {op_id} of {identity} on deployment {self.config.deployment_id} "
                                     f"is still {_state(op) or 'unknown'} after {self.config.timeout:.0f}s")
            self._http.pause(self.config.poll_interval, deadline)
            fresh = self.get_operation(op_id)
            if fresh is None:
                raise HotLoadAPIError(f"hot-load {op_id} on deployment {self.config.deployment_id} disappeared")
            self._check_spec(fresh, identity, op_id)
            op = fresh
        return op

    def _wait_idle(self, identity: str, deadline: float, *, only_if_busy: bool = False) -> set[str] | dict | None:
        """Wait until no hot-load of the deployment is unfinished; return the ids of those listed.

        An unfinished hot-load of ``identity`` itself is returned instead (it is followed, not
        repeated). With ``only_if_busy``, None when nothing was unfinished.
        """
        waited = False
        while True:
            ops = self.list_operations()
            unfinished = [o for o in ops if _state(o) not in TERMINAL_STATES]
            if not unfinished:
                return None if only_if_busy and not waited else {_op_id(o) for o in ops}
            for other in unfinished:
                if _spec(other).get("identity") == identity:
                    return other
            other = unfinished[0]
            log.info("hot-load %s (%s) of deployment %s is %s; waiting for it to finish before creating another",
                     _op_id(other), _spec(other).get("identity"), self.config.deployment_id, _state(other))
            self._wait_terminal(other, str(_spec(other).get("identity", "")), deadline)
            waited = True

    def _find_new(self, identity: str, seen: set[str]) -> dict | None:
        """An operation of ``identity`` that was not listed before our create (servers ignoring hotLoadId)."""
        for op in self.list_operations():  # newest first
            if _op_id(op) not in seen and _spec(op).get("identity") == identity:
                return op
        return None

    # ------------------------------------------------------------------ reads
    def get_operation(self, op_id: str) -> dict | None:
        """The operation (``spec`` and ``status``), or None when there is none with this id."""
        body = self._http.request("get hot-load", "GET", f"{API_PREFIX}/{op_id}", not_found_ok=True)
        return None if body is None else unwrap_hot_load(body)

    def list_operations(self) -> list[dict]:
        """Every operation of the deployment, newest first (all pages)."""
        dep = self.config.deployment_id
        ops = self._http.pages("list hot-loads", API_PREFIX, "hotLoads",
                               {"parentDeploymentId": dep, "maxPageSize": self.config.list_page_size})
        return [o for o in ops if _spec(o).get("deploymentId", dep) == dep]

    def replicas(self, op_id: str) -> list[ReplicaStatus]:
        """Every replica of the operation's deployment (all pages)."""
        items = self._http.pages("list hot-load replicas", f"{API_PREFIX}/{op_id}/replicas", "replicas",
                                 {"maxPageSize": self.config.replica_page_size})
        return [ReplicaStatus(
            name=str(r.get("name", "")), zone=str(r.get("zone", "")), state=str(r.get("state", "")),
            current_snapshot_identity=str(r.get("currentSnapshotIdentity", "") or ""),
            error_reason=str(r.get("errorReason", "") or ""),
        ) for r in items]

    def served_identities(self) -> set[str]:
        """The identities the deployment's replicas serve now (``currentSnapshotIdentity``), read through
        its newest operation (``GET hotLoads?parentDeploymentId=D&maxPageSize=1``, then its replicas:
        the deployment's), plus what that operation still loads when unfinished. Empty when never
        hot-loaded (the replicas serve the model they booted with, no snapshot)."""
        dep = self.config.deployment_id
        body = self._http.request("list hot-loads", "GET", API_PREFIX, params={"parentDeploymentId": dep,
                                                                             "maxPageSize": 1})
        items = body.get("hotLoads") or []
        if not isinstance(items, list):  # not "nothing served": gc would delete what is
            raise HotLoadAPIError(f"list hot-loads for deployment {dep}: hotLoads is not a list")
        newest = next((o for o in items if isinstance(o, dict) and _spec(o).get("deploymentId", dep) == dep), None)
        if newest is None or not _op_id(newest):
            return set()
        served = {r.current_snapshot_identity for r in self.replicas(_op_id(newest)) if r.current_snapshot_identity}
        if _state(newest) not in TERMINAL_STATES and isinstance(_spec(newest).get("identity"), str):
            served.add(_spec(newest)["identity"])
        return served

    def _check_spec(self, op: dict, identity: str, op_id: str) -> None:
        spec = _spec(op)
        got = (spec.get("identity"), spec.get("deploymentId"))
        if got != (identity, self.config.deployment_id):
            raise HotLoadAPIError(f"hot-load {op_id} is for identity {got[0]!r} on deployment {got[1]!r}, "
                                  f"expected {identity!r} on {self.config.deployment_id!r}")


# ---------------------------------------------------------------------- helpers
def _spec(op: dict) -> dict:
    spec = op.get("spec")
    return spec if isinstance(spec, dict) else {}


def _op_id(op: dict) -> str:
    return str(_spec(op).get("id") or op.get("id") or "")


def _state(op: dict) -> str:
    status = op.get("status")
    return str(status.get("state", "")) if isinstance(status, dict) else ""


def _conditions_text(op: dict) -> str:
    status = op.get("status") if isinstance(op.get("status"), dict) else {}
    parts = []
    for c in status.get("conditions") or []:
        if isinstance(c, dict):
            text = ": ".join(str(c[k]) for k in ("reason", "message") if c.get(k))
            if text:
                parts.append(text)
    return "; ".join(parts)


def _converged(replicas: list[ReplicaStatus], identity: str) -> bool:
    return bool(replicas) and all(
        r.state == REPLICA_READY and r.current_snapshot_identity == identity for r in replicas
    )


def _check_identity(identity: object, what: str) -> None:
    try:
        check_identity(identity, what)  # type: ignore[arg-type]
    except FormatError as e:
        raise ValueError(str(e)) from None


__all__ = [
    "CACHE_PRESERVE",
    "CACHE_RESET_ALL",
    "CoreWeaveHotLoader",
    "HotLoadConfig",
    "operation_id_for",
]
