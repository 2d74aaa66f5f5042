"""The trainer's timeline: append-only JSONL of what each process attempt did, with wall-clock times.

Rank 0 of every attempt (a first start, a Slurm requeue, a retried or restarted job: each a new
process) appends one JSON object per line to the job's timeline file, beside its results file
(``<output_dir>/.posttrain/<name>-<run_id>.timeline.jsonl``, see ``timeline_file_for``)::

    {"event": "start", "t": 1764612000.12, "attempt": "<host>:<pid>:<start>", "pid": 4242,
     "host": "n1", "slurm_job_id": "17", "slurm_restart_count": 0, "recorded": 1764612001.3}
    {"event": "loaded", "t": ..., "attempt": ...}           # model (and resumed state) loaded
    {"event": "step_begin", "t": ..., "attempt": ..., "step": 3}
    {"event": "step_end", "t": ..., "attempt": ..., "step": 3}
    {"event": "save_begin", "t": ..., "attempt": ..., "step": 4}
    {"event": "save_end", "t": ..., "attempt": ..., "step": 4}   # the checkpoint is complete
    {"event": "end", "t": ..., "attempt": ..., "completed": true, "stopped_early": false}

``t`` is ``time.time()``; for ``start`` it is the process's own start time (from /proc, so the
interpreter start and imports count as start-up). An attempt killed outright leaves no ``end``.
``posttrain.runs.goodput`` turns these into the run's goodput. No torch here; the Hugging Face
callback (``callback``) imports transformers when it is built.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.fsutil import written_lines

RESULTS_SUFFIX = ".results.jsonl"
TIMELINE_SUFFIX = ".timeline.jsonl"


def timeline_file_for(result_file: str | os.PathLike[str]) -> str:
    """The timeline file that goes with a results file (``x.results.jsonl`` -> ``x.timeline.jsonl``)."""
    text = str(result_file)
    return (text[: -len(RESULTS_SUFFIX)] if text.endswith(RESULTS_SUFFIX) else text) + TIMELINE_SUFFIX


def process_start_time() -> float:
    """When this process started (wall clock), from /proc; now where /proc cannot say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        now = time.time()
        return min(now, now - (uptime - ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError):
        return time.time()


class Timeline:
    """One attempt's recorder. Without a path it records nothing (other ranks, library calls)."""

    def __init__(self, path: str | os.PathLike[str] | None, *, started: float | None = None) -> None:
        self.path = Path(path) if path else None
        self.started = process_start_time() if started is None else started
        self.attempt = f"{socket.gethostname()}:{os.getpid()}:{self.started:.3f}"

    def mark(self, event: str, t: float | None = None, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "t": time.time() if t is None else t, "attempt": self.attempt, **fields})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:  # one write of one line: O_APPEND keeps lines whole
            f.write(line + "\n")

    def start(self) -> None:
        env = os.environ
        self.mark("start", self.started, pid=os.getpid(), host=socket.gethostname(),
                  slurm_job_id=env.get("SLURM_JOB_ID"), slurm_restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
                  recorded=time.time())

    @contextmanager
    def span(self, name: str, **fields: Any) -> Iterator[None]:
        """``<name>_begin`` now, ``<name>_end`` when the block finishes (not when it raises)."""
        self.mark(f"{name}_begin", **fields)
        yield
        self.mark(f"{name}_end", **fields)


_CURRENT = Timeline(None)


def open_timeline(path: str | os.PathLike[str] | None) -> Timeline:
    """This process's timeline (None: records nothing), its ``start`` written; ``current()`` returns it."""
    global _CURRENT
    _CURRENT = Timeline(path)
    _CURRENT.start()
    return _CURRENT


def current() -> Timeline:
    return _CURRENT


def callback(timeline: Timeline | None = None):
    """A transformers ``TrainerCallback`` recording loaded (train begin), each step's begin and end,
    and each save (begun at the end of the step that decided to save, ended by ``on_save``)."""
    from transformers import TrainerCallback

    tl = timeline or current()

    class TimelineCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                tl.mark("loaded", step=state.global_step)

        def on_step_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                tl.mark("step_begin", step=state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                tl.mark("step_end", step=state.global_step)
                if control.should_save:  # set by the flow callback (and StopOnRequest) before this one
                    tl.mark("save_begin", step=state.global_step)

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                tl.mark("save_end", step=state.global_step)

    return TimelineCallback()


# --- reading -------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One process attempt as its timeline lines tell it (times: seconds since the epoch)."""

    id: str
    start: float
    loaded: float | None = None
    saves: list[tuple[float, float]] = field(default_factory=list)  # (begin, end) of each completed save
    # (begin, end) of each wait of a resident trainer for a round's rollouts (``round_wait`` spans): not training
    waits: list[tuple[float, float]] = field(default_factory=list)
    steps: list[tuple[int, float, float | None]] = field(default_factory=list)  # (step, begin, end)
    last: float = 0.0  # the last time it recorded
    ended: float | None = None  # its ``end`` line, when it returned
    completed: bool = False  # it reached the end of training
    slurm_restart_count: int = 0

    @property
    def finished(self) -> bool:
        return self.completed

    @property
    def last_save_end(self) -> float | None:
        return self.saves[-1][1] if self.saves else None


def parse_timeline(lines: list[str]) -> list[Attempt]:
    """The attempts of a timeline, by start time; lines that do not parse (a torn last line) are skipped."""
    attempts: dict[str, Attempt] = {}
    open_saves: dict[str, float] = {}
    open_waits: dict[str, float] = {}
    for line in lines:
        try:
            e = json.loads(line)
            kind, t, key = e["event"], float(e["t"]), str(e["attempt"])
        except (ValueError, KeyError, TypeError):
            continue
        a = attempts.get(key)
        if a is None:
            a = attempts[key] = Attempt(id=key, start=t)
        if kind == "start":
            a.start = t
            a.slurm_restart_count = int(e.get("slurm_restart_count") or 0)
        elif kind == "loaded":
            a.loaded = t
        elif kind == "step_begin":
            a.steps.append((int(e.get("step", 0)), t, None))
        elif kind == "step_end" and a.steps and a.steps[-1][2] is None:
            a.steps[-1] = (a.steps[-1][0], a.steps[-1][1], t)
        elif kind == "save_begin":
            open_saves[key] = t
        elif kind == "save_end" and key in open_saves:
            a.saves.append((open_saves.pop(key), t))
        elif kind == "round_wait_begin":
            open_waits[key] = t
        elif kind == "round_wait_end" and key in open_waits:
            a.waits.append((open_waits.pop(key), t))
        elif kind == "end":
            a.ended = t
            a.completed = bool(e.get("completed"))
        a.last = max(a.last, t, float(e.get("recorded") or t))
    return sorted(attempts.values(), key=lambda a: a.start)


def read_timeline(path: str | os.PathLike[str]) -> list[Attempt]:
    """The attempts recorded in a timeline file; empty when it does not exist (yet)."""
    try:
        lines = written_lines(path)  # appended in place: a line being written is not read yet
    except FileNotFoundError:
        return []
    return parse_timeline([line.decode("utf-8", errors="replace") for _, line in lines])
