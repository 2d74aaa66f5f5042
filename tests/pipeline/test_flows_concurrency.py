"""A nightly run started while another is running waits for it (the deployment's concurrency limit,
collision strategy ENQUEUE) and says so: in the API its state is Scheduled, named
AwaitingConcurrencySlot; ``prefect deployment run --watch`` prints that state and goes on watching
until the run has really run; without --watch the command returns at once (exit 0) and the waiting
run can be withdrawn with ``prefect flow-run cancel``. Real Prefect server and process worker.

The run holding the slot is started as a user overrides a deployment: ``--param`` for the fields
to change, the deployment's values for the rest (checked in the job's trainer config). Cancelling
it stops its local trainer (test_flows_cancel.cancel_and_check_stopped)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from posttrain.trainer.config import TrainerConfig
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import (
    REPO,
    deployment_run_args,
    flow_run_id_in,
    flow_run_logs,
    prefect_cli,
    read_flow_run,
    run_folder,
    start_deployment,
    wait_final,
    wait_submitted,
)
from tests.pipeline.test_flows_cancel import cancel_and_check_stopped, wait_for_trainer

pytestmark = pytest.mark.slow

WAITING = "AwaitingConcurrencySlot"


def wait_state_name(flow_run_id: str, name: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        run = read_flow_run(flow_run_id)
        if run.state_name == name:
            return run
        assert not run.state.is_final(), f"{run.state_name}: {run.state.message}"
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {run.state_name} after {timeout} s"
        time.sleep(0.3)


# The fields the first run overrides: a learning rate, and a run that outlasts the test.
OVERRIDES = {"learning_rate": 5e-5, "max_steps": 100000, "save_steps": 100000}


def start_with_overrides(setup, worker) -> tuple[str, object]:
    """``prefect deployment run nightly --param k=v`` for each of OVERRIDES; once its job is
    submitted, checks that the job's trainer config has those values and the deployment's for the
    rest. The flow run id and the job's record."""
    params = [arg for k, v in OVERRIDES.items() for arg in ("--param", f"{k}={v}")]
    proc = prefect_cli("deployment", "run", NIGHTLY, *params)
    first = flow_run_id_in(proc.stdout)
    assert proc.returncode == 0 and first, proc.stdout + proc.stderr
    try:
        return first, _check_overrides(setup, worker, first)
    except BaseException:
        # a run that outlasts the test holds the nightly deployment's one slot: every later nightly would wait
        prefect_cli("flow-run", "cancel", first)
        raise


def _check_overrides(setup, worker, first: str):
    deployment = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]
    assert set(read_flow_run(first).parameters) == set(deployment["parameters"]) | set(OVERRIDES)
    job = wait_submitted(setup, worker, "nightly", first)
    received = yaml.safe_load((REPO / job.log_path).parent.joinpath("trainer.yaml").read_text())
    expected = TrainerConfig(
        mode="grpo", model_name_or_path=str(setup.base_model), output_dir=run_folder(setup, "nightly", first) / "output",
        dataset_manifest=received["dataset_manifest"],
        # the run's training curves: its TensorBoard folder, and the run's own name for the trackers
        logging_dir=run_folder(setup, "nightly", first) / "tensorboard", run_name=run_folder(setup, "nightly", first).name,
        reward_funcs=["posttrain.rewards:correctness_reward"],  # prefect.yaml
        **OVERRIDES,
    )
    assert TrainerConfig.model_validate(received) == expected  # and TRL's defaults for the rest
    assert deployment["parameters"]["max_steps"] != OVERRIDES["max_steps"]
    return job


@pytest.mark.timeout(480)
def test_a_nightly_started_during_another_waits_for_the_slot(process_worker, tiny_setup, tmp_path):
    first, job = start_with_overrides(tiny_setup, process_worker)
    wait_for_trainer(job, process_worker)

    watched = tmp_path / "watch.out"
    second = None
    with open(watched, "w") as out:  # the second run, started and watched as a user would
        watch = subprocess.Popen(
            [sys.executable, "-m", "prefect",
             *deployment_run_args(NIGHTLY, tiny_setup.settings("flows-limit-second"), watch_timeout=360)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (second := flow_run_id_in(watched.read_text())):
            assert watch.poll() is None and time.monotonic() < deadline, watched.read_text()
            time.sleep(0.2)
        run = wait_state_name(second, WAITING)
        assert run.state.is_scheduled()
        # the worker tried, and says in the run's logs why it did not start it (logs arrive in batches)
        deadline = time.monotonic() + 60
        while "Server returned a non-pending state 'SCHEDULED'" not in (logs := "\n".join(flow_run_logs(second))):
            assert time.monotonic() < deadline, logs
            time.sleep(0.5)

        # a third, not watched: the command returns at once and the run waits too; cancelling it
        # withdraws it without ever starting it
        proc, third = start_deployment(NIGHTLY, tiny_setup.settings("flows-limit-third"))
        assert proc.returncode == 0 and third, proc.stdout + proc.stderr
        assert "Created flow run" in proc.stdout
        wait_state_name(third, WAITING)
        cancel = prefect_cli("flow-run", "cancel", third)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        third_run = wait_final(third, timeout=120)
        assert third_run.state.is_cancelled() and third_run.run_count == 0  # it never ran

        assert watch.poll() is None, watched.read_text()  # still watching the waiting run
        assert read_flow_run(second).state_name == WAITING
        stopped_s = cancel_and_check_stopped(first, job)  # the first ends, its trainer stopped: the slot frees
        print(f"trainer of the first run gone {stopped_s:.1f} s after the cancel request")
        first_run = read_flow_run(first)
        rc = watch.wait(timeout=300)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        for run_id in (first, second):  # a failed check must not leave a run holding the deployment's slot
            if run_id and not read_flow_run(run_id).state.is_final():
                prefect_cli("flow-run", "cancel", run_id)
    printed = watched.read_text()
    print(printed)
    assert rc == 0, f"{printed}\n{process_worker.tail()}"
    assert f"prefect.flow-run.{WAITING}" in printed
    assert "prefect.flow-run.Running" in printed
    assert "Flow run finished successfully in 'Completed'" in printed
    second_run = read_flow_run(second)
    assert second_run.state.is_completed()
    assert second_run.start_time >= first_run.end_time  # never two at once
