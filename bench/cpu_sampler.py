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
        self._families: dict[str, list[psutil.Process]] = {}

    def _family(self, name: str, proc: psutil.Process) -> list[psutil.Process]:
        # Children are looked up once a second, not every sample: a lookup reads every process's
        # /proc entry, and at every sample it cost this process (the flow's) 4% of a CPU.
        if name not in self.with_children:
            return [proc]
        family = self._families.get(name)
        if family is None or len(self.samples) % 10 == 0:
            try:
                family = self._families[name] = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                family = [proc]
        return family

    def _cpu(self, name: str, proc: psutil.Process) -> float:
        total = 0.0
        for p in self._family(name, proc):
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
