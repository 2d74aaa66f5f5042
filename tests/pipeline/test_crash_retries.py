"""The automation ``posttrain prefect-setup`` installs retries a Crashed posttrain run without a
person, the way Prefect's Retry does (AwaitingRetry), and only ``retries`` times per run: the run
that crashes once more stays Crashed, for a person. A run crashed before it ever ran is left alone.

The flow runs here belong to a deployment with no work pool, so no worker runs them: their states
are driven through the API, as a worker's flow-run process and the unresponsive-runs automation
would drive them, and only the automation's reactions are under test."""

from __future__ import annotations

import asyncio
import time

import pytest

from posttrain.pipeline.deployments.crash_retries import (
    AUTOMATION_NAME,
    DEFAULT_RETRIES,
    check_retries,
    install_crashed_runs_automation,
)

REACTION_S = 60  # the automation reacts in seconds; a loaded server may take longer
SETTLE_S = 15  # how long a run left Crashed is watched for a retry that must not come


def test_the_bound_is_checked_before_anything_is_set_up():
    assert check_retries(0) == 0 and check_retries(20) == 20
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=r"from 0 .* to 20 retries of one run"):
            check_retries(bad)


async def _deployment(client) -> str:
    from prefect.flows import Flow

    flow_id = await client.create_flow(Flow(fn=lambda: None, name="posttrain-crash-retries-test"))
    return str(await client.create_deployment(flow_id=flow_id, name="no-worker", tags=["posttrain"]))


async def _set(client, run_id, state) -> None:
    result = await client.set_flow_run_state(run_id, state, force=False)
    assert result.status.value == "ACCEPT", f"{state.name}: {result.details}"


async def _wait_state(client, run_id, name: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        run = await client.read_flow_run(run_id)
        if run.state.name == name:
            return run
        assert time.monotonic() < deadline, f"still {run.state.name} ({run.state.message}) after {timeout} s"
        await asyncio.sleep(0.5)


async def _retry_events(client, run_id, count: int, timeout: float = 60) -> list[dict]:
    """The automations' actions on the run (``prefect.automation.action.executed``), once ``count`` are stored
    (written after the state)."""
    deadline = time.monotonic() + timeout
    while True:
        response = await client._client.post("/events/filter", json={"filter": {
            "event": {"name": ["prefect.automation.action.executed"]},
            "related": {"id": [f"prefect.flow-run.{run_id}"]}, "order": "ASC"}, "limit": 50})
        response.raise_for_status()
        events = response.json()["events"]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        await asyncio.sleep(1)


async def _crash_until_left(retries: int) -> tuple[list, object, list[dict]]:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Pending, Running

    async with get_client() as client:
        deployment_id = await _deployment(client)
        run = await client.create_flow_run_from_deployment(deployment_id, tags=["posttrain"])
        for attempt in range(1, retries + 2):
            await _set(client, run.id, Pending())
            await _set(client, run.id, Running())
            await _set(client, run.id, Crashed(message=f"killed on attempt {attempt}"))
            if attempt <= retries:
                await _wait_state(client, run.id, "AwaitingRetry", REACTION_S)
        await asyncio.sleep(SETTLE_S)
        final = await client.read_flow_run(run.id)
        history = await client.read_flow_run_states(run.id)
        events = await _retry_events(client, run.id, retries)
        await client.delete_flow_run(run.id)
        await client.delete_deployment(deployment_id)
    return history, final, events


async def _crash_before_running():
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Pending

    async with get_client() as client:
        deployment_id = await _deployment(client)
        run = await client.create_flow_run_from_deployment(deployment_id, tags=["posttrain"])
        await _set(client, run.id, Pending())
        await _set(client, run.id, Crashed(message="the flow-run process never started"))
        await asyncio.sleep(SETTLE_S)
        final = await client.read_flow_run(run.id)
        await client.delete_flow_run(run.id)
        await client.delete_deployment(deployment_id)
    return final


@pytest.mark.timeout(REACTION_S * DEFAULT_RETRIES + 120)
def test_a_crashed_run_is_retried_at_most_the_bound_then_left_for_a_person(prefect_api):
    install_crashed_runs_automation()  # what posttrain prefect-setup installs (idempotent)
    history, final, events = asyncio.run(_crash_until_left(DEFAULT_RETRIES))
    retried = [s for s in history if s.name == "AwaitingRetry"]
    assert len(retried) == DEFAULT_RETRIES, [s.name for s in history]
    assert all(AUTOMATION_NAME in (s.message or "") and f"at most {DEFAULT_RETRIES} times" in s.message
               for s in retried), [s.message for s in retried]
    assert final.state.is_crashed() and final.run_count == DEFAULT_RETRIES + 1, (final.state, final.run_count)
    # each retry is an event of the automation that made it, naming the run it acted on
    assert len(events) == DEFAULT_RETRIES, events
    assert all(event["resource"].get("prefect.resource.name") == AUTOMATION_NAME for event in events), events[0]


@pytest.mark.timeout(SETTLE_S + 120)
def test_a_run_crashed_before_it_ever_ran_is_not_retried(prefect_api):
    install_crashed_runs_automation()
    final = asyncio.run(_crash_before_running())
    assert final.state.is_crashed() and final.run_count == 0, (final.state, final.run_count)
