"""The nightly deployment of prefect.yaml through a real Prefect server and a process worker:
runs complete, the snapshots land in the store with the inference server serving the last one,
the runs' events and artifacts are recorded, its schedule is registered, and its enforced schema
rejects bad parameters."""

from __future__ import annotations

import json

import pytest

from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.run_events import assert_goodput_adds_up, assert_nightly_events
from tests.pipeline.runs import prefect_cli, run_deployment, wait_final
from tests.support.tensorboard import scalar_curves

pytestmark = pytest.mark.slow


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


@pytest.mark.timeout(420)
def test_two_nightly_deployment_runs_complete_and_serve_their_last_snapshot(process_worker, tiny_setup):
    """Two nights of one run name: each completes, publishes both checkpoints, serves the last one and
    records its events; artifact keys come from the run name, so the nights are two versions of each."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    runs = []
    for night in range(2):
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


def test_nightly_schedule_is_registered(deployed):
    """prefect.yaml's cron with its time zone. (The fixture pauses it after reading, so that a real
    02:00 run cannot start on this session's worker.)"""
    assert deployed.enforce_parameter_schema
    assert len(deployed.schedules) == 1
    s = deployed.schedules[0]
    assert s.schedule.cron == "0 2 * * *"
    assert s.schedule.timezone == "Europe/London"
    assert s.slug == "nightly-0200"
    assert s.active


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"unknown_field": 1},
         "The following parameters were specified but not found on the deployment: 'unknown_field'"),
        ({"run_name": "Nightly_Run"}, "'Nightly_Run' does not match '^[0-9a-z]([-0-9a-z]{0,34}[0-9a-z])?$"),
        ({"run_name": "nightly\n"}, "does not match '^[0-9a-z]([-0-9a-z]{0,34}[0-9a-z])?$"),
        ({"max_steps": "many"}, "'many' is not of type 'integer'"),
        ({"max_steps": -5}, "-5 is less than the minimum of 1"),
        ({"dataset": "data/prompts.jsonl"}, "'data/prompts.jsonl' does not match '^/'"),
        ({"reward_funcs": ["correctness"]}, "'correctness' does not match"),
    ],
    ids=["unknown-field", "run-name-uppercase", "run-name-final-newline", "trainer-type", "bounds", "relative-path", "reward-function"],
)
def test_enforced_schema_refuses_bad_parameters(deployed, tiny_setup, bad, message):
    """The server checks parameters against the flow's schema when the run is created: the CLI
    refuses, and no flow run exists to fail later on a worker."""
    settings = {**tiny_setup.settings("flows-bad"), **bad}
    proc = prefect_cli("deployment", "run", NIGHTLY, "--params", json.dumps(settings))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Error creating flow run: Validation failed for field" in out or "unknown_field" in bad
    assert message in " ".join(out.split()), out
    assert "Created flow run" not in out
