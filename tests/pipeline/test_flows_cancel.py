"""Cancelling a nightly or GRPO deployment run stops its training job (real Prefect server, process
worker). A nightly run's local trainer is cancelled in test_flows_concurrency.py (the run holding
the deployment's slot), a nightly run's Slurm job (on two nodes) in test_flows_multinode.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from posttrain.cluster.local import group_members
from posttrain.runs.once import JobRecord
from tests.pipeline.conftest import GRPO, NIGHTLY
from tests.pipeline.run_events import named, wait_events
from tests.pipeline.runs import (
    flow_run_logs,
    prefect_cli,
    start_deployment,
    task_runs,
    wait_final,
    wait_submitted,
)

pytestmark = pytest.mark.slow


# The Slurm acceptance bound is 30 s. Locally the same path (worker sees the cancel, the flow process
# ends, its hook stops the process group with a 5 s grace) took 5-25 s; on a loaded 2-core machine
# Prefect's part alone can take 15 s, and at load 10 a 2-node cancel took over 30 s, so the bound
# waits for the processes to go with room to spare (a passing run waits only as long as they take).
LOCAL_STOP_S = 120


def start_until_submitted(tiny_setup, process_worker, deployment: str, run: str, settings: dict,
                          marker: str, tags: tuple[str, ...] = ()) -> tuple[str, JobRecord]:
    """Start a deployment run of ``settings`` (run name ``run``); once it submitted the training job
    recorded in ``marker`` (a path in its run folder), its flow run id and the job's record."""
    proc, flow_run_id = start_deployment(deployment, settings, tags=tags)
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    return flow_run_id, wait_submitted(tiny_setup, process_worker, run, flow_run_id, marker)


def start_long_run(tiny_setup, process_worker, run: str, **settings) -> tuple[str, JobRecord]:
    """Start a nightly deployment run that would train for ages; once it submitted its training job,
    its flow run id and the job's record."""
    params = tiny_setup.settings(run, **{"max_steps": 100000, "save_steps": 100000, **settings})
    return start_until_submitted(tiny_setup, process_worker, NIGHTLY, run, params, "training-job.json")


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (what `ps` would show)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_for_trainer(job: JobRecord, process_worker) -> None:
    """Until the trainer of a local job runs (its command line names the job folder)."""
    assert job.backend == "local" and job.pgid is not None
    job_dir = str(Path(job.log_path).parent)
    deadline = time.monotonic() + 180
    while not processes_mentioning(f"posttrain.trainer {job_dir}"):
        assert time.monotonic() < deadline, f"the trainer did not start in 180 s\n{process_worker.tail()}"
        time.sleep(0.5)
    assert group_members(job.pgid)


def request_cancel(flow_run_id: str) -> float:
    """``prefect flow-run cancel``; the monotonic time it was asked."""
    t0 = time.monotonic()
    cancel = prefect_cli("flow-run", "cancel", flow_run_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    return t0


def assert_cancelled(flow_run_id: str, job: JobRecord, stopped: str) -> None:
    """The flow run ends CANCELLED; its own process logged ``stopped`` (how it stopped the job) as the
    cancel reached it, the on_cancellation hook after it left the job alone, and one
    ``posttrain.job.cancelled`` event was recorded for the job, after its submission."""
    run = wait_final(flow_run_id, timeout=180)
    assert run.state.is_cancelled(), f"{run.state_name}: {run.state.message}"
    logs = "\n".join(flow_run_logs(flow_run_id))
    # Not the hook: Prefect's worker runs it 15-20 s later, in a new process that imports the flow first.
    assert any(line.startswith("cancelled, stopping the training job now: ") and stopped in line
               for line in logs.splitlines()), logs[-3000:]
    assert f"training job {job.job_id} was stopped at the cancel, by the flow run's process" in logs, logs[-3000:]
    events = wait_events(flow_run_id, lambda ev: named(ev, "posttrain.job.cancelled"))
    (cancelled,) = named(events, "posttrain.job.cancelled")
    assert cancelled.resource.id == f"posttrain.job.{job.backend}.{job.job_id}"
    assert stopped in cancelled.payload["reason"], cancelled.payload
    assert [e.event for e in events if e.event.startswith("posttrain.job.")] == ["posttrain.job.submitted",
                                                                                 "posttrain.job.cancelled"]


def cancel_and_check_stopped(flow_run_id: str, job: JobRecord) -> float:
    """``prefect flow-run cancel``; asserts that the local job's processes are gone within
    ``LOCAL_STOP_S``, the flow run is CANCELLED and its hook logged the stop. Seconds until the
    processes were gone."""
    job_dir = str(Path(job.log_path).parent)
    t0 = request_cancel(flow_run_id)
    while group_members(job.pgid) or processes_mentioning(job_dir):
        assert time.monotonic() - t0 < LOCAL_STOP_S, (f"processes of the job left {LOCAL_STOP_S} s after cancelling: "
                                            f"{group_members(job.pgid)} {processes_mentioning(job_dir)}")
        time.sleep(0.2)
    stopped_s = time.monotonic() - t0
    assert_cancelled(flow_run_id, job, f"stopped process group {job.pgid}")
    return stopped_s


@pytest.mark.timeout(300)
def test_cancelling_a_grpo_run_stops_its_training_step(process_worker, tiny_setup):
    # One round of one prompt; its training step takes num_iterations optimizer steps on the round's
    # two rollouts, milliseconds each on the tiny model: a million of them outlast the test by far.
    settings = tiny_setup.grpo_settings("flows-cancel-grpo", prompts_per_round=1, num_iterations=1_000_000,
                                       trainer_job="per_round")
    flow_run_id, job = start_until_submitted(tiny_setup, process_worker, GRPO, "flows-cancel-grpo", settings,
                                             "rounds/0000/train-job.json")
    assert job.name.startswith("flows-cancel-grpo-") and job.name.endswith("-step"), job.name
    wait_for_trainer(job, process_worker)
    stopped_s = cancel_and_check_stopped(flow_run_id, job)
    train_steps = [t for t in task_runs(flow_run_id) if t.name == "train-step-round-0"]
    assert len(train_steps) == 1 and not train_steps[0].state.is_completed(), train_steps
    assert not list(job.local_dir().glob("checkpoint-*")), "the step was not stopped before it saved"
    print(f"training step gone {stopped_s:.1f} s after the cancel request")


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                         timeout=20).stdout.split()
    return out[0] if out else ""
