"""Promotion and rollback through real reference servers (staging and production) and a store folder:
the first candidate is promoted; a better one is promoted and production serves it; a worse one is
refused and production keeps the champion; ``previous`` restores the earlier champion's identity and
answers; bad input changes nothing."""

from __future__ import annotations

import pytest

from posttrain.promote.decision import GateConfig
from posttrain.promote.evaluate import EvalSettings, EvalStore
from posttrain.promote.history import History
from posttrain.promote.promoter import Deployment, PromotionError, promote, rollback
from tests.support.promotion import eval_rows, greedy_eval, served_identities, staging_and_production
from tests.support.serving import PROMPT, Api


@pytest.fixture(scope="module")
def rows(chain):
    return eval_rows(chain.models)


@pytest.fixture
def site(chain, store_copy, tmp_path):
    """Staging and production reference servers on one store; yields (store, staging, production, apis)."""
    with staging_and_production(chain, store_copy, tmp_path) as found:
        yield found


@pytest.fixture(scope="module")
def tokenizer(chain):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chain.models[0])


def gate_run(site, rows, tokenizer, candidate, *, gate=None, **eval_overrides):
    store, staging, production, _ = site
    settings = EvalSettings(**greedy_eval(**eval_overrides))
    # own_eval: the first promotion of most tests sets a champion up; the boot weights' test asks for beat_boot
    gate = gate or GateConfig(samples_per_prompt=settings.samples_per_prompt, first_promotion="own_eval")
    return promote(store=store, candidate=candidate, run="nightly-test", gate=gate, settings=settings, rows=rows,
                   dataset_digest="d" * 64, tokenizer=tokenizer, staging=staging, production=production)


def served(api: Api) -> set[str]:
    return served_identities(api, "prod")


def test_better_is_promoted_worse_refused_and_rollback_restores_the_previous_champion(chain, site, rows, tokenizer):
    store, _, production, (staging_api, prod_api) = site
    history = History(store, "", "prod")

    first = gate_run(site, rows, tokenizer, chain.d1)  # no champion yet: its own eval decides (own_eval)
    assert first.promoted and first.record.kind == "promotion" and first.record.previous is None
    assert "first promotion" in first.decision.reason
    assert served(prod_api) == {chain.d1} and prod_api.greedy() == chain.greedy[1]

    better = gate_run(site, rows, tokenizer, chain.d2)  # the eval's references are m2's answers
    assert better.promoted, better.decision.reason
    assert better.decision.candidate_mean == pytest.approx(1.0)
    assert better.decision.champion_mean < 0.8 and better.decision.lower_bound > 0
    assert served(prod_api) == {chain.d2} and prod_api.greedy() == chain.greedy[2]
    assert better.champion_eval.digest == first.candidate_eval.digest  # the champion's stored eval, reused
    assert EvalStore(store).get(better.candidate_eval.digest, chain.d2) is not None

    worse = gate_run(site, rows, tokenizer, chain.full)  # m0: further from the references than the champion
    assert not worse.promoted and worse.served is None
    assert worse.record.kind == "refusal" and worse.record.previous == chain.d2
    assert worse.record.reason.startswith("refused") and "lower bound" in worse.record.reason
    assert served(prod_api) == {chain.d2} and prod_api.greedy() == chain.greedy[2]  # production untouched
    assert history.champion() == chain.d2

    back = rollback(store=store, production=production, to="previous")
    assert back.record.kind == "rollback" and back.record.identity == chain.d1 and back.record.previous == chain.d2
    assert served(prod_api) == {chain.d1} and prod_api.greedy(PROMPT) == chain.greedy[1]
    assert [r.kind for r in history.records()] == ["promotion", "promotion", "refusal", "rollback"]
    assert history.champion() == chain.d1 and history.previous_champion() is None


def test_a_first_candidate_must_beat_the_boot_weights_production_serves(chain, site, rows, tokenizer):
    store, _, production, (_, prod_api) = site
    history = History(store, "", "prod")
    beat_boot = GateConfig(samples_per_prompt=2)  # the default
    same = gate_run(site, rows, tokenizer, chain.full, gate=beat_boot)  # m0: the very weights production booted on
    assert not same.promoted and same.served is None, same.decision.reason
    assert same.record.kind == "refusal" and same.record.previous is None
    assert "vs production's boot weights' 0.000" in same.decision.reason and "lower bound" in same.decision.reason
    assert same.champion_eval.identity == "boot-weights" and same.decision.champion is None
    assert same.decision.difference == pytest.approx(0.0)  # the same weights answer the same, greedily
    assert served(prod_api) == set() and history.champion() is None  # production untouched

    better = gate_run(site, rows, tokenizer, chain.d2, gate=beat_boot)  # the eval's references: m2's answers
    assert better.promoted, better.decision.reason
    assert better.decision.lower_bound > 0 and better.decision.champion_mean < better.decision.candidate_mean
    assert "boot weights" in better.decision.reason
    assert served(prod_api) == {chain.d2} and history.champion() == chain.d2


