"""The promote and rollback flows against a Prefect server, with two reference servers (staging and
production) on one store: the first candidate and a better one are promoted, a worse one is refused
(the flow completes; production keeps the champion; the event and the artifact say why), and the
rollback flow restores the earlier champion's identity and answers, recorded in the history."""

from __future__ import annotations

import pytest

from posttrain.promote.history import History
from posttrain.storage import open_store
from tests.pipeline.run_events import named, wait_events
from tests.support.promotion import REWARD, write_eval_set
from tests.support.serving import PREFIX, TOKEN, Api, start_server

pytestmark = pytest.mark.slow

STAGING, PROD, STORE = ("posttrain-inference-deployment/promote-staging", "posttrain-inference-deployment/promote-prod",
                        "posttrain-object-store/promote-test")


@pytest.fixture
def site(prefect_api, chain, store_copy, tmp_path):
    from posttrain.pipeline.blocks import InferenceDeployment, ObjectStore

    servers = {name: start_server(chain, tmp_path / name, store_copy, deployment_id=name) for name in ("staging", "prod")}
    for ref, name in ((STAGING, "staging"), (PROD, "prod")):
        url = servers[name].url
        InferenceDeployment(api_url=url, gateway_url=url, deployment_id=name, model="tiny", token=TOKEN,
                            poll_interval_s=0.1, timeout_s=120).save(ref.split("/")[1], overwrite=True)
    ObjectStore(uri=str(store_copy / PREFIX)).save(STORE.split("/")[1], overwrite=True)
    yield servers, store_copy / PREFIX
    for s in servers.values():
        s.shutdown()


def promote(chain, tmp_path, candidate: str):
    from posttrain.pipeline.flows.promote import promote as promote_flow

    state = promote_flow(production=PROD, staging=STAGING, store=STORE, candidate=candidate,
                         tokenizer=str(chain.models[0]), shared_dir=str(tmp_path / "shared"),
                         eval_dataset=str(write_eval_set(chain.models, tmp_path / "eval.jsonl")),
                         eval_reward_funcs=[REWARD], eval_samples_per_prompt=2, eval_max_tokens=6,
                         eval_temperature=1e-6, gate_first_promotion="own_eval", return_state=True)
    assert state.is_completed(), state.message
    return state.result(), state.state_details.flow_run_id


def markdown_artifact(flow_run_id) -> str:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]},
                                                                           type={"any_": ["markdown"]}))
    return artifact.data


@pytest.mark.timeout(300)
def test_promote_refuse_and_roll_back_through_the_flows(site, chain, tmp_path):
    from posttrain.pipeline.flows.promote import rollback as rollback_flow

    servers, store_dir = site
    prod = Api(servers["prod"].url)
    first, _ = promote(chain, tmp_path, chain.d1)
    assert first.promoted and first.champion is None
    better, better_run = promote(chain, tmp_path, chain.d2)
    assert better.promoted and better.champion == chain.d1 and better.candidate_mean == pytest.approx(1.0)
    assert prod.greedy() == chain.greedy[2]
    (accepted,) = named(wait_events(better_run, lambda ev: named(ev, "posttrain.promotion.accepted")),
                        "posttrain.promotion.accepted")
    assert accepted.payload["candidate"] == chain.d2 and accepted.payload["champion"] == chain.d1

    worse, worse_run = promote(chain, tmp_path, chain.full)  # m0: further from the eval's references
    assert not worse.promoted and worse.record is not None
    assert worse.reason.startswith("refused") and "lower bound" in worse.reason
    assert prod.greedy() == chain.greedy[2]  # production keeps the champion
    (refused,) = named(wait_events(worse_run, lambda ev: named(ev, "posttrain.promotion.refused")),
                       "posttrain.promotion.refused")
    assert refused.payload["reason"] == worse.reason and refused.resource.id == f"posttrain.block.{PROD.replace('/', '.')}"
    assert refused.payload["candidate_mean"] < refused.payload["champion_mean"]
    page = markdown_artifact(worse_run)
    assert "### Refused" in page and worse.reason.replace("|", "\\|") in page and "data:image/svg+xml" in page

    state = rollback_flow(production=PROD, store=STORE, to="previous", return_state=True)
    assert state.is_completed(), state.message
    back = state.result()
    assert (back.identity, back.previous) == (chain.d1, chain.d2)
    assert prod.greedy() == chain.greedy[1]
    wait_events(state.state_details.flow_run_id, lambda ev: named(ev, "posttrain.rollback.done"))
    with open_store(str(store_dir)) as store:
        assert [r.kind for r in History(store, "", "prod").records()] == ["promotion", "promotion", "refusal",
                                                                             "rollback"]


@pytest.mark.timeout(180)
def test_the_nightly_flows_last_step_promotes_what_staging_serves_with_the_runs_rewards(site, chain, tmp_path):
    """``promote_to``: the candidate is the run's last snapshot as staging serves it (a delta that fell
    back is served as a full snapshot), evaluated with the run's reward functions."""
    from posttrain.pipeline.flows.nightly import promote_last
    from posttrain.pipeline.settings import NightlySettings

    servers, store_dir = site
    settings = NightlySettings(
        run_name="nightly-promote", base_model=str(chain.models[0]), dataset="/unused.jsonl",
        shared_dir=str(tmp_path / "shared"), store=STORE, inference=STAGING, promote_to=PROD,
        trainer={"reward_funcs": [REWARD], "max_steps": 1},
        promotion={"eval_dataset": str(write_eval_set(chain.models, tmp_path / "eval.jsonl")),
                   "eval_samples_per_prompt": 2, "eval_max_tokens": 6, "eval_temperature": 1e-6,
                   "gate_first_promotion": "own_eval"})  # m0 is what production booted on: beat_boot refuses it
    rows = [{"step": 1, "snapshot": chain.d1, "served": chain.d1}, {"step": 2, "snapshot": chain.d2, "served": chain.full}]
    from prefect import flow

    state = flow(name="nightly-last-step")(promote_last)(settings, rows, return_state=True)  # as in the nightly
    report = state.result()
    assert report.promoted and report.candidate == chain.full and report.champion is None
    assert Api(servers["prod"].url).greedy() == chain.greedy[0]
    with open_store(str(store_dir)) as store:
        (record,) = History(store, "", "prod").records()
    assert (record.kind, record.identity, record.run) == ("promotion", chain.full,
                                                              f"nightly-{state.state_details.flow_run_id}")


@pytest.mark.timeout(180)
def test_a_blank_reason_fails_the_rollback_flow_before_production_is_touched(site, chain):
    """Issue 33, item 2: checked with the other parameters, one line naming it; nothing hot-loaded or recorded."""
    from posttrain.pipeline.flows.promote import rollback as rollback_flow

    servers, store_dir = site
    state = rollback_flow(production=PROD, store=STORE, to=chain.d2, reason="   ", return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert message.startswith("reason: ") and "is empty" in message and "\n" not in message, message
    assert Api(servers["prod"].url).greedy() == chain.greedy[0]  # the boot weights: never hot-loaded
    with open_store(str(store_dir)) as store:
        assert History(store, "", "prod").records() == []
