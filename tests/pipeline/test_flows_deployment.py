"""The nightly deployment of prefect.yaml through a real Prefect server and a process worker:
a run completes, its schedule is registered, its enforced schema rejects bad parameters, and the
snapshots land in the store with the inference server serving the last one."""

from __future__ import annotations

import json

import pytest

from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import prefect_cli, run_deployment, wait_final

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_nightly_deployment_run_completes_and_serves_the_last_snapshot(process_worker, tiny_setup):
    proc, flow_run_id = run_deployment(NIGHTLY, tiny_setup.settings("flows-nightly"))
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    run = wait_final(flow_run_id)
    assert run.state.is_completed(), (f"{run.state_name}: {run.state.message}\n--- CLI\n{proc.stdout[-3000:]}"
                                      f"\n--- worker\n{process_worker.tail()}")
    assert proc.returncode == 0 and "Completed" in proc.stdout
    assert run.deployment_id is not None and str(run.parameters["run_name"]) == "flows-nightly"
    assert run.name.startswith("flows-nightly-"), run.name  # named from the run name, not at random

    # Both checkpoints published into the store (ledger of the run, every file of each snapshot)...
    run_name = f"flows-nightly-{flow_run_id.replace('-', '')[:8]}"  # each flow run works under its own name
    store = open_store(str(tiny_setup.store))
    try:
        entries = Ledger(store, run_name).entries()
        latest, _ = Ledger(store, run_name).latest()
    finally:
        store.close()
    assert [e.step for e in entries] == [1, 2]
    assert [e.kind for e in entries] == ["full", "delta"]
    for e in entries:
        for name, f in e.files.items():
            path = tiny_setup.store / e.identity / name
            assert path.is_file() and path.stat().st_size == f.size, path
    # ...and the deployment serves the last one.
    assert latest is not None and latest.identity == entries[-1].identity
    assert tiny_setup.served_identity() == entries[-1].identity

    # The run folder records the one training job.
    run_dir = tiny_setup.shared_dir / "runs" / run_name
    assert (run_dir / "training-job.json").is_file()
    assert (run_dir / "output" / "checkpoint-2").is_dir()

    # Its artifacts, keyed by the user-given run name: watch progress (done), the link to the
    # training logs, the snapshots table (a delta's % of full; a full snapshot says "full").
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [run.id]}))
    found = {(a.type, a.key): a for a in artifacts}
    assert len(found) == len(artifacts) == 3, [(a.type, a.key) for a in artifacts]  # one card per kind
    assert found[("progress", "flows-nightly-training-progress")].data == 100.0
    assert "log:" in str(found[("markdown", "flows-nightly-training-job")].data)
    table = json.loads(found[("table", "flows-nightly-nightly-snapshots")].data)
    assert [(r["step"], r["kind"]) for r in table] == [(1, "full"), (2, "delta")]
    assert table[0]["% of full"] == "full" and 0 < float(table[1]["% of full"]) < 100, table


@pytest.mark.timeout(420)
def test_two_nightly_runs_keep_one_key_per_kind_with_two_versions(process_worker, tiny_setup):
    """Artifact keys come from the deployment's run name: two nights are two versions of each key."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    run_ids = []
    for _ in range(2):
        proc, flow_run_id = run_deployment(NIGHTLY, tiny_setup.settings("flows-history"))
        assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
        run = wait_final(flow_run_id)
        assert run.state.is_completed(), f"{run.state_name}: {run.state.message}\n{process_worker.tail()}"
        assert run.name.startswith("flows-history-"), run.name
        run_ids.append(run.id)
    kinds = {"progress": "flows-history-training-progress", "markdown": "flows-history-training-job",
             "table": "flows-history-nightly-snapshots"}
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": run_ids}))
        history = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": list(kinds.values())}))
    keyed = [a for a in artifacts if a.key]
    assert {a.key for a in keyed} == set(kinds.values()), keyed
    for kind, key in kinds.items():
        versions = [a for a in keyed if a.key == key]
        assert all(a.type == kind for a in versions), versions
        assert sorted(str(a.flow_run_id) for a in versions) == sorted(str(i) for i in run_ids), (key, versions)
        # both nights are versions of the one key (with any earlier runs of this server)
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
        ({"run_name": "Nightly_Run"}, "'Nightly_Run' does not match '^[0-9a-z]([-0-9a-z]{0,34}[0-9a-z])?$'"),
        ({"max_steps": "many"}, "'many' is not of type 'integer'"),
        ({"max_steps": -5}, "-5 is less than the minimum of 1"),
        ({"dataset": "data/prompts.jsonl"}, "'data/prompts.jsonl' does not match '^/'"),
        ({"reward_funcs": ["correctness"]}, "'correctness' does not match"),
    ],
    ids=["unknown-field", "run-name-uppercase", "trainer-type", "bounds", "relative-path", "reward-function"],
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
