"""Helpers of the flow tests: deployment runs through the CLI, and what the Prefect API recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from uuid import UUID

REPO = Path(__file__).resolve().parents[2]


def prefect_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def deployment_run_args(name: str, settings: dict, *, watch_timeout: float | None = None,
                        env: dict[str, str] | None = None, tags: tuple[str, ...] = ()) -> list[str]:
    """The arguments of ``prefect deployment run NAME`` for a run of ``settings``; with ``watch_timeout``,
    ``--watch`` for that long. The one place that knows how settings become the flows' parameters."""
    args = ["deployment", "run", name, "--params", json.dumps(settings)]
    if watch_timeout is not None:
        args += ["--watch", "--watch-interval", "1", "--watch-timeout", str(int(watch_timeout))]
    if env is not None:
        args += ["--job-variable", "env=" + json.dumps(env)]
    for tag in tags:  # besides the deployment's own
        args += ["--tag", tag]
    return args


def flow_run_id_in(output: str) -> str | None:
    """The flow run id ``prefect deployment run`` printed (its ``UUID:`` line)."""
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    return match.group(1) if match else None


def run_deployment(name: str, settings: dict, *, env: dict[str, str] | None = None, timeout: float = 240):
    """``prefect deployment run NAME --params '<settings as JSON>' --watch``: (completed process, flow run id)."""
    proc = prefect_cli(*deployment_run_args(name, settings, watch_timeout=timeout, env=env), timeout=timeout + 30)
    return proc, flow_run_id_in(proc.stdout)


def start_deployment(name: str, settings: dict, *, env: dict[str, str] | None = None, tags: tuple[str, ...] = ()):
    """``prefect deployment run NAME --params '<settings as JSON>'`` without watching (it returns once the
    flow run is created): (completed process, flow run id)."""
    proc = prefect_cli(*deployment_run_args(name, settings, env=env, tags=tags), timeout=120)
    return proc, flow_run_id_in(proc.stdout)


def read_flow_run(flow_run_id: str | UUID):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(str(flow_run_id)))


def wait_final(flow_run_id: str | UUID, timeout: float = 240):
    """The flow run once it reaches a final state (Completed, Failed, Crashed, Cancelled)."""
    deadline = time.monotonic() + timeout
    while True:
        run = read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {flow_run_id} still {run.state_name} after {timeout} s")
        time.sleep(0.5)


def run_folder(setup, run: str, flow_run_id: str) -> Path:
    """Where a flow run of run name ``run`` works: ``<shared>/runs/<run>-<first 8 hex of its id>``."""
    return setup.shared_dir / "runs" / f"{run}-{flow_run_id.replace('-', '')[:8]}"


def wait_submitted(setup, worker, run: str, flow_run_id: str, marker: str = "training-job.json",
                   timeout: float = 120):
    """Once the flow run submitted the training job recorded in ``marker`` (a path in its run folder):
    the job's record. Fails at once when the run ends first."""
    from posttrain.runs.once import JobRecord

    path = run_folder(setup, run, flow_run_id) / marker
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = read_flow_run(flow_run_id).state
        assert not state.is_final(), f"{state.name}: {state.message}\n{worker.tail()}"
        assert time.monotonic() < deadline, f"no training job submitted in {timeout} s\n{worker.tail()}"
        time.sleep(0.5)
    return JobRecord.model_validate_json(path.read_text())


def wait_not_final(flow_run_id: str | UUID, timeout: float = 120):
    """Wait until a retried flow run has left its final state (it is scheduled again)."""
    deadline = time.monotonic() + timeout
    while read_flow_run(flow_run_id).state.is_final():
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {flow_run_id} was not rescheduled in {timeout} s")
        time.sleep(0.2)


def task_runs(flow_run_id: str | UUID, settle_s: float = 1.5, timeout: float = 20) -> list:
    """The flow run's task runs as the server recorded them. Task-run states reach the server as
    events, which its task-run recorder writes in batches (once a second with the start script's
    settings), so this reads until two reads ``settle_s`` apart agree."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    def seen(runs: list) -> list:
        return sorted((str(t.id), t.state_type, t.run_count) for t in runs)

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        read = lambda: client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [UUID(str(flow_run_id))]}))  # noqa: E731
        runs = read()
        while True:
            time.sleep(settle_s)
            again = read()
            if seen(again) == seen(runs) or time.monotonic() > deadline:
                return again
            runs = again


def shard_runs(flow_run_id: str | UUID) -> dict:
    """The flow run's ``rollout-shard`` task runs by name (``round-<r>-shard-<s>``)."""
    return {t.name: t for t in task_runs(flow_run_id) if t.name.startswith("round-") and "-shard-" in t.name}


def assert_one_shard_retried(flow_run_id: str | UUID, *, shards: int) -> None:
    """Round 0's ``shards`` shard tasks all completed; exactly one ran twice (a transient failure,
    retried alone) and the others once; the run's logs give the failure and the retry."""
    runs = shard_runs(flow_run_id)
    assert sorted(runs) == [f"round-0-shard-{s}" for s in range(shards)], sorted(runs)
    assert all(t.state.is_completed() for t in runs.values())
    counts = sorted(t.run_count for t in runs.values())
    assert counts == [1] * (shards - 1) + [2], counts
    logs = flow_run_logs_until(flow_run_id, "Retry 1/2")  # task-run states carry no message
    assert any("ConnectionError" in m and "Retry 1/2" in m for m in logs), logs


def flow_run_logs_until(flow_run_id: str | UUID, text: str, timeout: float = 60) -> list[str]:
    """The flow run's log messages once one holds ``text`` (logs reach the API in the background),
    or as they are after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        logs = flow_run_logs(flow_run_id)
        if any(text in m for m in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def flow_run_logs(flow_run_id: str | UUID, since: datetime | None = None) -> list[str]:
    """Messages the flow run (and its task runs) logged, oldest first, from ``since`` on."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter
    from prefect.client.schemas.sorting import LogSort

    out = []
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [UUID(str(flow_run_id))]}),
                                    sort=LogSort.TIMESTAMP_ASC, limit=200, offset=offset)
            out += [log.message for log in page if since is None or log.timestamp >= since]
            if len(page) < 200:
                return out
            offset += 200


def overlapping(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most
