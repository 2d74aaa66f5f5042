"""Prefect events of nightly deployment runs, read back from the server: a run that completes
records its job's submission and completion, each snapshot published and each hot-load (checked on
the run of test_flows_deployment.py, ``assert_nightly_events``); a run whose hot-load fails records
the failure, and the example automation (automations/hotload-failed.yaml) sends a notification for it
(installing that file: test_automations_install.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from posttrain.inference.protocol import TYPE_INCREMENTAL
from posttrain.publish.ledger import Ledger
from posttrain.storage import open_store
from tests.pipeline.conftest import DEPLOYMENT_ID, MODEL_NAME, NIGHTLY
from tests.pipeline.run_events import named, related_ids, wait_events
from tests.pipeline.runs import prefect_cli, run_deployment, wait_final

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
AUTOMATION = REPO / "automations" / "hotload-failed.yaml"
NO_FALLBACK = "posttrain-inference-deployment/flows-events"
FAULT_REASON = "injected: the delta hot-load of the events test fails"


def instance(run: str, flow_run_id: str) -> str:
    return f"{run}-{flow_run_id.replace('-', '')[:8]}"


def ledger(setup, name: str) -> list:
    store = open_store(str(setup.store))
    try:
        return Ledger(store, name).entries()
    finally:
        store.close()


def assert_nightly_events(setup, flow_run_id: str, name: str, entries: list) -> None:
    """The events of a completed nightly run (``name``: its run folder's name; ``entries``: its
    ledger): the job submitted then completed, each snapshot published once, each hot-load.
    Called by the nightly deployment test of test_flows_deployment.py on its run."""
    events = wait_events(flow_run_id, lambda ev: len(named(ev, "posttrain.hotload.succeeded")) == len(entries)
                         and named(ev, "posttrain.job.completed"))
    run_id = f"posttrain.run.{name}"
    flow_run = f"prefect.flow-run.{flow_run_id}"
    assert all(flow_run in related_ids(e) for e in events)  # attached by Prefect inside the run

    # The job: submitted, then completed (before the last checkpoints' events, or after: watched).
    (submitted,), (completed,) = named(events, "posttrain.job.submitted"), named(events, "posttrain.job.completed")
    job = json.loads((setup.shared_dir / "runs" / name / "training-job.json").read_text())
    for e in (submitted, completed):
        assert e.resource.id == f"posttrain.job.local.{job['job_id']}"
        assert e.payload["job_id"] == job["job_id"] and e.payload["backend"] == "local"
        assert e.payload["run_name"] == name and run_id in related_ids(e)
    assert submitted.occurred <= completed.occurred
    assert named(events, "posttrain.job.failed") == []

    # Each snapshot published, once: its identity, step, kind, size and store block.
    published = named(events, "posttrain.snapshot.published")
    assert [e.resource.id for e in published] == [f"posttrain.snapshot.{e.identity}" for e in entries]
    for e, entry in zip(published, entries, strict=True):
        assert e.resource.name == entry.identity
        assert (e.payload["step"], e.payload["kind"]) == (entry.step, entry.kind)
        assert e.payload["stored_bytes"] > 0 and e.payload["store"] == "posttrain-object-store/default"
        assert 0 < e.payload["publish_lag_seconds"] < 600  # from the checkpoint's save to its publication
        assert {run_id, "posttrain.block.posttrain-object-store.default"} <= related_ids(e)
        assert any(r.id.startswith("prefect.task-run.") for r in e.related)

    # Each hot-load: the deployment block serving the snapshot.
    loaded = named(events, "posttrain.hotload.succeeded")
    for e, entry in zip(loaded, entries, strict=True):
        assert e.resource.id == "posttrain.block.posttrain-inference-deployment.default"
        assert e.resource["posttrain.snapshot"] == entry.identity
        assert e.resource["posttrain.deployment-id"] == DEPLOYMENT_ID
        assert e.payload["identity"] == entry.identity and not e.payload["fell_back"]
        assert {f"posttrain.snapshot.{entry.identity}", run_id} <= related_ids(e)


class Notifications(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    """A local HTTP endpoint recording what notifications post to it: (url, received)."""
    received: list[dict] = []
    handler = type("Handler", (Notifications,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/notify", received
    finally:
        server.shutdown()


def create_automation(path: Path):
    """``prefect automation create --from-file path``; the automation as the server has it."""
    from prefect import get_client

    name = yaml.safe_load(path.read_text())["name"]
    with get_client(sync_client=True) as client:
        for left in client.read_automations_by_name(name):  # from an interrupted session
            client.delete_automation(left.id)
    created = prefect_cli("automation", "create", "--from-file", str(path))
    assert created.returncode == 0, created.stdout + created.stderr
    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name(name)
    return automation


def delete_automation(automation) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.delete_automation(automation.id)
        assert client.read_automations_by_name(automation.name) == []


@pytest.fixture
def failing_delta_hot_load(tiny_setup):
    """An inference block without fallback to full, and the server armed to fail the next delta hot-load."""
    from posttrain.pipeline.blocks import InferenceDeployment

    InferenceDeployment(api_url=tiny_setup.server.url, gateway_url=tiny_setup.server.url,
                        deployment_id=DEPLOYMENT_ID, model=MODEL_NAME, token=tiny_setup.token, timeout_s=300,
                        poll_interval_s=0.2, fallback_to_full=False).save(NO_FALLBACK.split("/")[1], overwrite=True)
    tiny_setup.add_faults({"kind": "fail_hotload", "snapshot_type": TYPE_INCREMENTAL, "reason": FAULT_REASON})
    try:
        yield NO_FALLBACK
    finally:
        tiny_setup.clear_faults()


@pytest.mark.timeout(300)
def test_a_failed_hot_load_records_an_event_and_the_automation_notifies(process_worker, tiny_setup, webhook,
                                                                       failing_delta_hot_load, tmp_path):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    # The example automation, its notification block a webhook on this machine.
    url, received = webhook
    block_id = CustomWebhookNotificationBlock(
        name="posttrain-events-test", url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save("posttrain-events-test", overwrite=True)
    spec = yaml.safe_load(AUTOMATION.read_text())
    spec["actions"][0]["block_document_id"] = str(block_id)
    path = tmp_path / "hotload-failed.yaml"
    path.write_text(yaml.safe_dump(spec))
    automation = create_automation(path)
    try:
        settings = tiny_setup.settings("flows-events-fail", inference=failing_delta_hot_load)
        proc, flow_run_id = run_deployment(NIGHTLY, settings)
        assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
        run = wait_final(flow_run_id)
        assert run.state.is_failed(), f"{run.state_name}: {run.state.message}\n{process_worker.tail()}"
        assert FAULT_REASON in (run.state.message or "")
        name = instance("flows-events-fail", flow_run_id)
        entries = ledger(tiny_setup, name)
        assert [e.kind for e in entries] == ["full", "delta"]

        events = wait_events(flow_run_id, lambda ev: named(ev, "posttrain.hotload.failed"))
        (failed,) = named(events, "posttrain.hotload.failed")  # not retried: one attempt, one event
        assert failed.resource.id == "posttrain.block.posttrain-inference-deployment.flows-events"
        assert failed.resource["posttrain.snapshot"] == entries[1].identity
        assert failed.resource["posttrain.will-retry"] == "false" and failed.payload["will_retry"] is False
        assert FAULT_REASON in failed.payload["error"] and failed.payload["error_type"]
        assert tiny_setup.token not in json.dumps(failed.payload)
        assert {f"posttrain.snapshot.{entries[1].identity}", f"posttrain.run.{name}"} <= related_ids(failed)
        (succeeded,) = named(events, "posttrain.hotload.succeeded")  # step 1, before the fault
        assert succeeded.resource["posttrain.snapshot"] == entries[0].identity

        # The automation fired: the notification names the snapshot and carries the error.
        deadline = time.monotonic() + 60
        while not any(entries[1].identity in n.get("subject", "") for n in received):
            assert time.monotonic() < deadline, f"no notification in 60 s: {received}"
            time.sleep(0.5)
        (note,) = [n for n in received if entries[1].identity in n.get("subject", "")]
        assert FAULT_REASON in note["body"] and name in note["body"], note
    finally:
        delete_automation(automation)
