"""The records of the hot-load API: operations, replicas, and paging through them."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from posttrain import redact
from posttrain.chain.errors import FormatError
from posttrain.chain.format import check_identity
from posttrain.inference.protocol import (
    CHECKSUM_ADLER32,
    COMPRESSION_ZSTD,
    DEFAULT_PAGE_SIZE,
    GRPC_INVALID_ARGUMENT,
    MAX_PAGE_SIZE,
    STATE_PENDING,
    TYPE_FULL,
)

INCREMENTAL_FIELDS = {"previousSnapshotIdentity", "compressionFormat", "checksumFormat"}


class ServiceError(Exception):
    """A call the service refuses: a gRPC status code and a message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Operation:
    id: str
    seq: int
    deployment_id: str
    identity: str
    type: str
    prompt_cache_policy: str
    incremental: dict | None
    created_at: float
    state: str = STATE_PENDING
    conditions: list[dict] = field(default_factory=list)
    snapshot_chain: list[str] = field(default_factory=list)
    finished_at: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # fetch, apply, load (the swap is part of load; posttrain's own)

    def to_json(self) -> dict:
        spec: dict = {"id": self.id, "deploymentId": self.deployment_id, "identity": self.identity,
                      "type": self.type, "promptCachePolicy": self.prompt_cache_policy}
        if self.incremental is not None:
            spec["incrementalSnapshotMetadata"] = dict(self.incremental)
        status = {"state": self.state, "conditions": [dict(c) for c in self.conditions],
                  "snapshotChain": [{"identity": s} for s in self.snapshot_chain],
                  "createdAt": rfc3339(self.created_at), "finishedAt": rfc3339(self.finished_at),
                  "stageSeconds": dict(self.stage_seconds)}
        return {"spec": spec, "status": status}


@dataclass
class Replica:
    name: str
    zone: str
    state: str
    identity: str | None
    error_reason: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "zone": self.zone, "state": self.state,
                "currentSnapshotIdentity": self.identity or "", "errorReason": self.error_reason}


def condition(reason: str, message: str) -> dict:
    """A condition of an operation, as the API returns it: its message scrubbed of secrets."""
    return {"type": "Failed" if reason != "ReplicaError" else "ReplicaError", "status": "True",
            "reason": reason, "message": redact.scrub(message), "lastTransitionTime": rfc3339(time.time())}


def page(items: list, scope: tuple[str, str], page_size: int | None, token: str | None) -> tuple[list, str]:
    """One page and the token of the next ('' at the end); a token only works in its own scope."""
    if page_size is not None and page_size < 0:
        raise ServiceError(GRPC_INVALID_ARGUMENT, "maxPageSize must not be negative")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    offset = 0
    if token:
        try:
            data = json.loads(base64.urlsafe_b64decode(token.encode() + b"=" * (-len(token) % 4)))
            offset = int(data["o"])
            ok = [data["k"], data["s"]] == list(scope) and offset >= 0
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # 1e999, nested too deep
            ok = False
        if not ok:
            raise ServiceError(GRPC_INVALID_ARGUMENT, "invalid pageToken (keep the same filter across a walk)")
    page = items[offset:offset + size]
    if offset + size >= len(items):
        return page, ""
    raw = json.dumps({"k": scope[0], "s": scope[1], "o": offset + size}).encode()
    return page, base64.urlsafe_b64encode(raw).decode().rstrip("=")


def incremental_metadata(kind: str, meta: object) -> dict | None:
    """A create request's ``incrementalSnapshotMetadata``, checked against its ``type``."""
    if kind == TYPE_FULL:
        if meta not in (None, {}):
            raise ServiceError(GRPC_INVALID_ARGUMENT,
                               "incrementalSnapshotMetadata is for SNAPSHOT_TYPE_INCREMENTAL")
        return None
    if not isinstance(meta, dict):
        raise ServiceError(GRPC_INVALID_ARGUMENT, "SNAPSHOT_TYPE_INCREMENTAL needs incrementalSnapshotMetadata")
    unknown = sorted(set(meta) - INCREMENTAL_FIELDS)
    if unknown:
        raise ServiceError(GRPC_INVALID_ARGUMENT, f"unknown field incrementalSnapshotMetadata.{unknown[0]}")
    check_id(meta.get("previousSnapshotIdentity"), "incrementalSnapshotMetadata.previousSnapshotIdentity")
    if meta.get("compressionFormat", COMPRESSION_ZSTD) != COMPRESSION_ZSTD:
        raise ServiceError(GRPC_INVALID_ARGUMENT, f"compressionFormat must be {COMPRESSION_ZSTD}")
    if meta.get("checksumFormat", CHECKSUM_ADLER32) != CHECKSUM_ADLER32:
        raise ServiceError(GRPC_INVALID_ARGUMENT, f"checksumFormat must be {CHECKSUM_ADLER32}")
    return dict(meta)


def check_id(value: object, what: str) -> str:
    try:
        return check_identity(value, what)  # type: ignore[arg-type]
    except FormatError as e:
        raise ServiceError(GRPC_INVALID_ARGUMENT, str(e)) from None
