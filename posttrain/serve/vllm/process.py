"""Start and supervise one vLLM server (its OpenAI-compatible entry point) on 127.0.0.1.

``VLLMProcess`` runs ``python -m vllm.entrypoints.launchers.api_server.entry`` from vLLM's own
venv (``scripts/services/setup-vllm.sh``) with the flags and environment of
``scripts/services/start-vllm.sh``, in a process group of its own (vLLM runs several processes:
API server, EngineCore, worker), logging to a file.

``start`` returns only once ``/health`` answers 200 AND one generated token came back: a model
the CPU build cannot run answers ``/health`` and then dies on its first request. ``stop`` sends
SIGTERM to the whole group, SIGKILL after a grace period, and returns once no process of the
group is left. The dev endpoints (``VLLM_SERVER_DEV_MODE=1``: pause, reload, resume) are on, so
the server only ever listens on loopback.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain import redact
from posttrain.serve.engine import EngineCallError
from posttrain.serve.vllm.client import VLLMClient

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /collective_rpc, /resume (loopback only)
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONFAULTHANDLER": "1",  # a process killed by a signal (SIGILL, SIGSEGV) logs where: the cause in its log
}
# Of the caller's environment, these would point vLLM's Python at the project's packages.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
LOG_TAIL_LINES = 40
# vLLM imports the readback extension by this name, from a folder of its own on its PYTHONPATH
READBACK_MODULE = "posttrain_readback"
READBACK_CLS = f"{READBACK_MODULE}.WeightReadback"
# "RuntimeError: Unsupported CPU attention ...", and a worker killed by a signal, which Python's fault handler
# names: "Fatal Python error: Illegal instruction" (vLLM's AMX attention on some shapes)
ERROR_LINE = re.compile(r"\b[A-Za-z.]*(?:Error|Exception): .*|Fatal Python error: .*")


def default_python() -> Path:
    """vLLM's interpreter: ``$VLLM_VENV/bin/python`` when set (as the start scripts), else ``<repo>/.venv-vllm``."""
    venv = os.environ.get("VLLM_VENV")
    return (Path(venv) if venv else REPO_ROOT / ".venv-vllm") / "bin" / "python"


class VLLMProcessConfig(BaseModel):
    """How to run one vLLM server; the defaults are start-vllm.sh's (the tiny model, float32, CPU)."""

    model_config = ConfigDict(extra="forbid")

    python: Path | None = Field(
        None, description="vLLM's Python (default: $VLLM_VENV/bin/python, else <repo>/.venv-vllm/bin/python)."
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="Port on 127.0.0.1 (default: a free one, kept across restarts)."
    )
    served_model_name: str = Field("tiny", min_length=1, description="The name requests give as `model`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="vLLM's --dtype; float32 matches transformers within 1e-6 on CPU."
    )
    max_model_len: int = Field(256, ge=1, description="vLLM's --max-model-len (prompt plus completion tokens).")
    max_num_seqs: int = Field(8, ge=1, description="vLLM's --max-num-seqs (sequences per batch).")
    max_logprobs: int = Field(20, ge=0, description="vLLM's --max-logprobs (most logprobs a request may ask).")
    kv_cache_space_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE: the CPU KV cache in GiB.")
    max_lora_rank: int | None = Field(
        None, ge=1, description="Load LoRA adapters at run time (--enable-lora, runtime LoRA updating) up to this "
        "rank (--max-lora-rank); None: LoRA off, adapters are refused."
    )
    max_loras: int = Field(2, ge=2, description="vLLM's --max-loras with LoRA on: the served adapter and the next "
                           "one, resident together while a hot-load switches.")
    extra_args: list[str] = Field(default_factory=list, description="More command-line arguments for vLLM.")
    worker_extension: str = Field(
        READBACK_CLS, description="vLLM's --worker-extension-cls: the class that reads back, inside the worker, "
        "the digests of the weights it holds (posttrain.serve.readback_extension, or a subclass)."
    )
    extension_path: list[Path] = Field(
        default_factory=list, description="Folders put on vLLM's PYTHONPATH ahead of the readback extension's "
        "(where a worker_extension other than the default is found)."
    )
    log_file: Path | None = Field(
        None, description="Where vLLM's output goes, appended (default: a file named after the port in /tmp)."
    )
    start_timeout_s: float = Field(300.0, gt=0, description="Seconds for /health and the first token.")
    start_stall_s: float | None = Field(
        150.0, gt=0, description="A start whose log stays silent this long before /health answers is stopped "
        "and started again, once (vLLM's CPU build was seen to hang its worker process before it loaded "
        "anything, for good); None waits for start_timeout_s. Eager mode (always on here) logs as it loads."
    )
    stop_grace_s: float = Field(20.0, ge=0, description="Seconds between SIGTERM and SIGKILL on stop.")


