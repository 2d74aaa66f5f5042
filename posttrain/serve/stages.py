"""The seconds a hot-load spends in each stage, for ``/metrics`` (``posttrain.serve.metrics``).

The hot-load service times a load with ``timing_stages()``; the code it calls (the service's own
fetch and rebuild, the engine's checks, switch and probe) marks its stages with ``stage(name)``.
Stages nest exclusively: an inner stage's seconds are not counted in the one around it. Outside a
``timing_stages()`` block (a restart resuming its version, a test calling an engine directly),
``stage`` does nothing.

Stages (docs/metrics.md names the code each covers): fetch, apply, validate, switch, probe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("fetch", "apply", "validate", "switch", "probe")

_local = threading.local()


class StageTimes:
    """Seconds per stage of one hot-load, summed over every time it entered the stage (once per
    replica for switch and probe)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [name, since] of the stages entered, innermost last

    def _charge(self, entry: list, now: float) -> None:
        self.seconds[entry[0]] = self.seconds.get(entry[0], 0.0) + (now - entry[1])


@contextmanager
def timing_stages() -> Iterator[StageTimes]:
    """Time the stages marked by ``stage`` in this thread until the block ends."""
    times = StageTimes()
    outer = getattr(_local, "times", None)
    _local.times = times
    try:
        yield times
    finally:
        _local.times = outer


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the block's seconds (success or failure: a stage that raised was reached) to ``name``."""
    if name not in STAGES:
        raise ValueError(f"unknown hot-load stage {name!r} (one of {', '.join(STAGES)})")
    times: StageTimes | None = getattr(_local, "times", None)
    if times is None:
        yield
        return
    now = time.perf_counter()
    if times._stack:  # the stage around this one stops counting meanwhile
        times._charge(times._stack[-1], now)
    entry = [name, now]
    times._stack.append(entry)
    try:
        yield
    finally:
        now = time.perf_counter()
        times._stack.pop()
        times._charge(entry, now)
        if times._stack:
            times._stack[-1][1] = now
