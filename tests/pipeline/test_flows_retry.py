"""A nightly deployment run that fails after training and publishing records the failed hot-load as
an event, for which the example automation (automations/hotload-failed.yaml) sends a notification;
retried the way the UI does (``prefect flow-run retry``), it completes without training again or
uploading again. (One run for both: the events test and the retry test each paid for the same failing
run. Installing that automation file: test_automations_install.py.)

The failure is a real one: the reference inference server is asked (its fault route) to fail the
first incremental hot-load, which is the last checkpoint's, and the run's inference block does not
fall back to a full snapshot, so the hot-load task fails without a retry and the flow run with it."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from posttrain.inference.protocol import TYPE_INCREMENTAL
from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from tests.pipeline.conftest import DEPLOYMENT_ID, MODEL_NAME, NIGHTLY
from tests.pipeline.run_events import (
    create_automation,
    delete_automation,
    named,
    related_ids,
    wait_events,
    webhook,
)
from tests.pipeline.runs import (
    flow_run_logs,
    prefect_cli,
    run_deployment,
    task_runs,
    wait_final,
    wait_not_final,
)

pytestmark = pytest.mark.slow

RUN = "flows-retry"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
NO_FALLBACK = "posttrain-inference-deployment/flows-retry"  # the server's deployment, without fallback to full
FAULT_REASON = "injected: the last hot-load of the run fails"
AUTOMATION = Path(__file__).resolve().parents[2] / "automations" / "hotload-failed.yaml"


def instance(flow_run_id: str) -> str:
    """The run name a flow run works under: the settings' name plus its flow run's id."""
    return f"{RUN}-{flow_run_id.replace('-', '')[:8]}"


@pytest.fixture
def failing_last_hot_load(tiny_setup):
    """The inference block NO_FALLBACK, and the server armed to fail the next incremental hot-load once."""
    from posttrain.pipeline.blocks import InferenceDeployment

    InferenceDeployment(api_url=tiny_setup.server.url, gateway_url=tiny_setup.server.url,
                        deployment_id=DEPLOYMENT_ID, model=MODEL_NAME, token=tiny_setup.token, timeout_s=300,
                        poll_interval_s=0.2, fallback_to_full=False).save(NO_FALLBACK.split("/")[1], overwrite=True)
    pending = tiny_setup.add_faults({"kind": "fail_hotload", "snapshot_type": TYPE_INCREMENTAL,
                                     "reason": FAULT_REASON})
    assert [f["kind"] for f in pending] == ["fail_hotload"]
    try:
        yield NO_FALLBACK
    finally:
        tiny_setup.clear_faults()


@pytest.fixture
def hotload_failed_automation(tmp_path):
    """The example automation, its notification block a webhook on this machine: what it received."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    with webhook() as (url, received):
        block_id = CustomWebhookNotificationBlock(
            name="posttrain-events-test", url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"},
        ).save("posttrain-events-test", overwrite=True)
        spec = yaml.safe_load(AUTOMATION.read_text())
        spec["actions"][0]["block_document_id"] = str(block_id)
        path = tmp_path / "hotload-failed.yaml"
        path.write_text(yaml.safe_dump(spec))
        automation = create_automation(path)
        try:
            yield received
        finally:
            delete_automation(automation)


def assert_failure_recorded_and_notified(setup, flow_run_id: str, name: str, entries: list, received: list) -> None:
    """The failed hot-load's event (one attempt, not retried), step 1's hot-load before it, and the
    automation's notification naming the snapshot and carrying the error."""
    events = wait_events(flow_run_id, lambda ev: named(ev, "posttrain.hotload.failed"))
    (failed,) = named(events, "posttrain.hotload.failed")  # not retried: one attempt, one event
    assert failed.resource.id == f"posttrain.block.{NO_FALLBACK.replace('/', '.')}"
    assert failed.resource["posttrain.snapshot"] == entries[1].identity
    assert failed.resource["posttrain.will-retry"] == "false" and failed.payload["will_retry"] is False
    assert FAULT_REASON in failed.payload["error"] and failed.payload["error_type"]
    assert setup.token not in json.dumps(failed.payload)
    assert {f"posttrain.snapshot.{entries[1].identity}", f"posttrain.run.{name}"} <= related_ids(failed)
    (succeeded,) = named(events, "posttrain.hotload.succeeded")  # step 1, before the fault
    assert succeeded.resource["posttrain.snapshot"] == entries[0].identity
    deadline = time.monotonic() + 60
    while not any(entries[1].identity in n.get("subject", "") for n in received):
        assert time.monotonic() < deadline, f"no notification in 60 s: {received}"
        time.sleep(0.5)
    (note,) = [n for n in received if entries[1].identity in n.get("subject", "")]
    assert FAULT_REASON in note["body"] and name in note["body"], note


def _ledger(setup, name: str) -> list:
    store = open_store(str(setup.store))
    try:
        return Ledger(store, name).entries()
    finally:
        store.close()


def _store_files(setup, entries) -> dict[str, int]:
    """mtime_ns of every file of the run's snapshots and ledger entries."""
    files = [setup.store / e.identity / name for e in entries for name in e.files]
    files += sorted((setup.store / ".posttrain" / "runs" / entries[0].run / "ledger").glob("*.json"))
    return {str(p): p.stat().st_mtime_ns for p in files}


