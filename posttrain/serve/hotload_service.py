"""The hot-load operations of the reference server (docs/hotload-api.md), without HTTP.

One hot-load at a time: a create while one is unfinished fails with FAILED_PRECONDITION. A
load downloads what the identity needs, reconstructs it beside the served weights, loads it
and swaps the model; anything that goes wrong leaves the old weights serving and the
operation FAILED with the reason in its conditions. The status also reports the seconds
of each stage (``stageSeconds``: fetch, apply, load; the swap is part of load), an addition of posttrain's own.
With ``metrics``, every finished load is counted by outcome and reason, and the seconds of its finer
stages (``stages``: fetch, apply, validate, switch, probe; the engine marks the last three) observed.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain import redact
from posttrain.chain.errors import ChainError
from posttrain.chain.fetch import SnapshotError, SnapshotSource
from posttrain.inference.protocol import (
    CACHE_POLICIES,
    CACHE_PRESERVE,
    GRPC_ALREADY_EXISTS,
    GRPC_FAILED_PRECONDITION,
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_UNIMPLEMENTED,
    REPLICA_ERROR,
    REPLICA_LOADING,
    REPLICA_READY,
    SNAPSHOT_TYPES,
    STATE_COMPLETED,
    STATE_FAILED,
    STATE_RUNNING,
    TERMINAL_STATES,
    TYPE_FULL,
    TYPE_INCREMENTAL,
)
from posttrain.serve.engine import Engine
from posttrain.serve.faults import FaultBox
from posttrain.serve.operations import (
    Operation,
    Replica,
    ServiceError,
    check_id,
    condition,
    incremental_metadata,
    page,
)
from posttrain.serve.stages import StageTimes, stage, timing_stages
from posttrain.serve.state import ServerState, folder_name, load_state, save_state, verify_held

if TYPE_CHECKING:
    from posttrain.serve.metrics import ServeMetrics

log = redact.logger(__name__)  # every record scrubbed (S3 credentials, URL userinfo)

CREATE_FIELDS = {"deploymentId", "identity", "type", "promptCachePolicy", "hotLoadId", "incrementalSnapshotMetadata"}


class InjectedFault(Exception):
    """A failure armed through the server's test hooks."""


