"""The nightly's last step promotes as its flow run, not as its run name (real Prefect server): the
lease of production and the history record name ``nightly-<flow run id>``, the same across the flow
run's retries (it takes its own lease over) and another for a second nightly with the same
``run_name`` (it loses while the first holds the lease, and finds no record of its own)."""

from __future__ import annotations

import pytest
from prefect import flow

from posttrain.pipeline.flows import nightly
from posttrain.pipeline.settings import NightlySettings

pytestmark = pytest.mark.slow

SETTINGS = dict(run_name="nightly-twice", base_model="/unused-model", dataset="/unused.jsonl",
                shared_dir="/unused-shared", store="s3-store/unused", inference="inference-deployment/staging",
                promote_to="inference-deployment/prod", trainer={"reward_funcs": ["posttrain.rewards:format_reward"], "max_steps": 1},
                promotion={"eval_dataset": "/unused-eval.jsonl"})


@pytest.fixture
def promotions(monkeypatch) -> list[dict]:
    """Each promotion the nightly's last step asks for: who runs it (its lease and record) and the run name."""
    asked: list[dict] = []
    monkeypatch.setattr(nightly, "run_promotion", lambda target, **kw: asked.append(kw) or kw)
    return asked


@pytest.mark.timeout(120)
def test_two_nightlies_with_one_run_name_promote_as_two_holders(prefect_api, promotions):
    settings = NightlySettings(**SETTINGS)
    rows = [{"step": 1, "snapshot": "snap-1", "served": "snap-1"}]
    first = flow(name="posttrain-test-nightly-last-step")(nightly.promote_last)(settings, rows, return_state=True)
    second = flow(name="posttrain-test-nightly-last-step")(nightly.promote_last)(settings, rows, return_state=True)
    assert first.is_completed() and second.is_completed()
    ids = [str(s.state_details.flow_run_id) for s in (first, second)]
    assert [p["run"] for p in promotions] == [f"nightly-{i}" for i in ids]
    assert promotions[0]["run"] != promotions[1]["run"]
    assert [p["run_name"] for p in promotions] == ["nightly-twice"] * 2  # the events still name the run


@pytest.mark.timeout(120)
def test_a_retried_nightly_promotes_as_the_same_holder(prefect_api, promotions):
    settings = NightlySettings(**SETTINGS)
    rows = [{"step": 1, "snapshot": "snap-1", "served": "snap-1"}]

    @flow(name="posttrain-test-nightly-retried", retries=1, retry_delay_seconds=0)
    def retried() -> None:
        nightly.promote_last(settings, rows)
        if len(promotions) == 1:
            raise RuntimeError("the first attempt dies after its promotion started")

    state = retried(return_state=True)
    assert state.is_completed(), state
    assert len(promotions) == 2
    assert promotions[0]["run"] == promotions[1]["run"] == f"nightly-{state.state_details.flow_run_id}"
