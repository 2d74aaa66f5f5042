"""``/metrics`` of ``posttrain serve`` (reference server and the vLLM/SGLang gateways), for Prometheus.

One ``CollectorRegistry`` per server (never the process-wide one), so servers in one process keep
their figures apart. Counters and histograms are updated as hot-loads finish and requests are
answered; the replica and version series are read at scrape time from what the server reports
(the hot-load service's replica records, the engine's served version), never kept separately.
Every metric, its labels and the code each stage covers: docs/metrics.md.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from posttrain import redact
from posttrain.inference.protocol import REPLICA_ERROR, REPLICA_LOADING, REPLICA_READY
from posttrain.serve.completions import RequestError
from posttrain.serve.stages import STAGES

if TYPE_CHECKING:
    from posttrain.serve.engine import Engine
    from posttrain.serve.operations import Replica
    from posttrain.storage import Store

log = redact.logger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
REPLICA_STATES = (REPLICA_READY, REPLICA_LOADING, REPLICA_ERROR)
STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Every series below exists from the start, at 0: Prometheus's increase() and rate() see a series' first
# sample as its start, not as an increase, so a failure whose series appeared at 1 would count 0 on the
# dashboard. The reasons a hot-load fails with by design (its condition reason: the error's class; the
# chain's, the store's, the engine's errors, an injected fault; "Unknown" when it names none), and the
# statuses the server answers a completions request with itself (an engine's own 4xx passes through as
# is and gets its series when first answered; the dashboard counts a series' first sample too).
HOTLOAD_FAILURE_REASONS = (
    "SnapshotError", "ChainError", "FormatError", "MissingBase", "WrongBase", "LayoutMismatch", "ChecksumMismatch",
    "StorageError", "NotFound", "EngineError", "EngineCallError", "EngineUnavailable", "EngineAdapterError",
    "InjectedFault", "Unknown",
)
COMPLETION_STATUSES = ("200", "400", "404", "408", "413", "500", "501", "502", "503")
LEDGER_RUNS = ".posttrain/runs/"
LOOKUP_RETRY_S = 60.0  # a publish time that could not be read is asked for again after this
_STEP_RE = re.compile(r"^step-(\d+)-")
_SLIME_RE = re.compile(r"^weight_v(\d+)$")


class ReplicaSource(Protocol):
    """What the replica series are read from at scrape time: the hot-load service. A protocol, so
    that the service, which reports its hot-loads here, is imported by this module neither way."""

    def replica_states(self) -> list[Replica]: ...


def policy_version(identity: str | None) -> str:
    """The training step an identity names (``step-<N>-...``; slime's ``weight_v<N>``), else ""."""
    if not identity:
        return ""
    m = _STEP_RE.match(identity) or _SLIME_RE.match(identity)
    return str(int(m.group(1))) if m else ""


class PublishTimes:
    """When each version was published: ``published_at`` of its ledger entry in the store
    (``<prefix>/.posttrain/runs/<run>/ledger/<identity>.json``, written by ``posttrain publish`` and
    the publishing flows). None for a version with no ledger entry (a chain written without the
    publisher, the boot weights). Read once per version."""

    def __init__(self, store: Store, prefix: str):
        self.store = store
        self.prefix = prefix.strip("/")
        self._known: dict[str, float | None] = {}
        self._failed: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, identity: str | None) -> float | None:
        if identity is None:
            return None
        with self._lock:
            if identity in self._known:
                return self._known[identity]
            if time.monotonic() - self._failed.get(identity, -LOOKUP_RETRY_S) < LOOKUP_RETRY_S:
                return None
        try:
            found = self._lookup(identity)
        except Exception as e:  # noqa: BLE001 - a scrape never fails on the store; the series is left out
            log.warning("publish time of %s: cannot read the ledger (%s: %s)", identity, type(e).__name__, e)
            with self._lock:
                self._failed[identity] = time.monotonic()
            return None
        with self._lock:
            self._known[identity] = found
        return found

    def _lookup(self, identity: str) -> float | None:
        from posttrain.publish.ledger import LedgerEntry

        runs = f"{self.prefix}/{LEDGER_RUNS}" if self.prefix else LEDGER_RUNS
        tail = f"/ledger/{identity}.json"
        for key in self.store.list(runs):
            if key.endswith(tail) and key.count("/") == runs.count("/") + 2:
                data, _ = self.store.get_bytes(key)
                return LedgerEntry.model_validate_json(data).published_at
        return None


