"""The grpo flow with its resident trainer (``trainer_job: resident``, the default): one training job
for the whole run on the local cluster, handed each round's rollouts; a retried flow run finds the job
and goes on from the rounds it trained; cancelling the run cancels the job."""

from __future__ import annotations

import json

import pytest

from posttrain.runs.once import JobRecord, job_name
from tests.pipeline.conftest import GRPO
from tests.pipeline.flaky import FAIL_ROUND_MARKER_ENV
from tests.pipeline.runs import (
    flow_run_logs,
    prefect_cli,
    run_folder,
    start_deployment,
    task_runs,
    wait_final,
    wait_not_final,
)

pytestmark = pytest.mark.slow


def job_folders(setup, job: str) -> list[str]:
    """The local cluster's job folders of the job named ``job`` (one per submission)."""
    return sorted(p.name for p in setup.jobs_dir.iterdir() if p.name.startswith(f"{job}-"))


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "policy").glob("checkpoint-*"))


@pytest.mark.timeout(420)
def test_a_resident_grpo_run_is_one_training_job(tiny_setup):
    from posttrain.pipeline.flows.grpo import grpo

    params = tiny_setup.grpo_settings("flows-grpo-resident", rounds=3)
    state = grpo(**params, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    run_dir = tiny_setup.shared_dir / "runs" / report.run_name
    job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert job.name == job_name(f"{report.run_name}-resident") and job.backend == "local"
    assert len(job_folders(tiny_setup, job.name)) == 1, job_folders(tiny_setup, job.name)
    assert not list(run_dir.glob("rounds/*/train-job.json"))  # no step jobs
    assert checkpoints(run_dir) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert [row["round"] for row in report.rounds] == [0, 1, 2]
    assert report.final_checkpoint == str(run_dir / "policy" / "checkpoint-3")
    assert [json.loads((run_dir / "rounds" / f"{r:04d}" / "ready.json").read_text())["round"] for r in range(3)] \
        == [0, 1, 2]
    # The trainer's one result: completed, three rounds.
    (results,) = sorted((run_dir / "policy" / ".posttrain").glob("*.results.jsonl"))
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0]["completed"] and lines[0]["rounds_done"] == 3, lines
    assert lines[0]["mode"] == "resident"
    assert tiny_setup.served_identity() == report.final_snapshot
