"""The nightly deployment of prefect.yaml on a real Prefect server: its schedule is registered, and its
enforced schema rejects bad parameters. (Its runs through a process worker, two nights of one run
name: test_flows_concurrency.py, whose first night waits for the deployment's slot.)"""

from __future__ import annotations

import json

import pytest

from tests.pipeline.conftest import NIGHTLY
from tests.pipeline.runs import prefect_cli

pytestmark = pytest.mark.slow


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
