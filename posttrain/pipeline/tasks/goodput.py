"""The run's goodput at the end of a flow: the flow's waits (``FlowClock``), the jobs' timelines
(``posttrain.runs.once.job_timeline``), the breakdown (``posttrain.runs.goodput``), reported as a
table artifact and a ``posttrain.run.goodput`` event. See docs/goodput.md."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger
from prefect.runtime import flow_run

from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.report import goodput_table
from posttrain.runs.goodput import Goodput, JobTimeline, Span, compute_goodput
from posttrain.runs.once import JobRecord, job_timeline


def flow_run_start() -> float | None:
    """The flow run's start as the Prefect server records it (seconds since the epoch), if known."""
    if not flow_run.id:
        return None
    from prefect import get_client

    with get_client(sync_client=True) as client:
        found = client.read_flow_run(flow_run.id)
    return found.start_time.timestamp() if found.start_time else None


class FlowClock:
    """The intervals a flow waits on publishing, hot-loads, sampling and the promotion gate."""

    def __init__(self) -> None:
        self.created = time.time()
        self.spans: list[Span] = []

    @contextmanager
    def wait(self, category: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.spans.append(Span(category, t0, time.time()))


def report_goodput(card: str, run_name: str, clock: FlowClock, jobs: list[JobRecord | Path]) -> Goodput | None:
    """Compute the run's goodput (``jobs``: the records, or their marker files) and report it. A
    failure to report is logged, not raised: the run's work is done."""
    logger = get_run_logger()
    try:
        records = [JobRecord.model_validate_json(j.read_text()) if isinstance(j, Path) else j for j in jobs]
        start = flow_run_start() or clock.created
        result = compute_goodput(start, time.time(), [JobTimeline(r.submitted_at, job_timeline(r)) for r in records],
                                 clock.spans)
        goodput_table(card, result)
        events.run_goodput(run_name, result)
    except Exception as e:  # noqa: BLE001
        logger.warning("goodput not reported: %s: %s", type(e).__name__, e)
        return None
    logger.info("goodput %.1f%% of %.1f s: %s", 100 * result.goodput, result.wall_s,
                ", ".join(f"{c} {s:.1f}s" for c, s in result.seconds.items() if s))
    return result
