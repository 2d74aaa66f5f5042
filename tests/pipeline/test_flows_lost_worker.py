"""A lost worker is recovered the Prefect way (docs/recovery.md): the worker and the flow runs it
started are killed mid-training (a nightly run training on Slurm, a GRPO run whose training step
runs locally); their heartbeats stop, the automation `posttrain prefect-setup` installs marks them
Crashed, and `prefect flow-run retry` alone, with a new worker, completes them: each retried run
finds its training job (still running, or done) instead of submitting another."""

from __future__ import annotations

import subprocess
import time

import pytest

from posttrain.runs.once import JobRecord
from tests.pipeline.conftest import GRPO, NIGHTLY
from tests.pipeline.runs import flow_run_logs, prefect_cli, read_flow_run, run_folder, wait_final
from tests.pipeline.test_flows_cancel import start_until_submitted
from tests.runs.test_training_slurm_2nodes import two_node_cluster

pytestmark = pytest.mark.slow

TIMEOUT_S = 45  # the automation's, for this test: heartbeats come every 30 s (prefect.yaml)


@pytest.fixture
def quick_crash():
    """The unresponsive-runs automation with a shorter timeout for this test; the default after it."""
    from posttrain.pipeline.deployments.unresponsive import install_unresponsive_runs_automation

    install_unresponsive_runs_automation(TIMEOUT_S)
    yield
    install_unresponsive_runs_automation()


def _slurm_block(tiny_setup, name: str) -> str:
    from posttrain.cluster import SlurmConfig
    from posttrain.pipeline.blocks import SlurmCluster

    SlurmCluster(settings=SlurmConfig(**{**two_node_cluster(tiny_setup.root), "nodes": 1})).save(name, overwrite=True)
    return f"posttrain-slurm-cluster/{name}"


def _wait_crashed(flow_run_id: str, timeout: float) -> float:
    """Seconds until the flow run is Crashed (it must not end otherwise)."""
    t0 = time.monotonic()
    while True:
        state = read_flow_run(flow_run_id).state
        if state.is_crashed():
            return time.monotonic() - t0
        assert not state.is_final(), f"{state.name}: {state.message}"
        assert time.monotonic() - t0 < timeout, f"still {state.name} {timeout} s after the worker was lost"
        time.sleep(1)


def _wait_logged(flow_run_id: str, line: str, timeout: float = 90) -> None:
    """Until the flow run's logs (written by a background writer, after its state) hold ``line``."""
    deadline = time.monotonic() + timeout
    while True:
        logs = "\n".join(flow_run_logs(flow_run_id))
        if line in logs:
            return
        assert time.monotonic() < deadline, f"{line!r} not logged:\n{logs[-3000:]}"
        time.sleep(1)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("slurm_cluster", "quick_crash")
def test_a_lost_worker_is_recovered_from_the_cli_and_the_retries_find_their_jobs(process_worker, tiny_setup):
    # A GRPO run of two rounds (each round's training step runs locally), then a nightly run on Slurm
    # that trains for ages (it is cancelled once recovered): both are mid-run when the worker is lost.
    grpo_id, grpo_job = start_until_submitted(
        tiny_setup, process_worker, GRPO, "flows-lost-local", tiny_setup.grpo_settings("flows-lost-local", rounds=2,
                                                                                       trainer_job="per_round"),
        "rounds/0000/train-job.json")
    slurm = _slurm_block(tiny_setup, "flows-lost-worker")
    nightly_id, nightly_job = start_until_submitted(
        tiny_setup, process_worker, NIGHTLY, "flows-lost-slurm",
        # no hot-loads: the GRPO run samples from the one inference server meanwhile
        tiny_setup.settings("flows-lost-slurm", cluster=slurm, inference=None, max_steps=100_000, save_steps=50),
        "training-job.json")
    assert (nightly_job.backend, grpo_job.backend) == ("slurm", "local")

    process_worker.lose()  # the worker and both flow runs' processes, at once: the jobs go on
    try:
        assert read_flow_run(nightly_id).state.is_running() and read_flow_run(grpo_id).state.is_running()
        refused = prefect_cli("flow-run", "retry", nightly_id)  # what the user met: Running, not retryable
        assert refused.returncode != 0 and "'RUNNING'" in refused.stdout + refused.stderr
    finally:
        process_worker.restart()  # whatever happens here, the tests after this one need a worker

    waited = [_wait_crashed(flow_run_id, TIMEOUT_S + 30 + 60) for flow_run_id in (nightly_id, grpo_id)]
    crashed = read_flow_run(nightly_id).state
    assert "No heartbeat" in (crashed.message or ""), crashed.message

    for flow_run_id in (nightly_id, grpo_id):
        retry = prefect_cli("flow-run", "retry", flow_run_id)
        assert retry.returncode == 0, retry.stdout + retry.stderr
    for flow_run_id, run, marker, job in ((nightly_id, "flows-lost-slurm", "training-job.json", nightly_job),
                                          (grpo_id, "flows-lost-local", "rounds/0000/train-job.json", grpo_job)):
        _wait_logged(flow_run_id, f"training job {job.job_id} was submitted before", timeout=120)
        again = JobRecord.model_validate_json((run_folder(tiny_setup, run, flow_run_id) / marker).read_text())
        assert again == job  # the same job: found, not submitted again
    final = wait_final(grpo_id, timeout=300)
    assert final.state.is_completed(), f"{final.state_name}: {final.state.message}\n{process_worker.tail()}"
    assert prefect_cli("flow-run", "cancel", nightly_id).returncode == 0  # the nightly trains for ages: stop it
    assert wait_final(nightly_id, timeout=120).state.is_cancelled()
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "--name", nightly_job.name, "-o", "JobID,State"],
                           capture_output=True, text=True, timeout=20).stdout.splitlines()
    assert [line.split("|")[0] for line in sacct] == [nightly_job.job_id], sacct  # one job, ever
    print(f"Crashed {waited[0]:.0f} s and {waited[1]:.0f} s after the worker was lost")
