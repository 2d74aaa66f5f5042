"""Kubernetes backend through the ``kubernetes`` client.

Submission order, so that nothing is orphaned: the Job is created **suspended** (no pods yet),
then the Service, the ConfigMap and the Secret of ``secrets:`` (values read from the submitting
environment first, so a missing one stops everything before any object exists) with
``ownerReferences`` to the Job's uid, then the Job is resumed: no pod starts before its Secret
exists. Deleting the Job (cancel, or ``ttlSecondsAfterFinished``) lets the garbage collector delete
the rest; if any step fails, the Job is deleted and takes the rest with it.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain import redact
from posttrain.cluster import job_secrets
from posttrain.cluster import k8s_manifests as m
from posttrain.cluster.config import KubernetesConfig
from posttrain.cluster.errors import JobFailed, SubmissionError
from posttrain.cluster.handle import DryRunHandle, HandleBase
from posttrain.cluster.spec import JobSpec, JobState

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
INDEX_ANNOTATION = INDEX_LABEL
# Pod waiting reasons that do not clear up by themselves.
STUCK_REASONS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
     "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff"}
)  # fmt: skip


def _api_exception() -> type[Exception]:
    from kubernetes.client.exceptions import ApiException

    return ApiException


def _status(e: Exception) -> int | None:
    return getattr(e, "status", None)


def _reason(e: Exception) -> str:
    return redact.scrub(f"{getattr(e, 'status', '')} {getattr(e, 'reason', '')}".strip() or str(e))


class KubernetesBackend:
    """Submits ``JobSpec`` commands as Indexed Jobs. ``apis`` (batch, core) is for tests."""

    def __init__(self, config: KubernetesConfig, apis: tuple[Any, Any] | None = None) -> None:
        self.config = config
        self._apis = apis

    def apis(self) -> tuple[Any, Any]:
        if self._apis is None:
            from kubernetes import client
            from kubernetes import config as kube_config

            cfg = self.config
            if cfg.kubeconfig is None and cfg.context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
                kube_config.load_incluster_config()
                api_client = client.ApiClient()
            else:
                path = os.path.expanduser(cfg.kubeconfig) if cfg.kubeconfig else None
                api_client = kube_config.new_client_from_config(config_file=path, context=cfg.context)
            self._apis = (client.BatchV1Api(api_client), client.CoreV1Api(api_client))
        return self._apis

    def manifests(self, spec: JobSpec) -> list[dict[str, Any]]:
        return m.manifests(self.config, spec)

    def render(self, spec: JobSpec) -> str:
        return m.render(self.config, spec)

    def submit(self, spec: JobSpec) -> KubernetesHandle | DryRunHandle:
        if self.config.dry_run:
            text = self.render(spec)
            print(text, end="")
            return DryRunHandle(text)
        objects = self.manifests(spec)
        values = job_secrets.read(self.config.secrets)
        job = m.by_kind(objects, "Job")
        name, ns = job["metadata"]["name"], self.config.namespace
        batch, core = self.apis()
        ApiException = _api_exception()

        suspended = copy.deepcopy(job)
        suspended["spec"]["suspend"] = True
        try:
            created = batch.create_namespaced_job(ns, suspended)
        except ApiException as e:
            if _status(e) == 409:
                raise SubmissionError(
                    f"a Job named {name} already exists in namespace {ns}; delete it "
                    f"(kubectl -n {ns} delete job {name}) or choose another job_name"
                ) from None
            raise SubmissionError(f"creating Job {ns}/{name} failed: {_reason(e)}") from None
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": created.metadata.uid}
        create = {"Service": "create_namespaced_service", "ConfigMap": "create_namespaced_config_map",
                  "Secret": "create_namespaced_secret"}
        step = "Service"
        try:
            for obj in objects:
                if obj["kind"] == "Job":
                    continue
                step = obj["kind"]
                body = copy.deepcopy(obj)
                body["metadata"]["ownerReferences"] = [owner]
                if step == "Secret":
                    body["stringData"] = {k: values[k] for k in body["stringData"]}
                getattr(core, create[step])(ns, body)
            step = "resuming the Job"
            batch.patch_namespaced_job(name, ns, {"spec": {"suspend": False}})
        except ApiException as e:
            # owner references make the garbage collector remove whatever was created
            try:
                batch.delete_namespaced_job(name, ns, propagation_policy="Background")
            except ApiException:
                pass
            raise SubmissionError(f"{step} of job {ns}/{name} failed ({_reason(e)}); the Job was deleted") from None
        return self.attach(name)

    def attach(self, name: str) -> KubernetesHandle:
        """A handle on a Job of this namespace submitted earlier, e.g. after a restart."""
        batch, core = self.apis()
        cfg = self.config
        return KubernetesHandle(
            batch, core, name, cfg.namespace, nodes=cfg.nodes, poll_s=cfg.poll_interval_s,
            stuck_after_s=cfg.stuck_timeout_s,
        )  # fmt: skip


def _index(pod: Any) -> int:
    meta = pod.metadata
    value = (meta.labels or {}).get(INDEX_LABEL) or (meta.annotations or {}).get(INDEX_ANNOTATION) or "0"
    return int(value)


def _pod_problem(pod: Any) -> tuple[str, str] | None:
    """("failed" or "stuck", why) for a pod that failed or cannot start, else None."""
    status = pod.status
    where = f"rank {_index(pod)} (pod {pod.metadata.name})"
    for cs in status.container_statuses or []:
        state = cs.state
        if state is not None and state.terminated is not None and state.terminated.exit_code:
            t = state.terminated
            message = f": {t.message.strip()}" if t.message else ""
            return "failed", f"{where}: {t.reason or 'Error'}, exit code {t.exit_code}{message}"
        if state is not None and state.waiting is not None and state.waiting.reason in STUCK_REASONS:
            w = state.waiting
            return "stuck", f"{where}: {w.reason}" + (f": {w.message}" if w.message else "")
    if status.phase == "Failed":
        return "failed", f"{where}: {status.reason or 'Failed'}" + (f": {status.message}" if status.message else "")
    return None


class KubernetesHandle(HandleBase):
    """A submitted Indexed Job: state from the Job's conditions, reasons and logs from its pods."""

    def __init__(
        self, batch: Any, core: Any, name: str, namespace: str, nodes: int, poll_s: float, stuck_after_s: float
    ) -> None:
        self.batch = batch
        self.core = core
        self.name = name
        self.namespace = namespace
        self.nodes = nodes
        self.poll_s = poll_s
        self.stuck_after_s = stuck_after_s
        self.job_id = f"{namespace}/{name}"
        self.log_path = (
            f"kubectl -n {namespace} logs -f --prefix --max-log-requests={max(5, nodes)} -l {m.JOB_LABEL}={name}"
        )
        self._cancelled = False

    def _read_job(self) -> Any | None:
        try:
            return self.batch.read_namespaced_job_status(self.name, self.namespace)
        except _api_exception() as e:
            if _status(e) == 404:
                return None
            raise

    def pods(self) -> list[Any]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{m.JOB_LABEL}={self.name}").items
        return sorted(pods, key=lambda p: (_index(p), p.metadata.creation_timestamp or 0))

    def raw_state(self) -> str:
        job = self._read_job()
        if job is None:
            return "Deleted"
        for c in job.status.conditions or []:
            if c.status == "True" and c.type in ("Complete", "Failed", "Suspended"):
                return c.type + (f"/{c.reason}" if c.reason else "")
        return f"active={job.status.active or 0} ready={job.status.ready or 0}"

    def state(self) -> JobState:
        job = self._read_job()
        if job is None:
            return JobState.CANCELLED if self._cancelled else JobState.UNKNOWN
        for c in job.status.conditions or []:
            if c.status != "True":
                continue
            if c.type == "Complete":
                return JobState.COMPLETED
            if c.type == "Failed":
                return JobState.TIMEOUT if c.reason == "DeadlineExceeded" else JobState.FAILED
        if self._cancelled:
            return JobState.CANCELLED
        if job.spec.suspend:
            return JobState.PENDING
        if job.status.ready or any(p.status.phase == "Running" for p in self.pods()):
            return JobState.RUNNING
        return JobState.PENDING

    def done(self) -> bool:
        return self.state().terminal

    def failure_reason(self) -> str | None:
        reasons = []
        job = self._read_job()
        if job is None:
            return "the Job was deleted" + (" (cancelled)" if self._cancelled else "")
        for c in job.status.conditions or []:
            if c.status == "True" and c.type == "Failed":
                reasons.append(f"Job failed: {c.reason or ''}" + (f": {c.message}" if c.message else ""))
        reasons += [p[1] for p in (_pod_problem(pod) for pod in self.pods()) if p]
        return "; ".join(reasons) or None

    def tail_log(self, n: int = 40, rank: int | None = None) -> str:
        parts = []
        for pod in self.pods():
            if rank is not None and _index(pod) != rank:
                continue
            try:
                text = self.core.read_namespaced_pod_log(
                    pod.metadata.name, self.namespace, container=m.CONTAINER, tail_lines=n
                )
            except _api_exception() as e:
                text = f"(no log yet: {_reason(e)})\n"
            parts.append(f"==> rank {_index(pod)} (pod {pod.metadata.name}) <==\n{text}")
        return "\n".join(parts)

    def follow_logs(self, write: Callable[[str], Any] = sys.stdout.write) -> LogFollower:
        """Stream every rank's log, each line prefixed ``[rank i]``, including replacement pods;
        returns a ``LogFollower`` to stop."""
        follower = LogFollower(self, write)
        follower.start()
        return follower

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self.batch.delete_namespaced_job(self.name, self.namespace, propagation_policy="Foreground")
        except _api_exception() as e:
            if _status(e) != 404:
                raise

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Like ``HandleBase.wait``, but raises ``JobFailed`` when a pod stays stuck (image pull,
        missing Secret) for ``stuck_after_s``: the Job itself would wait until its deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stuck_since: float | None = None
        while True:
            state = self.state()
            if state.terminal:
                return state
            problems = (_pod_problem(pod) for pod in self.pods())
            stuck = [p[1] for p in problems if p and p[0] == "stuck"]
            if stuck:
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since >= self.stuck_after_s:
                    raise JobFailed(self.job_id, "STUCK", "; ".join(stuck))
            else:
                stuck_since = None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {state.value} after {timeout_s:.0f} s")
            time.sleep(self.poll_s)