class HotLoadService:
    def __init__(
        self,
        *,
        deployment_id: str,
        source: SnapshotSource,
        engine: Engine,
        work_dir: Path,
        faults: FaultBox | None = None,
        boot_dir: Path | None = None,
        metrics: ServeMetrics | None = None,
    ):
        self.deployment_id = deployment_id
        self.source = source
        self.engine = engine
        self.work_dir = work_dir
        self.faults = faults or FaultBox()
        self.boot_dir = boot_dir
        self.metrics = metrics
        self.creates: Counter[str] = Counter()  # accepted creates per identity (test hooks report it)
        self._lock = threading.Lock()
        self._ops: dict[str, Operation] = {}
        self._seq = 0
        self._threads: list[threading.Thread] = []
        self._times: dict[str, StageTimes] = {}  # the stage seconds of the loads running, by operation id
        self.resumed = self._resume()  # the version a restart reloaded; None: booted clean
        identity = engine.current().identity
        self._replicas = [Replica(name, "local-a", REPLICA_READY, identity) for name in engine.replica_names]

    # ------------------------------------------------------------------ API
    def create(self, body: dict) -> Operation:
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:
            raise ServiceError(GRPC_INVALID_ARGUMENT, f"unknown field {unknown[0]!r} in the create request")
        deployment = body.get("deploymentId")
        if not deployment:
            raise ServiceError(GRPC_INVALID_ARGUMENT, "deploymentId is required")
        if deployment != self.deployment_id:
            raise ServiceError(GRPC_NOT_FOUND, f"deployment {deployment!r} not found")
        identity = check_id(body.get("identity"), "identity")
        kind = body.get("type")
        if kind not in SNAPSHOT_TYPES:
            raise ServiceError(GRPC_INVALID_ARGUMENT, f"type must be one of {', '.join(SNAPSHOT_TYPES)}, got {kind!r}")
        policy = body.get("promptCachePolicy") or CACHE_PRESERVE
        if policy not in CACHE_POLICIES:
            raise ServiceError(GRPC_INVALID_ARGUMENT, f"promptCachePolicy must be one of {', '.join(CACHE_POLICIES)}")
        incremental = incremental_metadata(kind, body.get("incrementalSnapshotMetadata"))
        op_id = body.get("hotLoadId") or str(uuid.uuid4())
        check_id(op_id, "hotLoadId")
        with self._lock:
            if op_id in self._ops:
                raise ServiceError(GRPC_ALREADY_EXISTS, f"hot-load {op_id} already exists")
            busy = [o for o in self._ops.values() if o.deployment_id == deployment and o.state not in TERMINAL_STATES]
            if busy:
                raise ServiceError(GRPC_FAILED_PRECONDITION,
                                   f"deployment {deployment} has an unfinished hot-load {busy[0].id} "
                                   f"({busy[0].state}); one hot-load at a time")
            self._seq += 1
            op = Operation(op_id, self._seq, deployment, identity, kind, policy, incremental, time.time())
            self._ops[op_id] = op
            self.creates[identity] += 1
            thread = threading.Thread(target=self._run, args=(op,), name=f"hotload-{op_id[:8]}", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        log.info("hot-load %s created: %s %s", op_id, kind, identity)
        self._save()
        thread.start()
        return op

    def get(self, op_id: str) -> Operation:
        with self._lock:
            op = self._ops.get(op_id)
        if op is None:
            raise ServiceError(GRPC_NOT_FOUND, f"hot-load {op_id} not found")
        return op

    def list(self, parent: str | None, page_size: int | None, page_token: str | None) -> tuple[list[Operation], str]:
        with self._lock:
            ops = sorted(self._ops.values(), key=lambda o: -o.seq)  # newest first
        if parent:
            ops = [o for o in ops if o.deployment_id == parent]
        return page(ops, ("list", parent or ""), page_size, page_token)

    def replicas(self, op_id: str, page_size: int | None, page_token: str | None) -> tuple[list[Replica], str]:
        self.get(op_id)
        return page(self.replica_states(), ("replicas", op_id), page_size, page_token)

    def replica_states(self) -> list[Replica]:
        """Each replica's state and version now, as the API reports them (copies; sorted by zone, name)."""
        broken = self.engine.replica_errors()  # an engine that died since: ERROR until it serves again
        with self._lock:
            reps = [Replica(**vars(r)) for r in self._replicas]
        for r in reps:
            if r.name in broken:
                r.state, r.error_reason = REPLICA_ERROR, broken[r.name]
        reps.sort(key=lambda r: (r.zone, r.name))
        return reps

    def cancel(self, op_id: str) -> None:
        self.get(op_id)
        raise ServiceError(GRPC_UNIMPLEMENTED, "CancelHotLoad is not implemented; wait for the hot-load to reach a "
                                               "terminal state, then create a new one")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running hot-loads (at shutdown, and in tests)."""
        for t in list(self._threads):
            t.join(timeout)

    # ------------------------------------------------------------------ restarts
    def _resume(self) -> str | None:
        """Serve the version recorded in the work dir, keep the operations recorded there, and
        remove what killed runs left (rebuilt folders not served, views)."""
        views, models = self.work_dir / "views", self.work_dir / "models"
        shutil.rmtree(views, ignore_errors=True)
        views.mkdir(parents=True, exist_ok=True)
        models.mkdir(parents=True, exist_ok=True)
        state = load_state(self.work_dir) or ServerState()
        for op in state.operations:
            if op.state not in TERMINAL_STATES:  # cut short by the restart; the weights it had were kept
                op.conditions.append(condition("ServerRestarted", "the server restarted before this hot-load "
                                                                  "finished"))
                op.state, op.finished_at = STATE_FAILED, op.finished_at or time.time()
        self._ops = {op.id: op for op in state.operations}
        self._seq = max((op.seq for op in state.operations), default=0)
        resumed, why = None, "was not resumed"
        self._unresumed: tuple[str, str] | None = None  # a recorded version kept for the next start
        if state.identity is not None and state.folder is not None:
            folder = models / state.folder
            try:
                verify_held(folder)
            except (OSError, ChainError) as e:  # damaged or gone: it can never be served again
                why = "failed its checks and was removed"
                log.warning("could not resume %s: its rebuilt folder %s fails its checks (%s); removing it",
                            state.identity, folder, e)
            else:
                try:
                    self.engine.resume(folder, state.identity)
                    resumed = state.identity
                    log.info("resumed: serving %s from %s, as before the restart", state.identity, folder)
                except Exception as e:  # noqa: BLE001 - kept, with its record, for the next start
                    self._unresumed, why = (state.identity, state.folder), "failed to load; kept for the next start"
                    log.warning("could not resume %s from %s (%s: %s); keeping it and its record for the next "
                                "start", state.identity, folder, type(e).__name__, e)
        recorded = f"{state.identity} is recorded in {self.work_dir} but {why}" if state.identity else None
        self.clean_boot = None if resumed else recorded or f"no earlier version recorded in {self.work_dir}"
        if self.clean_boot:  # booted clean, and why: in the log and in serve's start message
            log.info("booted clean: serving the boot weights %s (%s)", self.boot_dir or "", self.clean_boot)
        current = self.engine.current()
        held = {p.resolve() for p in (current.path, current.base) if p is not None}
        if self._unresumed is not None:
            held.add((models / self._unresumed[1]).resolve())
        for leftover in models.iterdir():
            if leftover.resolve() not in held:
                log.info("removing %s, a rebuilt version no longer served", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        self._save()
        return resumed

    def _save(self) -> None:
        """Record the version served and the operations in the work dir (atomically)."""
        served = self.engine.current()
        models = (self.work_dir / "models").resolve()
        in_models = served.identity is not None and served.path.resolve().parent == models
        identity, folder = (served.identity, served.path.name) if in_models else (None, None)
        if identity is None and self._unresumed is not None:  # still the boot weights: keep what to resume
            identity, folder = self._unresumed
        with self._lock:
            ops = copy.deepcopy(list(self._ops.values()))
        try:
            save_state(self.work_dir, ServerState(identity, folder, ops))
        except OSError as e:
            log.warning("cannot record the server's state in %s: %s", self.work_dir, e)

    # ------------------------------------------------------------------ the load
    def _set(self, op: Operation, state: str) -> None:
        if state in TERMINAL_STATES:
            self._count(op, state)
        with self._lock:
            op.state = state
            if state in TERMINAL_STATES:
                op.finished_at = time.time()
        self._save()

    def _set_replicas(self, state: str, identity: str | None, error: str = "", only_first: bool = False) -> None:
        with self._lock:
            for i, r in enumerate(self._replicas):
                if only_first and i > 0:
                    r.state, r.identity, r.error_reason = REPLICA_READY, identity, ""
                else:
                    r.state, r.identity, r.error_reason = state, identity, error

    def _run(self, op: Operation) -> None:
        with timing_stages() as times:
            self._times[op.id] = times
            try:
                self._load(op)
            finally:
                self._times.pop(op.id, None)

    def _count(self, op: Operation, state: str) -> None:
        """Count a load finishing in ``state`` (before its state says so: whoever sees it finished finds it
        counted)."""
        times = self._times.pop(op.id, None)
        if self.metrics is None or times is None:
            return
        completed = state == STATE_COMPLETED
        with self._lock:
            reason = op.conditions[-1]["reason"] if op.conditions and not completed else ""
        try:
            self.metrics.hotload_finished(completed, reason or "Unknown", dict(times.seconds))
        except Exception:  # noqa: BLE001 - the figures never break a load
            log.exception("hot-load %s: recording its metrics failed", op.id)

    def _load(self, op: Operation) -> None:
        t0 = time.perf_counter()
        before = self.engine.current()
        self._set(op, STATE_RUNNING)
        self._set_replicas(REPLICA_LOADING, before.identity)
        delay = self.faults.take("delay_hotload")
        if delay is not None and delay.after_fetched == 0:
            time.sleep(delay.seconds)
        view = self.work_dir / "views" / op.id
        out: Path | None = None
        fetched: list[str] = []
        try:
            out = self._new_folder(op)
            fault = self.faults.take("fail_hotload", snapshot_type=op.type)
            if fault is not None:
                raise InjectedFault(fault.reason)
            broken = self.faults.take("replica_error")
            if broken is not None:
                with self._lock:
                    op.conditions.append(condition("ReplicaError", broken.reason))
                self._set(op, STATE_COMPLETED)
                self._set_replicas(REPLICA_ERROR, before.identity, broken.reason, only_first=True)
                log.warning("hot-load %s: replica-0 in ERROR (injected)", op.id)
                return
            if op.identity != before.identity:
                self._check_type(op, *self.source.describe(op.identity))
            plan = self.source.plan(op.identity, before.identity)
            with self._lock:
                op.snapshot_chain = list(plan.snapshots)
            if not plan.snapshots:  # it serves this identity already: every replica is checked to hold it
                self.engine.verify()
                self._finish(op, before.identity, t0)
                return
            fetched = list(plan.snapshots)
            t = time.perf_counter()
            with stage("fetch"):
                for n, identity in enumerate(plan.snapshots, start=1):
                    self.source.fetch(identity)
                    if delay is not None and n == min(delay.after_fetched, len(plan.snapshots)):
                        time.sleep(delay.seconds)
            t = self._stage(op, "fetch", t)
            with stage("apply"):  # checksums are checked as the files are decoded: part of apply
                self.source.view(plan, before.identity, before.path, view)
                from posttrain.chain.ops import reconstruct

                # Not fsynced: a restart serves a rebuilt folder again only once every tensor of it
                # passes its checksums (verify_held), so a folder a power cut tore is never served;
                # waiting for the disk here would only delay the switch. A full snapshot's files move
                # from the download cache, which is dropped after the load (``forget``), checked first.
                reconstruct(view, op.identity, out, held_dir=before.path if plan.start == "held" else None,
                            durable=False, take_full=True)
            t = self._stage(op, "apply", t)
            now = self.engine.load(out, op.identity)
            if self._unresumed is not None:  # a version served now: the one a restart could not resume goes
                self._unresumed, dropped = None, self.work_dir / "models" / self._unresumed[1]
                if dropped.resolve() != now.path.resolve():
                    self._discard(dropped)
            self._save()  # recorded before the previous folder goes: a restart always finds what it names
            for folder in {before.path, before.base} - {now.path, now.base, None}:  # an adapter's base stays
                self._discard(folder)
            self._stage(op, "load", t)
            self.source.forget(fetched)  # the served folder holds this version now: keep the cache empty
            self._finish(op, op.identity, t0)
        except Exception as e:  # noqa: BLE001 - every failure becomes the operation's condition
            reason = type(e).__name__
            # logged before the state changes: whoever sees FAILED finds the reason in the log
            log.warning("hot-load %s of %s FAILED (%s: %s); still serving %s", op.id, op.identity, reason, e,
                        before.identity or "the boot weights")
            with self._lock:
                op.conditions.append(condition(reason, str(e)))
            self._set_replicas(REPLICA_READY, before.identity)  # before FAILED, as _finish: then read READY
            self._set(op, STATE_FAILED)
            if out is not None and out.exists():
                shutil.rmtree(out, ignore_errors=True)
            if not isinstance(e, InjectedFault):
                self.source.forget(fetched)
        finally:
            shutil.rmtree(view, ignore_errors=True)

    def _new_folder(self, op: Operation) -> Path:
        """Where to rebuild ``op``'s version: never the folder served, and empty (a run killed
        mid-rebuild may have left the same name behind)."""
        out = self.work_dir / "models" / f"{folder_name(op.identity)}-{op.id[:12]}"
        if out.resolve() == self.engine.current().path.resolve():
            out = out.with_name(f"{out.name}-{uuid.uuid4().hex[:8]}")
        if out.exists():
            shutil.rmtree(out)
        return out

    def _stage(self, op: Operation, name: str, since: float) -> float:
        """Record a stage's seconds in the operation's status (``stageSeconds``); returns now."""
        now = time.perf_counter()
        with self._lock:
            op.stage_seconds[name] = round(now - since, 6)
        return now

    def _check_type(self, op: Operation, kind: str, base: str | None) -> None:
        if op.type == TYPE_FULL and kind != "full":
            raise SnapshotError(f"{op.identity} is a delta snapshot (against {base}); load it as "
                                f"{TYPE_INCREMENTAL}")
        if op.type == TYPE_INCREMENTAL:
            if kind != "delta":
                raise SnapshotError(f"{op.identity} is a full snapshot; load it as {TYPE_FULL}")
            previous = (op.incremental or {}).get("previousSnapshotIdentity")
            if base != previous:
                raise SnapshotError(f"{op.identity} is a delta against {base}, not against {previous} "
                                    "(previousSnapshotIdentity)")

    def _finish(self, op: Operation, identity: str | None, t0: float) -> None:
        self._set_replicas(REPLICA_READY, identity)
        self._set(op, STATE_COMPLETED)
        log.info("hot-load %s COMPLETED: serving %s (%.2fs)", op.id, identity, time.perf_counter() - t0)

    def _discard(self, path: Path) -> None:
        """Remove a reconstruction that is no longer served (never the boot weights)."""
        models = (self.work_dir / "models").resolve()
        if path.resolve().parent == models and path.resolve() != (self.boot_dir or Path("/")).resolve():
            shutil.rmtree(path, ignore_errors=True)