class _StartStalled(Exception):
    """vLLM's log stayed silent for ``start_stall_s`` before it was ready."""


class EngineStartError(Exception):
    """vLLM did not become ready (exited, timed out, or could not generate); carries the log's last lines."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message + (f"\nlast lines of vLLM's log:\n{log_tail}" if log_tail else ""))
        self.reason = "; ".join(message.splitlines())  # why, on one line: what the caller shows
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``, from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


class VLLMProcess:
    """One supervised vLLM server at ``url``; ``start(model_dir)``, ``stop()``, ``restart()``."""

    def __init__(self, config: VLLMProcessConfig | None = None) -> None:
        self.config = config or VLLMProcessConfig()
        self.python = self.config.python or default_python()
        self.port = self.config.port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_file = self.config.log_file or Path(f"/tmp/posttrain-vllm-{self.port}.log")
        self.model_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        # close() and a start() in another thread (a gateway's monitor restarting a replica while the
        # gateway shuts down): a start either sees the close and starts nothing, or its process exists
        # before close() stops what there is.
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self._kill_quietly)

    # --- lifecycle ---------------------------------------------------------------------------

    def command(self, model_dir: Path) -> list[str]:
        c = self.config
        return [
            str(self.python), "-m", ENTRY, "--model", str(model_dir),
            "--served-model-name", c.served_model_name, "--host", HOST, "--port", str(self.port),
            "--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--enforce-eager",
            "--max-num-seqs", str(c.max_num_seqs), "--max-logprobs", str(c.max_logprobs),
            "--worker-extension-cls", c.worker_extension,
            *(["--enable-lora", "--max-lora-rank", str(c.max_lora_rank), "--max-loras", str(c.max_loras)]
              if c.max_lora_rank else []),
            *c.extra_args,
        ]  # fmt: skip

    def start(self, model_dir: Path) -> None:
        """Start vLLM on ``model_dir``; return once it answers /health and generated one token."""
        if self._proc is not None and group_pids(self._proc.pid):
            raise EngineStartError(f"vLLM already runs at {self.url} on {self.model_dir}; stop() or restart() it")
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "config.json").is_file():
            raise EngineStartError(f"{model_dir} is not a model folder (no config.json)")
        if not self.python.is_file():
            raise EngineStartError(f"vLLM's Python {self.python} not found; run scripts/services/setup-vllm.sh")
        if port_taken(self.port):
            raise EngineStartError(f"port {self.port} on {HOST} is taken by another process")
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(VLLM_ENV, VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_space_gib))
        env["PYTHONPATH"] = os.pathsep.join([*map(str, self.config.extension_path), str(self._extension_dir())])
        if self.config.max_lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        for attempt in (1, 2):
            t0 = time.monotonic()
            proc = self._launch(model_dir, env)
            try:
                self._wait_ready(proc, t0 + self.config.start_timeout_s, stall=attempt == 1)
            except _StartStalled as stalled:
                self.stop()
                log.warning("vLLM at %s: %s; starting it again", self.url, stalled)
                continue
            except BaseException:
                self.stop()
                raise
            log.info("vLLM ready at %s in %.1f s", self.url, time.monotonic() - t0)
            return

    def _launch(self, model_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self._lock, open(self.log_file, "ab") as out:
            if self._closed:
                raise EngineStartError(f"vLLM at {self.url} was closed; it is not started again")
            self._log_offset = out.tell()
            out.write(f"=== posttrain: starting vLLM at {self.url} on {model_dir}\n".encode())
            out.flush()
            proc = self._proc = subprocess.Popen(
                self.command(model_dir), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )  # fmt: skip
        self.model_dir = model_dir
        log.info("vLLM starting at %s on %s (pid %d, log %s)", self.url, model_dir, proc.pid, self.log_file)
        return proc

    def _extension_dir(self) -> Path:
        """A folder holding only the readback extension, as ``posttrain_readback``: what vLLM's PYTHONPATH
        gets (never the project's packages, which vLLM's venv does not have)."""
        folder = self.log_file.parent / f"posttrain-vllm-{self.port}-pythonpath"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).parents[1] / "readback_extension.py", folder / f"{READBACK_MODULE}.py")
        return folder

    def _wait_ready(self, proc: subprocess.Popen[bytes], deadline: float, *, stall: bool = False) -> None:
        client = VLLMClient(self.url)
        stall_s = self.config.start_stall_s if stall else None
        size, grew = -1, time.monotonic()
        try:
            while not client.health(timeout=2.0):
                if proc.poll() is not None:
                    raise EngineStartError(
                        f"vLLM exited with status {proc.returncode} before it was ready", self.log_tail()
                    )
                if time.monotonic() >= deadline:
                    raise EngineStartError(
                        f"vLLM not ready after {self.config.start_timeout_s:.0f} s", self.log_tail()
                    )
                if stall_s is not None:
                    now_size = self.log_file.stat().st_size if self.log_file.exists() else 0
                    if now_size != size:
                        size, grew = now_size, time.monotonic()
                    elif time.monotonic() - grew >= stall_s:
                        raise _StartStalled(f"its log ({self.log_file}) was silent for {stall_s:.0f} s while starting")
                time.sleep(0.5)
            client.timeout = max(1.0, deadline - time.monotonic())
            body = {"model": self.config.served_model_name, "prompt": [0], "max_tokens": 1, "temperature": 0}
            try:
                out = client.complete(body)
                if not out.get("choices"):
                    raise EngineCallError(200, f"no choices in {out!r}")
            except EngineCallError as e:
                causes = "; ".join(self.log_errors()) or "(no error line in the log)"
                raise EngineStartError(
                    f"vLLM answers /health but cannot generate: {e}\nerrors in its log: {causes}", self.log_tail()
                ) from e
        finally:
            client.close()

    def close(self) -> None:
        """Stop vLLM for good: a ``start`` or ``restart`` racing this (in another thread) starts nothing
        that outlives it, and later ones raise ``EngineStartError``."""
        with self._lock:
            self._closed = True
        self.stop()

    def stop(self) -> None:
        """SIGTERM vLLM's process group, SIGKILL after ``stop_grace_s``; return once none of it is left."""
        proc = self._proc  # once: close() may stop it while a restart in another thread does too
        if proc is None:
            return
        pgid = proc.pid
        t0 = time.monotonic()
        self._signal_group(pgid, signal.SIGTERM)
        if not self._wait_gone(proc, self.config.stop_grace_s):
            log.warning("vLLM group %d still runs %.0f s after SIGTERM; killing it", pgid, self.config.stop_grace_s)
            self._signal_group(pgid, signal.SIGKILL)
            if not self._wait_gone(proc, 10.0):
                raise RuntimeError(f"vLLM's processes {group_pids(pgid)} (group {pgid}) survived SIGKILL")
        with self._lock:
            if self._proc is proc:
                self._proc = None
        log.info("vLLM at %s stopped in %.1f s", self.url, time.monotonic() - t0)

    def restart(self, model_dir: Path | None = None) -> None:
        """Stop (whatever is left of) vLLM and start it on ``model_dir`` (default: the current folder)."""
        model_dir = model_dir or self.model_dir
        if model_dir is None:
            raise EngineStartError("restart() needs a model folder: vLLM was never started")
        self.stop()
        self.start(model_dir)

    def _signal_group(self, pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass  # nothing of the group is left
        except PermissionError as e:
            raise RuntimeError(f"cannot signal vLLM's process group {pgid}: {e}") from e

    def _wait_gone(self, proc: subprocess.Popen[bytes], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            proc.poll()  # reap the leader, or it stays a zombie
            if not group_pids(proc.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _kill_quietly(self) -> None:
        """At interpreter exit: leave no vLLM behind."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except OSError:
                pass

    # --- state ------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every live process of vLLM's group (API server, EngineCore, worker, ...)."""
        if self._proc is None:
            return []
        self._proc.poll()
        return group_pids(self._proc.pid)

    def alive(self) -> bool:
        """vLLM's main process runs and ``/health`` answers 200 (true even after a failed reload)."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        with VLLMClient(self.url) as client:
            return client.health(timeout=5.0)

    def client(self, *, timeout: float = 60.0) -> VLLMClient:
        """A new client for this server."""
        return VLLMClient(self.url, timeout=timeout)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines vLLM wrote since its latest start."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError as e:
            return f"(log {self.log_file} unreadable: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def log_errors(self, most: int = 3) -> list[str]:
        """The last distinct ``...Error: message`` lines vLLM logged since its latest start (the causes)."""
        seen: dict[str, None] = {}
        for line in self.log_tail(lines=100_000).splitlines():
            match = ERROR_LINE.search(line)
            if match:  # scrubbed: these go into exceptions and the run's logs
                cause = redact.scrub(match.group(0))
                seen.pop(cause, None)
                seen[cause] = None
        return list(seen)[-most:]

    def __enter__(self) -> VLLMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["EngineStartError", "VLLMProcess", "VLLMProcessConfig", "default_python", "group_pids"]
