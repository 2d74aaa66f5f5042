"""Hot-load client for the CoreWeave ``v1alpha1`` contract (shared/spec/hotload-api.md).

What it adds to the known client (Axolotl 0.21): retries with backoff on connection errors,
timeouts, 429 and 5xx only; a deterministic ``hotLoadId``, so an operation whose create reply
was lost is found again instead of created twice; no create while an earlier hot-load of the
deployment is unfinished; and a fallback to a full snapshot when an incremental load fails.

The token is a ``SecretStr``: it goes into the Authorization header and nowhere else, and
every message built from a server reply is scrubbed of it.
"""

from __future__ import annotations

import email.utils
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import requests
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from posttrain.chain.errors import FormatError
from posttrain.chain.format import check_identity
from posttrain.inference.contract import (
    HotLoadAPIError,
    HotLoadFailed,
    HotLoadResult,
    HotLoadTimeout,
    PublishFull,
    ReplicaStatus,
)
from posttrain.inference.protocol import (
    API_PREFIX,
    CACHE_PRESERVE,
    CACHE_RESET_ALL,
    CHECKSUM_ADLER32,
    COMPRESSION_ZSTD,
    GRPC_ALREADY_EXISTS,
    GRPC_FAILED_PRECONDITION,
    MAX_PAGE_SIZE,
    REPLICA_ERROR,
    REPLICA_READY,
    STATE_COMPLETED,
    TERMINAL_STATES,
    TYPE_FULL,
    TYPE_INCREMENTAL,
    unwrap_hot_load,
)

log = logging.getLogger(__name__)

# hotLoadId = uuid5(namespace, "<deployment>/<identity>/<attempt>"): the same call finds the same operation
HOT_LOAD_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/posttrain/hotload-id")
MAX_EARLIER_ATTEMPTS = 1000


class HotLoadConfig(BaseModel):
    """Where the hot-load service is and how patiently to talk to it."""

    model_config = ConfigDict(extra="forbid")

    api_url: str = Field(
        "https://api.coreweave.com",
        description="Base URL of the hot-load control plane (posttrain serve: http://127.0.0.1:PORT).",
    )
    deployment_id: str = Field(min_length=1, description="Id of the inference deployment to hot-load.")
    token: SecretStr = Field(
        description="Bearer token (an Inference Admin token, CW_API_TOKEN by convention); never logged."
    )
    timeout: float = Field(
        1800.0, gt=0,
        description="Seconds one hot-load may take from the call to replica convergence, waiting for an "
        "unfinished earlier hot-load of the deployment included (a fallback gets its own).",
    )
    poll_interval: float = Field(2.0, gt=0, description="Seconds between polls of an operation and its replicas.")
    request_timeout: float = Field(30.0, gt=0, description="Seconds one HTTP call may take.")
    max_attempts: int = Field(
        6, ge=1, description="Tries of one HTTP call (creates included) on connection errors, timeouts, 429 and 5xx."
    )
    backoff_base: float = Field(0.5, ge=0, description="Seconds before the first retry; doubles on each retry.")
    backoff_max: float = Field(30.0, ge=0, description="Longest pause between retries (before jitter).")
    replica_page_size: int = Field(
        MAX_PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE, description="maxPageSize when walking an operation's replicas."
    )
    list_page_size: int = Field(
        100, ge=1, le=MAX_PAGE_SIZE, description="maxPageSize when listing the deployment's operations."
    )
    prompt_cache_policy: Literal["PROMPT_CACHE_POLICY_RESET_ALL", "PROMPT_CACHE_POLICY_PRESERVE"] = Field(
        CACHE_RESET_ALL,
        description="Prompt cache after the swap: RESET_ALL (right for RL: cached prefixes belong to the old "
        "weights) or PRESERVE (the API's default).",
    )
    fallback_to_full: bool = Field(
        True, description="When an incremental hot-load fails, publish a full snapshot (publish_full) and load it."
    )

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, value: str) -> str:
        value = value.rstrip("/")
        if not re.match(r"^https?://[^/@\s]+(/\S*)?$", value):
            raise ValueError("api_url must be http(s)://host[:port][/path] with no credentials in it")
        return value

    @classmethod
    def from_env(cls, *, token_env: str = "CW_API_TOKEN", **fields: Any) -> HotLoadConfig:
        """A config whose token comes from the environment variable ``token_env``."""
        import os

        token = os.environ.get(token_env)
        if not token:
            raise ValueError(f"environment variable {token_env} is not set (the hot-load API token)")
        return cls(token=SecretStr(token), **fields)


def operation_id_for(deployment_id: str, identity: str, attempt: int) -> str:
    """The ``hotLoadId`` of the ``attempt``-th hot-load of ``identity`` on the deployment."""
    return str(uuid.uuid5(HOT_LOAD_ID_NAMESPACE, f"{deployment_id}/{identity}/{attempt}"))


