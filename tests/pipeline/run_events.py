"""Reading back the events a run emitted (``POST /api/events/filter``), polling: the server writes
events asynchronously, after the flow run's process sent them; what a completed nightly run records
(``assert_nightly_events``), and a webhook and automations for the notifications events trigger."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from uuid import UUID

import yaml

from tests.pipeline.conftest import DEPLOYMENT_ID
from tests.pipeline.runs import prefect_cli


def flow_run_events(flow_run_id: str | UUID, prefix: str = "posttrain.") -> list:
    """Events named ``prefix...`` that have the flow run as a related resource, oldest first."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventRelatedFilter
    from prefect.types._datetime import now

    found = []
    with get_client(sync_client=True) as client:
        page = client.read_events(filter=EventFilter(
            occurred=EventOccurredFilter(since=now("UTC") - timedelta(hours=2), until=now("UTC") + timedelta(minutes=5)),
            event=EventNameFilter(prefix=[prefix]),
            related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        ), limit=50)
        found += page.events
        while page.next_page:
            page = client.read_events_page(page.next_page)
            found += page.events
    return sorted(found, key=lambda e: e.occurred)


def wait_events(flow_run_id: str | UUID, done: Callable[[list], bool], timeout: float = 120) -> list:
    """The flow run's posttrain events once ``done(events)`` holds; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        events = flow_run_events(flow_run_id)
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"events of flow run {flow_run_id} after {timeout} s: "
                                 f"{[(e.event, e.resource.id) for e in events]}")
        time.sleep(0.5)


def named(events: list, name: str) -> list:
    return [e for e in events if e.event == name]


def related_ids(event) -> set[str]:
    return {r.id for r in event.related}


def assert_goodput_adds_up(flow_run_id: str | UUID, artifact, tolerance: float = 0.02) -> dict[str, float]:
    """A run's goodput artifact (docs/goodput.md): its categories, none negative, add up to the flow
    run's wall time as the server records it (start -> end) within ``tolerance``, and its
    ``posttrain.run.goodput`` event carries the same figures. Returns the event's (unrounded) seconds by category."""
    import json

    from tests.pipeline.runs import read_flow_run

    rows = json.loads(artifact.data)
    seconds = {r["category"]: float(r["seconds"]) for r in rows if r["category"] != "wall"}
    assert min(seconds.values()) >= 0, seconds
    run = read_flow_run(flow_run_id)
    wall = (run.end_time - run.start_time).total_seconds()
    assert abs(sum(seconds.values()) - wall) <= tolerance * wall, (sum(seconds.values()), wall, seconds)
    (event,) = named(wait_events(flow_run_id, lambda ev: named(ev, "posttrain.run.goodput")), "posttrain.run.goodput")
    assert {c: round(s, 2) for c, s in event.payload["seconds"].items()} == seconds
    assert abs(event.payload["goodput"] - event.payload["seconds"]["training"] / event.payload["wall_s"]) < 1e-9
    return event.payload["seconds"]


def assert_nightly_events(setup, flow_run_id: str, name: str, entries: list) -> None:
    """The events of a completed nightly run (``name``: its run folder's name; ``entries``: its
    ledger): the job submitted then completed, each snapshot published once, each hot-load.
    Called by the two-nights test of test_flows_concurrency.py on its first night."""
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


@contextmanager
def webhook() -> Iterator[tuple[str, list[dict]]]:
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
