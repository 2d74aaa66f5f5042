"""Reading back the events a run emitted (``POST /api/events/filter``), polling: the server writes
events asynchronously, after the flow run's process sent them."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from uuid import UUID


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
