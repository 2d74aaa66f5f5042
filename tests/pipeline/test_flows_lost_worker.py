"""A lost worker is recovered the Prefect way (docs/recovery.md): the worker and the flow runs it
started are killed mid-training (a nightly run training on Slurm, a GRPO run whose training step
runs locally); their heartbeats stop, the automation `posttrain prefect-setup` installs marks them
Crashed, and `posttrain recover`, running beside the worker, sets them AwaitingRetry: with a new
worker, and no person, they complete, each retried run finding its training job (still running, or
done) instead of submitting another."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from posttrain.pipeline.deployments.recovery import RETRY_MARK
from posttrain.runs.once import JobRecord
from tests.pipeline.conftest import GRPO, NIGHTLY
from tests.pipeline.runs import flow_run_logs, prefect_cli, read_flow_run, run_folder, wait_final
from tests.pipeline.test_flows_cancel import start_until_submitted
from tests.runs.test_training_slurm_2nodes import two_node_cluster

pytestmark = pytest.mark.slow

TIMEOUT_S = 45  # the automation's, for this test: heartbeats come every 30 s (prefect.yaml)
TAG = "lost-worker-test"  # this test's runs: the sweeper started here retries no other test's


@pytest.fixture
def quick_crash(tiny_setup):
    """The unresponsive-runs automation with a shorter timeout for this test, the default after it;
    `posttrain recover` sweeping every 2 s, for this test's runs only."""
    from posttrain.pipeline.deployments.unresponsive import install_unresponsive_runs_automation

    install_unresponsive_runs_automation(TIMEOUT_S)
    log = tiny_setup.root / "recover.log"
    with log.open("w") as out:
        sweeper = subprocess.Popen([sys.executable, "-m", "posttrain", "recover", "--every", "2", "--tag", TAG],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        sweeper.terminate()
        sweeper.wait(30)
        install_unresponsive_runs_automation()


def _slurm_block(tiny_setup, name: str) -> str:
    from posttrain.cluster import SlurmConfig
    from posttrain.pipeline.blocks import SlurmCluster

    SlurmCluster(settings=SlurmConfig(**{**two_node_cluster(tiny_setup.root), "nodes": 1})).save(name, overwrite=True)
    return f"posttrain-slurm-cluster/{name}"


def _states(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run_states(flow_run_id)


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
@pytest.mark.usefixtures("slurm_cluster")
def test_a_lost_worker_is_recovered_without_a_person_and_the_retries_find_their_jobs(process_worker, tiny_setup,
                                                                                    quick_crash):
    # A GRPO run of two rounds (each round's training step runs locally), then a nightly run on Slurm
    # that trains for ages (it is cancelled once recovered): both are mid-run when the worker is lost.
    grpo_id, grpo_job = start_until_submitted(
        tiny_setup, process_worker, GRPO, "flows-lost-local", tiny_setup.grpo_settings("flows-lost-local", rounds=2,
                                                                                       trainer_job="per_round"),
        "rounds/0000/train-job.json", tags=(TAG,))
    slurm = _slurm_block(tiny_setup, "flows-lost-worker")
    nightly_id, nightly_job = start_until_submitted(
        tiny_setup, process_worker, NIGHTLY, "flows-lost-slurm",
        # no hot-loads: the GRPO run samples from the one inference server meanwhile
        tiny_setup.settings("flows-lost-slurm", cluster=slurm, inference=None, max_steps=100_000, save_steps=50),
        "training-job.json", tags=(TAG,))
    assert (nightly_job.backend, grpo_job.backend) == ("slurm", "local")

    lost = time.monotonic()
    process_worker.lose()  # the worker and both flow runs' processes, at once: the jobs go on
    try:
        assert read_flow_run(nightly_id).state.is_running() and read_flow_run(grpo_id).state.is_running()
        refused = prefect_cli("flow-run", "retry", nightly_id)  # what the user met: Running, not retryable
        assert refused.returncode != 0 and "'RUNNING'" in refused.stdout + refused.stderr
    finally:
        process_worker.restart()  # whatever happens here, the tests after this one need a worker

    for flow_run_id, run, marker, job in ((nightly_id, "flows-lost-slurm", "training-job.json", nightly_job),
                                          (grpo_id, "flows-lost-local", "rounds/0000/train-job.json", grpo_job)):
        # Crashed after the heartbeat timeout (+ up to one heartbeat + the trigger's evaluation), retried
        # at once, then picked up by the new worker: no `prefect flow-run retry`
        _wait_logged(flow_run_id, f"training job {job.job_id} was submitted before", timeout=TIMEOUT_S + 30 + 180)
        names = [(state.name, state.message or "") for state in _states(flow_run_id)]
        assert any(n == "Crashed" and "No heartbeat" in m for n, m in names), names
        assert any(n == "AwaitingRetry" and m.startswith(RETRY_MARK) for n, m in names), names
        again = JobRecord.model_validate_json((run_folder(tiny_setup, run, flow_run_id) / marker).read_text())
        assert again == job  # the same job: found, not submitted again
    said = quick_crash.read_text()  # what the sweeper printed: each retry, naming the run
    assert all(f"({flow_run_id}): {RETRY_MARK} retry 1 of at most 3" in said for flow_run_id in (nightly_id, grpo_id)), said
    final = wait_final(grpo_id, timeout=300)
    assert final.state.is_completed(), f"{final.state_name}: {final.state.message}\n{process_worker.tail()}"
    assert prefect_cli("flow-run", "cancel", nightly_id).returncode == 0  # the nightly trains for ages: stop it
    assert wait_final(nightly_id, timeout=120).state.is_cancelled()
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "--name", nightly_job.name, "-o", "JobID,State"],
                           capture_output=True, text=True, timeout=20).stdout.splitlines()
    assert [line.split("|")[0] for line in sacct] == [nightly_job.job_id], sacct  # one job, ever
    print(f"recovered without a person {time.monotonic() - lost:.0f} s after the worker was lost")
