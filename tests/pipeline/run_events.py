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


def wait_events(flow_run_id: str | UUID, done: Callable[[list], bool], timeout: float = 30) -> list:
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
