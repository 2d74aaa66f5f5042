"""A nightly run started while another is running waits for it (the deployment's concurrency limit,
collision strategy ENQUEUE) and says so: in the API its state is Scheduled, named
AwaitingConcurrencySlot; ``prefect deployment run --watch`` prints that state and goes on watching
until the run has really run; without --watch the command returns at once (exit 0) and the waiting
run can be withdrawn with ``prefect flow-run cancel``. Real Prefect server and process worker.

The run holding the slot is started as a user overrides a deployment: ``--param`` for the fields
to change, the deployment's values for the rest (checked in the job's trainer config). Cancelling
it stops its local trainer (test_flows_cancel.cancel_and_check_stopped).

The run that waited is the first of two nights of one run name, the nightly deployment's runs through
a process worker: each completes, publishes both checkpoints, serves the last one and records its
events; artifact keys come from the run name, so the nights are two versions of each. (One test: the
waiting run was a full nightly run of its own besides two nights that did not wait.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from posttrain.trainer.config import TrainerConfig
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.run_events import assert_goodput_adds_up, assert_nightly_events
from tests.pipeline.runs import (
    REPO,
    deployment_run_args,
    flow_run_id_in,
    flow_run_logs,
    prefect_cli,
    read_flow_run,
    run_deployment,
    run_folder,
    start_deployment,
    wait_final,
    wait_submitted,
)
from tests.pipeline.test_flows_cancel import cancel_and_check_stopped, wait_for_trainer
from tests.support.tensorboard import scalar_curves

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


def run_nightly(setup, worker, run: str):
    """A nightly deployment run of ``run`` to completion; its flow run."""
    proc, flow_run_id = run_deployment(NIGHTLY, setup.settings(run))
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    found = wait_final(flow_run_id)
    assert found.state.is_completed(), (f"{found.state_name}: {found.state.message}\n--- CLI\n{proc.stdout[-3000:]}"
                                        f"\n--- worker\n{worker.tail()}")
    assert proc.returncode == 0 and "Completed" in proc.stdout
    assert found.deployment_id is not None and str(found.parameters["run_name"]) == run
    assert found.name.startswith(f"{run}-"), found.name  # named from the run name, not at random
    return found


def ledger_entries(setup, run_name: str) -> list:
    store = open_store(str(setup.store))
    try:
        return Ledger(store, run_name).entries()
    finally:
        store.close()


def flow_run_artifacts(*flow_run_ids) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": list(flow_run_ids)}))


def wait_for_the_slot(tiny_setup, process_worker, run: str, tmp_path):
    """A nightly run of run name ``run`` started (and watched, as a user would) while another holds the
    deployment's slot: it waits, says so, and completes once the other is cancelled. Its flow run."""
    first, job = start_with_overrides(tiny_setup, process_worker)
    wait_for_trainer(job, process_worker)

    watched = tmp_path / "watch.out"
    second = None
    with open(watched, "w") as out:  # the second run, started and watched as a user would
        watch = subprocess.Popen(
            [sys.executable, "-m", "prefect",
             *deployment_run_args(NIGHTLY, tiny_setup.settings(run), watch_timeout=360)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (second := flow_run_id_in(watched.read_text())):
            assert watch.poll() is None and time.monotonic() < deadline, watched.read_text()
            time.sleep(0.2)
        waiting = wait_state_name(second, WAITING)
        assert waiting.state.is_scheduled()
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
    assert second_run.deployment_id is not None and str(second_run.parameters["run_name"]) == run
    assert second_run.name.startswith(f"{run}-"), second_run.name  # named from the run name, not at random
    return second_run


@pytest.mark.timeout(660)
def test_a_nightly_started_during_another_waits_for_the_slot_then_two_nights_serve_their_last_snapshot(
        process_worker, tiny_setup, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    runs = []
    for night in range(2):
        if night == 0:
            run = wait_for_the_slot(tiny_setup, process_worker, "flows-nightly", tmp_path)
        else:
            run = run_nightly(tiny_setup, process_worker, "flows-nightly")
        runs.append(run)
        # Both checkpoints published into the store (ledger of the run, every file of each snapshot)...
        run_name = f"flows-nightly-{str(run.id).replace('-', '')[:8]}"  # each flow run works under its own name
        entries = ledger_entries(tiny_setup, run_name)
        assert [(e.step, e.kind) for e in entries] == [(1, "full"), (2, "delta")]
        for e in entries:
            for name, f in e.files.items():
                path = tiny_setup.store / e.identity / name
                assert path.is_file() and path.stat().st_size == f.size, path
        # ...and the deployment serves the last one.
        assert tiny_setup.served_identity() == entries[-1].identity
        if night:
            continue
        store = open_store(str(tiny_setup.store))
        try:
            latest, _ = Ledger(store, run_name).latest()
        finally:
            store.close()
        assert latest is not None and latest.identity == entries[-1].identity
        # The run folder records the one training job; the run's events tell the same story.
        run_dir = tiny_setup.shared_dir / "runs" / run_name
        assert (run_dir / "training-job.json").is_file()
        assert (run_dir / "output" / "checkpoint-2").is_dir()
        # report_to: tensorboard (the default): TRL's curves in the run folder, one point per step.
        curves = scalar_curves(run_dir / "tensorboard")
        assert [s for s, _ in curves["train/loss"]] == [s for s, _ in curves["train/reward"]] == [1, 2], curves
        assert_nightly_events(tiny_setup, str(run.id), run_name, entries)

        # Its artifacts, keyed by the user-given run name: watch progress (done), the link to the
        # training logs, where the training curves are, the snapshots table (a delta's % of full; a
        # full snapshot says "full"), the goodput.
        artifacts = flow_run_artifacts(run.id)
        found = {(a.type, a.key): a for a in artifacts}
        assert len(found) == len(artifacts) == 5, [(a.type, a.key) for a in artifacts]  # one card per kind
        metrics = str(found[("markdown", "flows-nightly-training-metrics")].data)
        assert f"`tensorboard --logdir {run_dir / 'tensorboard'}`" in metrics, metrics
        assert found[("progress", "flows-nightly-training-progress")].data == 100.0
        assert "log:" in str(found[("markdown", "flows-nightly-training-job")].data)
        table = json.loads(found[("table", "flows-nightly-snapshots")].data)
        assert [(r["step"], r["kind"]) for r in table] == [(1, "full"), (2, "delta")]
        assert table[0]["% of full"] == "full" and 0 < float(table[1]["% of full"]) < 100, table
        # The goodput (docs/goodput.md) adds up to the flow run's wall time within 2%, from measured parts.
        seconds = assert_goodput_adds_up(run.id, found[("table", "flows-nightly-goodput")])
        assert min(seconds["queue"], seconds["startup"], seconds["training"], seconds["checkpoint"]) > 0, seconds
        assert seconds["lost"] == 0 and seconds["orchestration"] > 0, seconds

    kinds = {"progress": "flows-nightly-training-progress", "markdown": "flows-nightly-training-job",
             "table": "flows-nightly-snapshots", "goodput": "flows-nightly-goodput"}
    run_ids = [r.id for r in runs]
    keyed = [a for a in flow_run_artifacts(*run_ids) if a.key]
    with get_client(sync_client=True) as client:
        # Looked up by key, narrowed to these runs: the server's default page (200) would otherwise cut
        # off a suite's worth of earlier nights.
        history = client.read_artifacts(artifact_filter=ArtifactFilter(
            key={"any_": list(kinds.values())}, flow_run_id={"any_": run_ids}))
    assert {a.key for a in keyed} == {*kinds.values(), "flows-nightly-training-metrics"}, keyed
    for kind, key in kinds.items():
        versions = [a for a in keyed if a.key == key]
        assert all(a.type == ("table" if kind == "goodput" else kind) for a in versions), versions
        assert sorted(str(a.flow_run_id) for a in versions) == sorted(str(i) for i in run_ids), (key, versions)
        # both nights are versions of the one key
        assert {a.id for a in versions} <= {a.id for a in history if a.key == key}
