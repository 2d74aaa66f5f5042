"""A run's events name its own runs as related, never a task run of an earlier flow run of the same
process (issue 33, item 20: a GRPO run's round.finished, job.completed and run.goodput named the
task run submit-… of the nightly run before it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.pipeline.run_events import named, wait_events

ROOT = Path(__file__).resolve().parents[2]


def test_an_event_outside_a_task_names_no_task_run_of_an_earlier_flow_run(prefect_api):
    done = subprocess.run([sys.executable, "-m", "tests.pipeline.stale_event_context"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    later = done.stdout.strip().splitlines()[-1]
    found = wait_events(later, lambda evs: named(evs, "posttrain.round.finished"))
    (event,) = named(found, "posttrain.round.finished")
    roles = {r.role: r.id for r in event.related}
    assert roles.get("flow-run") == f"prefect.flow-run.{later}"
    assert "task-run" not in roles, f"a task run of the earlier flow run is related: {roles}"