class ServeMetrics:
    """The figures of one server, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.hotloads = Counter("posttrain_hotloads", "Hot-loads that finished, by outcome (completed, failed) "
                                "and failure reason (the operation's condition reason; empty when completed).",
                                ["outcome", "reason"], registry=r)
        self.stage_seconds = Histogram("posttrain_hotload_stage_seconds", "Seconds a hot-load spent in each stage "
                                       "it reached (fetch, apply, validate, switch, probe), one observation per "
                                       "hot-load and stage.", ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.requests = Counter("posttrain_completions_requests", "POST /v1/completions requests answered, by "
                                "HTTP status.", ["status"], registry=r)
        self.completion_tokens = Counter("posttrain_completion_tokens", "Tokens generated (usage.completion_tokens "
                                         "of the answered requests).", registry=r)
        self.prompt_tokens = Counter("posttrain_prompt_tokens", "Prompt tokens of the answered requests "
                                     "(usage.prompt_tokens).", registry=r)
        self.latency = Histogram("posttrain_completions_latency_seconds", "Seconds from reading a completions "
                                 "request to its answer (every status).", buckets=LATENCY_BUCKETS, registry=r)
        for name in STAGES:  # every stage's series exists from the start, at 0
            self.stage_seconds.labels(stage=name)
        self.hotloads.labels(outcome="completed", reason="")
        for reason in HOTLOAD_FAILURE_REASONS:
            self.hotloads.labels(outcome="failed", reason=reason)
        for status in COMPLETION_STATUSES:
            self.requests.labels(status=status)

    def watch(self, service: ReplicaSource, engine: Engine, publish_times: PublishTimes | None) -> None:
        """Read the replica and version series from ``service`` and ``engine`` at every scrape."""
        self.registry.register(_ServedCollector(service, engine, publish_times))

    # ------------------------------------------------------------------ events
    def hotload_finished(self, completed: bool, reason: str, stage_seconds: dict[str, float]) -> None:
        self.hotloads.labels(outcome="completed" if completed else "failed", reason="" if completed else reason).inc()
        for name, seconds in stage_seconds.items():
            self.stage_seconds.labels(stage=name).observe(seconds)

    @contextmanager
    def completion(self) -> Iterator[_Completion]:
        """Count the completions request the block answers (``.reply``: the answer), or its error's status."""
        counted, t0, status = _Completion(), time.perf_counter(), 500
        try:
            yield counted
            status = 200
        except RequestError as e:
            status = e.status
            raise
        finally:
            self.completed(status, time.perf_counter() - t0, counted.reply)

    def completed(self, status: int, seconds: float, reply: dict | None) -> None:
        self.requests.labels(status=str(status)).inc()
        self.latency.observe(seconds)
        usage = reply.get("usage") if isinstance(reply, dict) else None
        if isinstance(usage, dict):
            for counter, key in ((self.prompt_tokens, "prompt_tokens"), (self.completion_tokens, "completion_tokens")):
                value = usage.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    counter.inc(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Completion:
    reply: dict | None = None


class _ServedCollector:
    """Replica and version series, read from the server at scrape time."""

    def __init__(self, service: ReplicaSource, engine: Engine, publish_times: PublishTimes | None):
        self.service, self.engine, self.publish_times = service, engine, publish_times

    def describe(self) -> list:
        return []  # collected at scrape time only (the registry does not call collect() to describe it)

    def collect(self):  # noqa: ANN201 - metric families
        info = GaugeMetricFamily("posttrain_replica_snapshot_info", "The version each replica serves now (1; "
                                 "the replica's earlier versions have no series): its snapshot identity (empty: "
                                 "boot weights that name none) and policy version (the identity's training step, "
                                 "empty when it names none).", labels=["replica", "identity", "policy_version"])
        state = GaugeMetricFamily("posttrain_replica_state", "1 for the state each replica is in (READY, LOADING, "
                                  "ERROR), 0 for the others, as the hot-load API reports it.",
                                  labels=["replica", "state"])
        for r in self.service.replica_states():
            info.add_metric([r.name, r.identity or "", policy_version(r.identity)], 1)
            for s in REPLICA_STATES:
                state.add_metric([r.name, s], 1 if r.state == s else 0)
        yield info
        yield state
        served = self.engine.current().identity
        published = self.publish_times.get(served) if self.publish_times is not None else None
        if published is not None:
            age = GaugeMetricFamily("posttrain_served_snapshot_age_seconds", "Seconds since the version served "
                                    "was published (its ledger entry's published_at); absent when the store "
                                    "records no publish time for it.")
            age.add_metric([], max(0.0, time.time() - published))
            yield age
