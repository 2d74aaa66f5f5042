"""A flow run renames itself when it starts (``<run_name>-<day>-<short id>``: the id is not known
when the run is created), after the CLI printed its creation name: its log says so, before Prefect's `Beginning flow
run` (real Prefect server)."""

from __future__ import annotations

import re

import pytest
from prefect import flow

from posttrain.pipeline.settings import flow_run_name, run_suffix
from tests.pipeline.runs import flow_run_logs_until, read_flow_run

pytestmark = pytest.mark.slow


@flow(name="posttrain-test-run-names", flow_run_name=flow_run_name)
def named(run_name: str) -> str:
    return run_name


@pytest.mark.timeout(120)
def test_a_run_says_in_its_log_that_it_renamed_itself(prefect_api):
    state = named(run_name="names", return_state=True)
    assert state.is_completed()
    run = read_flow_run(state.state_details.flow_run_id)
    assert re.fullmatch(rf"names-\d{{4}}-\d{{2}}-\d{{2}}-{run_suffix(run.id)}", run.name), run.name
    logs = flow_run_logs_until(run.id, "This flow run is named")
    said = [m for m in logs if "This flow run is named" in m]
    assert len(said) == 1, logs
    created = re.fullmatch(rf"This flow run is named {run.name}, not (\S+): .*", said[0])
    assert created and created[1] != run.name, said  # Prefect's creation name, e.g. wooden-koala
