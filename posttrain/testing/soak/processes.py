"""Processes the soak starts and keeps running: a small restart loop per process, as a systemd unit
with ``Restart=always`` would be (docs/recovery.md). A fault kills a process with SIGKILL and says how
long the supervisor waits before it starts it again."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_matching(*needles: str) -> list[int]:
    """Live processes whose command line holds every one of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            line = cmdline(int(entry.name))
            if line and all(n in line for n in needles):
                found.append(int(entry.name))
    return found


def kill_at_once(pids: list[int]) -> list[int]:
    """SIGSTOP all, then SIGKILL all: none reacts to another's death. The pids that were signalled."""
    hit = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
            hit.append(pid)
        except ProcessLookupError:
            pass
    for pid in hit:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return hit


class Supervised:
    """``argv`` kept running: started in a session of its own, its output appended to ``log``, started
    again ``restart_delay_s`` after it exits (each start is counted) until ``stop``."""

    def __init__(self, name: str, argv: list[str], log: Path, *, env: dict[str, str], cwd: Path,
                 ready: Callable[[], bool] | None = None, on_event: Callable[[str], None] = print) -> None:
        self.name, self.argv, self.log, self.env, self.cwd = name, argv, log, env, cwd
        self.ready = ready
        self.on_event = on_event
        self.starts = 0
        self.restart_delay_s = 1.0
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"supervise-{name}", daemon=True)

    def start(self, timeout: float = 180.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"{self.name} did not start in {timeout:.0f} s: see {self.log}")

    def _spawn(self) -> subprocess.Popen:
        with open(self.log, "ab") as out:
            return subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self.proc = self._spawn()
            self.starts += 1
            self.on_event(f"{self.name}: started pid {self.proc.pid} (start {self.starts})")
            deadline = time.monotonic() + 180
            while self.ready is not None and not self.ready() and self.proc.poll() is None:
                if time.monotonic() > deadline or self._stopping.is_set():
                    break
                time.sleep(0.5)
            self._started.set()
            rc = self.proc.wait()
            if self._stopping.is_set():
                return
            delay, self.restart_delay_s = self.restart_delay_s, 1.0
            self.on_event(f"{self.name}: pid {self.proc.pid} exited rc {rc}; restarting in {delay:.1f} s")
            if self._stopping.wait(delay):
                return

    def kill(self, restart_delay_s: float, with_descendants: Callable[[int], bool] = lambda pid: False) -> list[int]:
        """SIGKILL the process (and those of its descendants ``with_descendants`` picks), at once; the
        supervisor starts it again after ``restart_delay_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return []
        self.restart_delay_s = restart_delay_s
        return kill_at_once([proc.pid] + [p for p in descendants(proc.pid) if with_descendants(p)])

    def stop(self) -> None:
        """TERM, TERM (a Prefect worker takes two), then KILL of its whole process group."""
        self._stopping.set()
        proc = self.proc
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what is left in its group
            except ProcessLookupError:
                pass
        self._thread.join(timeout=30)
