"""Fixtures of the cluster-backend and training-run tests: golden files, a guard that fails any contact with the
outside (subprocess, sockets), a fake Kubernetes API, and a real single-node Slurm."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "cluster" / "golden"
UPDATE_ENV = "POSTTRAIN_UPDATE_GOLDEN"


@pytest.fixture
def golden():
    """``golden(name, text)``: compare with tests/cluster/golden/<name>; with
    POSTTRAIN_UPDATE_GOLDEN=1 the file is rewritten instead."""

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if os.environ.get(UPDATE_ENV) == "1":
            path.write_text(text)
            return
        assert path.exists(), f"{path} missing; run with {UPDATE_ENV}=1 to create it"
        assert text == path.read_text(), f"{name} changed; if intended, regenerate with {UPDATE_ENV}=1"

    return check


@pytest.fixture
def no_contact(monkeypatch):
    """Fail the test on any process start or network connection."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"contacted the outside: {args[:2]!r}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ---------------------------------------------------------------- fake Kubernetes API


class FakeKube:
    """Records calls of the BatchV1Api/CoreV1Api methods the backend uses; state is set by tests."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail: dict[str, Exception] = {}
        self.job_status: Any = None
        self.pods: list[Any] = []
        self.logs: dict[str, str] = {}
        self.batch = SimpleNamespace(
            create_namespaced_job=self._rec("create_namespaced_job", self._created_job),
            patch_namespaced_job=self._rec("patch_namespaced_job"),
            delete_namespaced_job=self._rec("delete_namespaced_job"),
            read_namespaced_job_status=self._rec("read_namespaced_job_status", lambda *a, **k: self._job()),
        )
        self.core = SimpleNamespace(
            create_namespaced_service=self._rec("create_namespaced_service"),
            create_namespaced_config_map=self._rec("create_namespaced_config_map"),
            create_namespaced_secret=self._rec("create_namespaced_secret"),
            list_namespaced_pod=self._rec("list_namespaced_pod", lambda *a, **k: SimpleNamespace(items=self.pods)),
            read_namespaced_pod_log=self._rec("read_namespaced_pod_log", self._log),
        )

    def _rec(self, name: str, result=None):
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name in self.fail:
                raise self.fail[name]
            return result(*args, **kwargs) if result else None

        return call

    def _log(self, name: str, namespace: str, **kwargs: Any) -> Any:
        text = self.logs[name]
        if kwargs.get("follow"):  # a streaming response: chunks that split lines anywhere
            data = text.encode()
            return SimpleNamespace(stream=lambda: iter([data[:3], data[3:]]))
        return text

    def _created_job(self, namespace: str, body: dict) -> Any:
        from kubernetes.client import V1Job, V1ObjectMeta

        return V1Job(metadata=V1ObjectMeta(name=body["metadata"]["name"], namespace=namespace, uid="uid-1234"))

    def _job(self) -> Any:
        from kubernetes.client import V1Job, V1JobSpec, V1JobStatus, V1PodTemplateSpec

        if isinstance(self.job_status, Exception):
            raise self.job_status
        status = self.job_status or V1JobStatus()
        return V1Job(spec=V1JobSpec(template=V1PodTemplateSpec(), suspend=False), status=status)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def fake_kube() -> FakeKube:
    return FakeKube()


# ---------------------------------------------------------------- real Slurm


def _sinfo_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """A running Slurm: the one `sinfo` answers, or one started with scripts/services/start-slurm.sh."""
    if _sinfo_answers():
        return
    if os.geteuid() != 0:
        pytest.skip("no Slurm answers and starting one needs root")
    t0 = time.monotonic()
    for _attempt in range(2):  # a daemon coming up slowly can fail one start; the script is idempotent
        result = subprocess.run(
            ["bash", str(REPO / "scripts/services/start-slurm.sh")], capture_output=True, text=True, timeout=900
        )
        if result.returncode == 0:
            break
    if result.returncode != 0:
        pytest.fail(f"start-slurm.sh failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    print(f"started Slurm in {time.monotonic() - t0:.1f} s", file=sys.stderr)


def _default_partition_nodes() -> int:
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%D"], capture_output=True, text=True, timeout=20).stdout
    return sum(int(n) for p, _, n in (line.partition("|") for line in out.split()) if p.endswith("*"))


@pytest.fixture(scope="session")
def slurm_cluster_2nodes(slurm_cluster) -> None:
    """A running Slurm whose default partition has at least two nodes (start-slurm.sh starts two,
    POSTTRAIN_SLURM_NODES): one slurmd per node name on this host, all at 127.0.0.1."""
    nodes = _default_partition_nodes()
    if nodes < 2:
        pytest.skip(f"the running Slurm's default partition has {nodes} node(s); scripts/services/start-slurm.sh "
                    "starts two (POSTTRAIN_SLURM_NODES)")


@pytest.fixture
def slurm_jobs():
    """Handles registered here are cancelled at teardown, so no job outlives its test."""
    handles: list[Any] = []
    yield handles
    for handle in handles:
        if not handle.done():
            handle.cancel()


@pytest.fixture
def fake_ssh(tmp_path) -> tuple[str, Path]:
    """An `ssh` stand-in that logs the host and runs the remote command here."""
    log = tmp_path / "ssh.log"
    script = tmp_path / "fake-ssh"
    script.write_text(
        "#!/bin/bash\n"
        "while [ $# -gt 0 ]; do case \"$1\" in -o) shift 2;; --) shift; break;; *) break;; esac; done\n"
        'host="$1"; shift\n'
        f'printf "%s %s\\n" "$host" "$*" >> {log}\n'
        'exec bash -c "$*"\n'
    )
    script.chmod(0o755)
    return str(script), log
