"""The benchmarks' inference deployment: ``posttrain serve`` (the reference server) in a process of
its own, as an inference deployment runs beside a flow, never inside it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def pin(core: int):
    """A preexec_fn pinning a child process to ``core`` (when the machine has it)."""
    cores = {core} if core < (os.cpu_count() or 1) else None
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_inference(base: Path, store: Path, work: Path, token: str,
                    core: int | None = None) -> tuple[subprocess.Popen, str]:
    """``posttrain serve`` (the reference server) on ``core`` (None: any); its URL once /health answers."""
    port = free_port()
    log = open(work / "inference.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", "--model", str(base), "--served-model-name", "tiny",
         "--port", str(port), "--deployment-id", "dep-bench", "--store", str(store), "--token-env", "BENCH_TOKEN",
         "--work-dir", str(work / "inference"), "--device", "cpu", "--log-level", "warning"],
        env={**os.environ, "BENCH_TOKEN": token}, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=pin(core) if core is not None else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the inference server exited {proc.returncode}; see {work / 'inference.log'}")
        try:
            request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the inference server did not answer /health in 180 s")