@pytest.mark.timeout(420)
def test_failed_run_notifies_and_retried_from_the_cli_completes_without_retraining_or_reuploading(
        process_worker, tiny_setup, failing_last_hot_load, hotload_failed_automation):
    # 1. The run fails once, after training and publishing every checkpoint: the server fails the
    #    hot-load of the last one (the first delta; the first checkpoint is a full snapshot).
    settings = tiny_setup.settings(RUN, inference=failing_last_hot_load)
    proc, flow_run_id = run_deployment(NIGHTLY, settings, env=ENV)
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    name = instance(flow_run_id)
    run_dir = tiny_setup.shared_dir / "runs" / name
    first = wait_final(flow_run_id)
    assert first.state.is_failed(), f"{first.state_name}: {first.state.message}\n{process_worker.tail()}"
    assert FAULT_REASON in (first.state.message or ""), first.state.message
    assert tiny_setup.pending_faults() == []  # the fault fired, once
    job = json.loads((run_dir / "training-job.json").read_text())
    entries = _ledger(tiny_setup, name)
    assert [(e.step, e.kind) for e in entries] == [(1, "full"), (2, "delta")]  # published before the fault
    assert tiny_setup.served_identity() == entries[0].identity  # the failed delta left step 1 serving
    files = _store_files(tiny_setup, entries)
    published_at = {e.identity: e.published_at for e in entries}
    assert_failure_recorded_and_notified(tiny_setup, flow_run_id, name, entries, hotload_failed_automation)

    # 2. Retry it as the UI does: same flow run, scheduled again, picked up by the worker.
    retried_at = datetime.now(UTC)
    retry = prefect_cli("flow-run", "retry", flow_run_id)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "scheduled for retry" in " ".join(retry.stdout.split())
    wait_not_final(flow_run_id)
    second = wait_final(flow_run_id)
    assert second.state.is_completed(), f"{second.state_name}: {second.state.message}\n{process_worker.tail()}"
    assert second.id == first.id and second.run_count == 2
    # Named for its run name, day and short id (that of its run folder), and the retry keeps the name.
    assert first.name == f"{RUN}-{first.expected_start_time:%Y-%m-%d}-{name.removeprefix(RUN + '-')}", first.name
    assert second.name == first.name

    # Its progress artifact: the first attempt's, updated in place to 100% (no stale copy).
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [second.id]}))
    progress = [a for a in artifacts if a.type == "progress"]
    assert [(a.key, a.data) for a in progress] == [(f"{RUN}-training-progress", 100.0)], progress
    keyed = sorted((a.type, a.key) for a in artifacts if a.key)
    assert keyed == [("markdown", f"{RUN}-training-job"), ("markdown", f"{RUN}-training-metrics"),
                     ("progress", f"{RUN}-training-progress"), ("table", f"{RUN}-goodput"),
                     ("table", f"{RUN}-snapshots")], artifacts

    # 3. Training was not submitted again: same job, one job folder, one trainer result.
    assert json.loads((run_dir / "training-job.json").read_text()) == job
    job_folders = sorted(p.name for p in tiny_setup.jobs_dir.iterdir() if p.name.startswith(f"{name}-"))
    assert len(job_folders) == 1, job_folders
    results = sorted((run_dir / "output" / ".posttrain").glob("*.results.jsonl"))
    assert len(results) == 1, results
    lines = [json.loads(line) for line in results[0].read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0]["completed"] and lines[0]["global_step"] == 2

    # 4. Nothing was uploaded again: same snapshots, same files untouched, same ledger entries.
    after = _ledger(tiny_setup, name)
    assert [e.identity for e in after] == [e.identity for e in entries]
    assert {e.identity: e.published_at for e in after} == published_at
    assert _store_files(tiny_setup, after) == files
    assert tiny_setup.served_identity() == entries[-1].identity

    # 5. The retried attempt ran the publish tasks again, and they uploaded nothing.
    deadline = time.monotonic() + 60  # the flow run's process sends its last logs as it exits
    logs = flow_run_logs(flow_run_id, since=retried_at)
    while not any("checkpoints published" in m for m in logs):
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)
        logs = flow_run_logs(flow_run_id, since=retried_at)
    assert any(f"training job {job['job_id']} was submitted before" in m for m in logs), logs
    published = [m for m in logs if m.startswith("published ")]
    assert len(published) == 2, logs
    assert all(re.search(r"uploaded 0(;|$)", m) for m in published), published
    assert any(f"nightly run {name}: 2 checkpoints published, final step 2" in m for m in logs), logs
    names = [t.name for t in task_runs(flow_run_id)]
    assert names.count(f"submit-{name}") == 2  # one per attempt; the second found the marker
    assert names.count("publish-step-1") == 2 and names.count("publish-step-2") == 2
    # step 1 was hot-loaded by the first attempt only; step 2 failed there and loaded on the retry
    hot_loads = [n for n in names if n.startswith("hot-load-")]
    assert sorted(hot_loads) == sorted([f"hot-load-{entries[0].identity}"] + [f"hot-load-{entries[1].identity}"] * 2)