class LogFollower:
    """One thread per pod following its log; a watcher thread picks up new pods."""

    def __init__(self, handle: KubernetesHandle, write: Callable[[str], Any]) -> None:
        self.handle = handle
        self.write = write
        self._stop = threading.Event()
        self._followed: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        t = threading.Thread(target=self._discover, name="k8s-log-discover", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _discover(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in self.handle.pods():
                    name = pod.metadata.name
                    running = pod.status.phase in ("Running", "Succeeded", "Failed")
                    if running and name not in self._followed:
                        self._followed.add(name)
                        t = threading.Thread(target=self._follow, args=(name, _index(pod)), daemon=True)
                        t.start()
                        self._threads.append(t)
            except Exception as e:  # the API may blip; keep following
                self._emit(f"[posttrain] listing pods failed: {e}\n")
            self._stop.wait(self.handle.poll_s)

    def _follow(self, pod: str, rank: int) -> None:
        h = self.handle
        try:
            resp = h.core.read_namespaced_pod_log(
                pod, h.namespace, container=m.CONTAINER, follow=True, _preload_content=False
            )
            buffer = b""
            for chunk in resp.stream():
                if self._stop.is_set():
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._emit(f"[rank {rank}] {line.decode(errors='replace')}\n")
            if buffer:
                self._emit(f"[rank {rank}] {buffer.decode(errors='replace')}\n")
        except Exception as e:
            self._emit(f"[rank {rank}] (log stream of pod {pod} ended: {e})\n")

    def _emit(self, text: str) -> None:
        with self._lock:
            self.write(text)
