"""Goodput of a run: its flow's wall time split into categories, from what the jobs and the flow recorded.

Inputs are measured, never estimated: each training job's submit time (``JobRecord.submitted_at``)
and its trainer timeline (``posttrain.trainer.timeline``: per attempt its process start, model
loaded, saves, end), and the intervals the flow spent waiting on something (publishing, hot-loads,
sampling rollouts, the promotion gate), each a ``Span``. The categories (docs/goodput.md):

- ``queue``: each job's submit -> its first attempt's process start;
- ``startup``: each attempt's process start -> model loaded (interpreter, imports, model and
  resumed state loaded);
- ``training``: each attempt's model loaded -> its end (a finished attempt) or its last completed
  save (an attempt that did not finish), less the checkpoint saves in it;
- ``checkpoint``: each completed save (the end of the step that decided to save -> the save done);
- ``lost``: for each attempt that did not finish (killed, requeued, stopped early): from its last
  completed save (else its model loaded, else its last record) to the next attempt's process
  start (else its last record): the work the next attempt redoes since that checkpoint, plus the
  restart gap (the rest of the dying attempt, the scheduler's requeue delay and queue, the relaunch);
- ``sampling``, ``hot-load``, ``publish``, ``promotion``: the flow's waits on those, where no job
  category covers the same time (the nightly publishes while training runs: only what is left
  after the job ended counts);
- ``orchestration``: the rest of the flow's wall time (checks, staging, polling, job teardown,
  Prefect's own bookkeeping).

Every instant of the flow run's window goes to exactly one category, the first in ``PRIORITY``
whose intervals cover it (``orchestration`` when none does), so the categories add up to the wall
time and none is negative. ``goodput = training / wall``. Plain Python: no Prefect, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from posttrain.trainer.timeline import Attempt

# Overlaps resolved in this order: the job's own categories first, then the flow's waits.
PRIORITY = ("checkpoint", "training", "startup", "lost", "queue", "sampling", "hot-load", "publish", "promotion")
CATEGORIES = (*PRIORITY, "orchestration")


class Span(NamedTuple):
    category: str
    start: float
    end: float


@dataclass
class JobTimeline:
    """A training job: when it was submitted and what its attempts recorded."""

    submitted_at: float | None
    attempts: list[Attempt]


class Goodput(BaseModel):
    """A run's wall time by category (seconds) and its goodput."""

    model_config = ConfigDict(extra="forbid")

    flow_start: float = Field(description="The flow run's start (seconds since the epoch).")
    flow_end: float = Field(description="When the goodput was computed.")
    wall_s: float = Field(description="flow_end - flow_start.")
    seconds: dict[str, float] = Field(description="Seconds per category; they add up to wall_s.")
    goodput: float = Field(description="training / wall_s (0 when the wall time is 0).")
    jobs: int = Field(description="Training jobs of the run.")
    attempts: int = Field(description="Process attempts recorded over all jobs.")
    restarts: int = Field(description="Attempts that did not finish and were followed by another.")
    lost_redone_s: float = Field(description="Of lost: training after the last completed save of attempts that did not finish.")
    lost_restart_s: float = Field(description="Of lost: from such an attempt's last record to the next attempt's start.")
    steps_redone: int = Field(description="Steps begun after such an attempt's last completed save.")

    def rows(self) -> list[dict]:
        """The breakdown as table rows: category, seconds, % of wall."""
        wall = self.wall_s or 1.0
        return [{"category": c, "seconds": round(s, 2), "% of wall": round(100 * s / wall, 1)}
                for c, s in self.seconds.items()]


@dataclass
class _Lost:
    redone: float = 0.0
    restart: float = 0.0
    steps: int = 0
    restarts: int = 0


def job_spans(job: JobTimeline, lost: _Lost | None = None) -> list[Span]:
    """The job's intervals by category (see the module docstring); ``lost`` collects the details."""
    lost = lost if lost is not None else _Lost()
    attempts = sorted(job.attempts, key=lambda a: a.start)
    spans: list[Span] = []
    if attempts and job.submitted_at is not None:
        spans.append(Span("queue", job.submitted_at, attempts[0].start))
    for i, a in enumerate(attempts):
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        last = a.ended if a.ended is not None else a.last
        spans.append(Span("startup", a.start, a.loaded if a.loaded is not None else last))
        spans += [Span("checkpoint", b, e) for b, e in a.saves]
        if a.finished:
            if a.loaded is not None:
                spans += training_spans(a.loaded, last, a.waits)
            continue
        redone_from = a.last_save_end if a.saves else (a.loaded if a.loaded is not None else last)
        if a.loaded is not None:
            spans += training_spans(a.loaded, redone_from, a.waits)
        until = following.start if following is not None else last
        spans.append(Span("lost", redone_from, until))
        lost.redone += max(0.0, min(last, until) - redone_from)
        lost.restart += max(0.0, until - max(last, redone_from))
        lost.steps += sum(1 for _, begin, _ in a.steps if begin >= redone_from)
        lost.restarts += following is not None
    return spans


def training_spans(start: float, end: float, waits: list[tuple[float, float]]) -> list[Span]:
    """Training over [start, end] less a resident trainer's waits for rounds (the flow's sampling,
    publishing and hot-loading show there, else orchestration)."""
    spans, at = [], start
    for b, e in sorted(waits):
        if b > at:
            spans.append(Span("training", at, min(b, end)))
        at = max(at, e)
    if end > at:
        spans.append(Span("training", at, end))
    return [s for s in spans if s.end > s.start]


def paint(start: float, end: float, spans: list[Span]) -> dict[str, float]:
    """Seconds of [start, end] per category: each instant to the first category of ``PRIORITY``
    covering it, else orchestration. Spans are clipped to the window; empty ones are ignored."""
    rank = {c: i for i, c in enumerate(PRIORITY)}
    live = [(rank[s.category], max(s.start, start), min(s.end, end)) for s in spans]
    live = [s for s in live if s[2] > s[1]]
    points = sorted({start, end, *(x for _, a, b in live for x in (a, b))})
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for a, b in zip(points, points[1:], strict=False):
        mid = (a + b) / 2
        best = min((r for r, s, e in live if s <= mid < e), default=None)
        totals[PRIORITY[best] if best is not None else "orchestration"] += b - a
    return totals


def compute_goodput(flow_start: float, flow_end: float, jobs: list[JobTimeline], waits: list[Span]) -> Goodput:
    """The run's breakdown over the flow run's window [flow_start, flow_end]."""
    flow_end = max(flow_end, flow_start)
    lost = _Lost()
    spans = [s for job in jobs for s in job_spans(job, lost)] + list(waits)
    seconds = paint(flow_start, flow_end, spans)
    wall = flow_end - flow_start
    return Goodput(flow_start=flow_start, flow_end=flow_end, wall_s=wall, seconds=seconds,
                   goodput=seconds["training"] / wall if wall > 0 else 0.0, jobs=len(jobs),
                   attempts=sum(len(j.attempts) for j in jobs), restarts=lost.restarts,
                   lost_redone_s=lost.redone, lost_restart_s=lost.restart, steps_redone=lost.steps)
