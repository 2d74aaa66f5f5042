"""CPU seconds of the processes a benchmark's rounds run on, sampled in the background, so that a
stage's CPU can be read per process afterwards (``cpu_between``): which process a slower stage
spent its time in, or waited for."""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path

import psutil


def pid_in(path: Path) -> int | None:
    """The pid in a pid file (first line), if there is one."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class CpuSampler(threading.Thread):
    """Every ``interval`` s: user + system CPU seconds of each named process, with its children
    for those in ``with_children`` (a postmaster's backends, a server's workers), keyed by
    wall-clock time (``time.time()``)."""

    def __init__(self, pids: dict[str, int | None], with_children: tuple[str, ...] = (),
                 interval: float = 0.1) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items() if pid}
        self.with_children = with_children
        self.interval = interval
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []
        self._stop_event = threading.Event()

    def _cpu(self, name: str, proc: psutil.Process) -> float:
        total = 0.0
        family = [proc]
        if name in self.with_children:
            try:
                family += proc.children(recursive=True)
            except psutil.Error:
                pass
        for p in family:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass  # a backend that just exited: its time is lost to the sample, not the total
        return total

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            sample = {name: self._cpu(name, p) for name, p in self.procs.items()}
            self.times.append(time.time())
            self.samples.append(sample)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """Each process's CPU seconds from the last sample at or before ``start`` to the first at or
        after ``end`` (a stage plus at most one interval either side)."""
        if not self.times:
            return {}
        i = max(bisect.bisect_right(self.times, start) - 1, 0)
        j = min(bisect.bisect_left(self.times, end), len(self.times) - 1)
        return {name: self.samples[j][name] - self.samples[i].get(name, 0.0) for name in self.samples[j]}