class _Transient(HotLoadAPIError):
    """A call that may succeed when repeated: connection error, timeout, 429 or 5xx."""

    def __init__(self, message: str, *, status: int | None = None, code: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message, status=status, code=code)
        self.retry_after = retry_after


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
        self._session = session or requests.Session()
        self._sleep = sleep
        self._clock = clock
        self._retries = 0

    def close(self) -> None:
        self._session.close()

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
        self._retries = 0
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
                    identity, self._scrub(failure.reason or str(failure)))
        full_identity = publish()
        _check_identity(full_identity, "identity returned by publish_full")
        result = self._load(full_identity, TYPE_FULL, None, self._clock())
        return result.model_copy(update=dict(
            fell_back=True, failed_identity=identity, failure_reason=failure.reason or str(failure),
            seconds=self._clock() - t0, retries=self._retries,
        ))

    def _load(self, identity: str, kind: str, base: str | None, t0: float) -> HotLoadResult:
        deadline = t0 + self.config.timeout
        op_id, existing = self._claim_operation_id(identity)
        if existing is not None:
            log.info("hot-load %s of %s exists already; following it", op_id, identity)
            return self._follow(existing, identity, t0, deadline, attempts=0, adopted=True)
        op, creates, adopted = self._create(op_id, identity, kind, base, deadline)
        return self._follow(op, identity, t0, deadline, attempts=creates, adopted=adopted)

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
                reply = self._request("create hot-load", "POST", API_PREFIX, json=body, retry=False)
            except _Transient as e:
                # the create may have happened before the reply was lost: look before creating again
                found = self.get_operation(op_id) or self._find_new(identity, seen)
                if found is not None:
                    log.info("hot-load %s was created although its reply was lost (%s)", _op_id(found), e)
                    return found, creates, True
                if creates >= self.config.max_attempts:
                    raise HotLoadAPIError(f"create hot-load for deployment {self.config.deployment_id} failed "
                                          f"after {creates} attempts: {e}", status=e.status, code=e.code) from None
                self._backoff(creates, e.retry_after, deadline, f"create hot-load: {e}")
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
            raise HotLoadFailed(self._scrub(f"hot-load {op_id} of {identity} on deployment "
                                            f"{self.config.deployment_id} ended {state}: {reason}"),
                                operation_id=op_id, reason=self._scrub(reason))
        while True:
            replicas = self.replicas(op_id)
            broken = [r for r in replicas if r.state == REPLICA_ERROR]
            if broken:
                reason = "; ".join(f"{r.name}: {r.error_reason or 'no reason given'}" for r in broken)
                raise HotLoadFailed(self._scrub(f"hot-load {op_id} of {identity} on deployment "
                                                f"{self.config.deployment_id}: replica in ERROR: {reason}"),
                                    operation_id=op_id, reason=self._scrub(reason))
            if _converged(replicas, identity):
                log.info("deployment %s serves %s (hot-load %s, %.1fs)", self.config.deployment_id, identity,
                         op_id, self._clock() - t0)
                return HotLoadResult(
                    operation_id=op_id, identity=identity, snapshot_type=str(_spec(op).get("type", "")),
                    state=state, seconds=self._clock() - t0, replicas=replicas, attempts=attempts,
                    retries=self._retries, adopted=adopted,
                )
            if self._clock() >= deadline:
                states = ", ".join(f"{r.name}={r.state}/{r.current_snapshot_identity or '-'}" for r in replicas)
                raise HotLoadTimeout(f"hot-load {op_id} completed but deployment {self.config.deployment_id} did "
                                     f"not converge to {identity} within {self.config.timeout:.0f}s "
                                     f"(replicas: {states or 'none'})")
            self._pause(self.config.poll_interval, deadline)

    def _wait_terminal(self, op: dict, identity: str, deadline: float) -> dict:
        op_id = _op_id(op)
        while _state(op) not in TERMINAL_STATES:
            if self._clock() >= deadline:
                raise HotLoadTimeout(f"hot-load {op_id} of {identity} on deployment {self.config.deployment_id} "
                                     f"is still {_state(op) or 'unknown'} after {self.config.timeout:.0f}s")
            self._pause(self.config.poll_interval, deadline)
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
        body = self._request("get hot-load", "GET", f"{API_PREFIX}/{op_id}", not_found_ok=True)
        return None if body is None else unwrap_hot_load(body)

    def list_operations(self) -> list[dict]:
        """Every operation of the deployment, newest first (all pages)."""
        out: list[dict] = []
        token, tokens = "", set()
        while True:
            params = {"parentDeploymentId": self.config.deployment_id, "maxPageSize": self.config.list_page_size}
            if token:
                params["pageToken"] = token
            body = self._request("list hot-loads", "GET", API_PREFIX, params=params)
            ops = body.get("hotLoads") or []
            if not isinstance(ops, list):
                raise HotLoadAPIError(f"list hot-loads for deployment {self.config.deployment_id}: "
                                      "hotLoads is not a list")
            out += [o for o in ops if isinstance(o, dict)
                    and _spec(o).get("deploymentId", self.config.deployment_id) == self.config.deployment_id]
            token = body.get("nextPageToken") or ""
            if not token:
                return out
            if token in tokens:
                raise HotLoadAPIError(f"list hot-loads for deployment {self.config.deployment_id}: "
                                      "the service repeated a page token")
            tokens.add(token)

    def replicas(self, op_id: str) -> list[ReplicaStatus]:
        """Every replica of the operation's deployment (all pages)."""
        out: list[ReplicaStatus] = []
        token, tokens = "", set()
        while True:
            params: dict[str, Any] = {"maxPageSize": self.config.replica_page_size}
            if token:
                params["pageToken"] = token
            body = self._request("list hot-load replicas", "GET", f"{API_PREFIX}/{op_id}/replicas", params=params)
            items = body.get("replicas") or []
            if not isinstance(items, list):
                raise HotLoadAPIError(f"list hot-load replicas of {op_id}: replicas is not a list")
            for r in items:
                if not isinstance(r, dict):
                    continue
                out.append(ReplicaStatus(
                    name=str(r.get("name", "")), zone=str(r.get("zone", "")), state=str(r.get("state", "")),
                    current_snapshot_identity=str(r.get("currentSnapshotIdentity", "") or ""),
                    error_reason=str(r.get("errorReason", "") or ""),
                ))
            token = body.get("nextPageToken") or ""
            if not token:
                return out
            if token in tokens:
                raise HotLoadAPIError(f"list hot-load replicas of {op_id}: the service repeated a page token")
            tokens.add(token)

    # ------------------------------------------------------------------ HTTP
    def _request(self, name: str, method: str, path: str, *, params: dict | None = None,
                 json: dict | None = None, retry: bool = True, not_found_ok: bool = False) -> Any:
        url = self.config.api_url + path
        headers = {"Authorization": f"Bearer {self.config.token.get_secret_value()}", "Accept": "application/json"}
        where = f"{name} ({method} {path}) for deployment {self.config.deployment_id}"
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self._session.request(method, url, params=params, json=json, headers=headers,
                                             timeout=self.config.request_timeout, allow_redirects=False)
            except (requests.ConnectionError, requests.Timeout) as e:
                # requests' exceptions carry the prepared request (and its header): never chain them
                problem = _Transient(f"{where}: {type(e).__name__}: {self._scrub(_short(e))}")
            else:
                status = resp.status_code
                if status == 404 and not_found_ok:
                    return None
                if status == 429 or status >= 500:
                    code, message = _error_of(resp)
                    problem = _Transient(self._scrub(f"{where}: HTTP {status}: {message}"), status=status, code=code,
                                         retry_after=_retry_after(resp.headers.get("Retry-After")))
                elif status >= 400:
                    code, message = _error_of(resp)
                    raise HotLoadAPIError(self._scrub(f"{where} failed: HTTP {status}: {message}"),
                                          status=status, code=code)
                else:
                    try:
                        body = resp.json()
                    except ValueError:
                        body = None
                    if not isinstance(body, dict):
                        raise HotLoadAPIError(f"{where}: the reply is not a JSON object (HTTP {status})",
                                              status=status)
                    return body
            if not retry:
                raise problem
            if attempt >= self.config.max_attempts:
                raise HotLoadAPIError(f"{problem} (gave up after {attempt} attempts)", status=problem.status,
                                      code=problem.code) from None
            self._backoff(attempt, problem.retry_after, None, str(problem))

    def _backoff(self, attempt: int, retry_after: float | None, deadline: float | None, why: str) -> None:
        delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** (attempt - 1))
        delay *= 0.5 + random.random() / 2  # jitter: several clients do not retry in step
        if retry_after is not None:
            delay = max(delay, retry_after)
        self._retries += 1
        log.warning("%s; retrying in %.1fs", why, delay)
        self._pause(delay, deadline)

    def _pause(self, seconds: float, deadline: float | None) -> None:
        if deadline is not None:
            seconds = max(0.0, min(seconds, deadline - self._clock()))
        if seconds > 0:
            self._sleep(seconds)

    def _check_spec(self, op: dict, identity: str, op_id: str) -> None:
        spec = _spec(op)
        got = (spec.get("identity"), spec.get("deploymentId"))
        if got != (identity, self.config.deployment_id):
            raise HotLoadAPIError(f"hot-load {op_id} is for identity {got[0]!r} on deployment {got[1]!r}, "
                                  f"expected {identity!r} on {self.config.deployment_id!r}")

    def _scrub(self, text: str) -> str:
        secret = self.config.token.get_secret_value()
        return text.replace(secret, "***") if secret else text


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


def _error_of(resp: requests.Response) -> tuple[int | None, str]:
    """(gRPC code, message) of an error reply, whatever its shape."""
    try:
        body = resp.json()
    except ValueError:
        return None, (resp.text or resp.reason or "").strip()[:300]
    if isinstance(body, dict):
        err = body.get("error") if isinstance(body.get("error"), dict) else body
        code = err.get("code")
        message = err.get("message") or err.get("detail") or ""
        return (code if isinstance(code, int) else None), str(message)[:500]
    return None, str(body)[:300]


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) < 300 else text[:300] + "..."


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