def test_a_first_promotion_needs_production_answering_unless_own_eval(chain, site, rows, tokenizer):
    store, staging, production, (_, prod_api) = site
    mute = Deployment("prod", production.loader)  # no completions: the boot weights cannot be evaluated
    settings = EvalSettings(**greedy_eval())
    kw = dict(store=store, candidate=chain.d2, run="nightly-test", settings=settings, rows=rows,
              dataset_digest="d" * 64, tokenizer=tokenizer, staging=staging, production=mute)
    with pytest.raises(PromotionError, match=r"no completions endpoint.*gate_first_promotion own_eval"):
        promote(gate=GateConfig(samples_per_prompt=2), **kw)
    assert History(store, "", "prod").records() == [] and served(prod_api) == set()  # nothing changed
    done = promote(gate=GateConfig(samples_per_prompt=2, first_promotion="own_eval"), **kw)
    assert done.promoted and "first promotion" in done.decision.reason


def test_a_retried_promotion_records_nothing_twice(chain, site, rows, tokenizer):
    store, *_ = site
    gate_run(site, rows, tokenizer, chain.d2)
    again = gate_run(site, rows, tokenizer, chain.d2)
    assert again.promoted and again.record is None and "already" in again.decision.reason
    assert len(History(store, "", "prod").records()) == 1


def test_an_eval_that_fails_is_a_refusal_that_says_which_side(chain, site, rows, tokenizer):
    store, _, _, (staging_api, prod_api) = site
    gate_run(site, rows, tokenizer, chain.d1)
    staging_api.faults({"kind": "http_error", "status": 400, "path_prefix": "/v1/completions", "count": 1000})
    refused = gate_run(site, rows, tokenizer, chain.d2)
    assert not refused.promoted and set(refused.failures) == {"candidate"}
    assert "the candidate could not be evaluated" in refused.record.reason and "HTTP 400" in refused.record.reason
    assert served(prod_api) == {chain.d1}


def test_an_eval_failure_names_no_credentials(chain, site, rows, tokenizer):
    store, staging, production, (_, prod_api) = site

    def completions():
        raise ConnectionError("gateway http://eval-user:s3cret-PLANTED@10.0.0.9:8000/v1 refused the connection")

    settings = EvalSettings(**greedy_eval())
    refused = promote(store=store, candidate=chain.d1, run="nightly-test", rows=rows, dataset_digest="d" * 64,
                      gate=GateConfig(samples_per_prompt=settings.samples_per_prompt), settings=settings,
                      tokenizer=tokenizer, staging=Deployment("staging", staging.loader, completions),
                      production=production)
    assert not refused.promoted and "refused the connection" in refused.failures["candidate"]
    stored = [r.model_dump_json() for r in History(store, "", "prod").records()]
    assert stored and "s3cret-PLANTED" not in "".join(stored) + refused.record.reason
    assert served(prod_api) == set()


def test_rollback_to_any_identity_of_the_store_and_bad_input(chain, site, rows, tokenizer):
    store, _, production, (_, prod_api) = site
    with pytest.raises(PromotionError, match="--to previous: deployment prod has no earlier champion"):
        rollback(store=store, production=production, to="previous")
    with pytest.raises(PromotionError, match="unknown identity step-00000099-nope"):
        rollback(store=store, production=production, to="step-00000099-nope")
    with pytest.raises(PromotionError, match="unknown identity nope"):
        gate_run(site, rows, tokenizer, "nope")
    with pytest.raises(PromotionError, match="eval_dataset: the eval set has zero prompts"):
        gate_run(site, [], tokenizer, chain.d1)
    assert History(store, "", "prod").records() == [] and prod_api.greedy() == chain.greedy[0]  # nothing changed

    done = rollback(store=store, production=production, to=chain.d2, run="rollback-1")  # a delta, from boot weights
    assert done.record.identity == chain.d2 and served(prod_api) == {chain.d2}
    assert prod_api.greedy() == chain.greedy[2]
    again = rollback(store=store, production=production, to=chain.d2, run="rollback-1")  # its retry
    assert again.recorded_before and len(History(store, "", "prod").records()) == 1
    with pytest.raises(PromotionError, match="is already the champion"):
        rollback(store=store, production=production, to=chain.d2)
