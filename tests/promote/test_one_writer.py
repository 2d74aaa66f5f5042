"""One writer per production deployment, in one process (the races are in test_deployment_races.py):
configuration errors before any eval (too few prompts, a champion gone from the store), a blank
rollback reason refused before anything is touched, retries idempotent by run across records, a
failed switch reverted so that production never contradicts the history, a held deployment makes
the other operation lose at once, and gc keeps what a record written after its plan names.

Production is a ``FileLoader`` (what it serves is a file); promotions reuse stored evals."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.pipeline.parameters import ParameterError, from_parameters
from posttrain.pipeline.promotion_settings import RollbackSettings
from posttrain.promote.history import History, Record
from posttrain.promote.lease import holding, lease_key
from posttrain.promote.promoter import Deployment, OperationLost, PromotionError, SwitchFailed, promote, rollback
from posttrain.publish.content import checkpoint_content
from posttrain.publish.gc import GcConfig, delete_snapshot, plan_gc, run_gc
from posttrain.storage import LocalStore
from tests.support.chains import publish_runs, rebuilds, snapshots_in
from tests.support.deployment_race import FileLoader, decision, rows, seed_evals, served, settings_and_gate


class Site:
    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.store = LocalStore(tmp_path / "store")
        self.done = publish_runs(self.store, tmp_path, runs=2, steps=3)
        self.a, self.b, self.c = self.done.identities("night-1")
        self.old = self.done.identities("night-0")[-1]  # a delta of the older run: gc deletes that run
        self.file = tmp_path / "prod.served"
        self.history = History(self.store, "", "prod")

    def production(self, **kw) -> Deployment:
        return Deployment("prod", FileLoader(self.file, **kw))

    def staging(self) -> Deployment:
        return Deployment("staging", FileLoader(self.tmp / "staging.served"))

    def champion_is(self, *identities: str) -> None:
        """The history promotes ``identities`` in turn, and production serves the last."""
        previous = None
        for identity in identities:
            self.history.append(Record(kind="promotion", deployment="prod", identity=identity, previous=previous,
                                       run="nightly-0", decision=decision(identity, previous, True),
                                       reason="accepted: test"))
            previous = identity
        self.file.write_text(identities[-1])

    def promote(self, candidate: str, run: str = "nightly-1", rows_=None, **kw):  # noqa: ANN001, ANN201
        settings, gate = settings_and_gate()
        return promote(store=self.store, candidate=candidate, run=run, gate=gate, settings=settings,
                       rows=rows() if rows_ is None else rows_, dataset_digest="d" * 64, tokenizer=None,
                       staging=self.staging(), production=self.production(**kw), gc_wait=5)

    def consistent(self) -> None:
        """The invariant: production serves the history's champion."""
        assert served(self.file) == self.history.champion()


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def test_too_few_eval_prompts_is_a_configuration_error_before_any_eval(site):
    """Item 9: known at the start; neither side is evaluated (staging untouched), nothing recorded."""
    site.champion_is(site.a)
    _, gate = settings_and_gate()
    with pytest.raises(PromotionError) as e:
        site.promote(site.b, rows_=rows()[:3])
    assert str(e.value) == f"eval_dataset: the eval set has 3 prompts; the gate needs at least min_prompts " \
                           f"{gate.min_prompts}"
    assert not (site.tmp / "staging.served").exists() and len(site.history.records()) == 1


def test_a_champion_gone_from_the_store_is_named_as_the_champion_with_what_to_do(site):
    """Item 5: not 'unknown identity', before any eval, nothing recorded."""
    site.champion_is(site.b)
    delete_snapshot(site.store, site.b)
    with pytest.raises(PromotionError) as e:
        site.promote(site.c)
    text = str(e.value)
    assert "\n" not in text and "unknown identity" not in text
    assert text.startswith(f"production: the champion of deployment prod, {site.b} (its history's last promotion or "
                           "rollback), is not in the store")
    assert text.endswith("posttrain rollback --deployment prod --to <an existing snapshot>")
    assert not (site.tmp / "staging.served").exists() and len(site.history.records()) == 1


def test_a_blank_rollback_reason_is_refused_with_the_parameters_and_by_the_engine(site):
    """Item 2: the flow's parameters refuse it (one line naming it) before the flow starts; the
    engine refuses it before production is touched."""
    with pytest.raises(ParameterError, match=r"^reason: .*is empty") as e:
        from_parameters(RollbackSettings, {"production": "posttrain-inference-deployment/prod", "reason": "   "})
    assert "\n" not in str(e.value)
    site.champion_is(site.a, site.b)
    with pytest.raises(PromotionError, match="^reason: is empty"):
        rollback(store=site.store, production=site.production(), to="previous", run="rollback-1", reason=" \t ")
    assert served(site.file) == site.b and len(site.history.records()) == 2


def test_a_retried_rollback_finds_its_record_behind_a_later_one_and_rolls_back_once(site):
    """Item 3: a refusal lands between the rollback and its retry; the retry does not roll back again."""
    site.champion_is(site.a, site.b, site.c)
    first = rollback(store=site.store, production=site.production(), to="previous", run="rollback-7")
    assert first.record.identity == site.b
    site.history.append(Record(kind="refusal", deployment="prod", identity=site.old, previous=site.b,
                               run="nightly-2", decision=decision(site.old, site.b, False), reason="refused: test"))
    again = rollback(store=site.store, production=site.production(), to="previous", run="rollback-7")
    assert again.recorded_before and again.record.seq == first.record.seq
    assert [r.kind for r in site.history.records()] == ["promotion"] * 3 + ["rollback", "refusal"]
    assert site.history.champion() == site.b
    site.consistent()


def test_a_retried_promotion_finds_its_decision_behind_a_later_record(site):
    """Item 3 for promotions: the retry of a refused run returns its refusal, evaluates and records nothing."""
    site.champion_is(site.a, site.b)
    seed_evals(site.store, {site.b: 0.9, site.c: 0.1})
    refused = site.promote(site.c, run="nightly-5")
    assert not refused.promoted and refused.record.kind == "refusal"
    rollback(store=site.store, production=site.production(), to="previous", run="rollback-1")
    again = site.promote(site.c, run="nightly-5")
    assert again.recorded_before and again.record == refused.record and not again.promoted
    assert [r.kind for r in site.history.records()] == ["promotion", "promotion", "refusal", "rollback"]
    site.consistent()


def test_a_failed_switch_is_reverted_and_production_serves_the_champion_again(site):
    site.champion_is(site.a, site.b)
    with pytest.raises(SwitchFailed) as e:
        rollback(store=site.store, production=site.production(fail_on=(site.a,)), to="previous", run="rollback-2")
    records = site.history.records()
    assert [r.kind for r in records] == ["promotion", "promotion", "rollback", "reverted"]
    assert records[-1].reverts == 3 and records[-1].identity == site.a
    assert str(e.value) == records[-1].reason + " (record #4)" and "\n" not in str(e.value)
    assert f"record #3 is reverted and production serves {site.b} again" in str(e.value)
    assert site.history.champion() == site.b and site.history.previous_champion() == site.a
    site.consistent()

    seed_evals(site.store, {site.b: 0.1, site.c: 0.9})
    with pytest.raises(SwitchFailed, match=f"the hot-load of {site.c} into prod failed"):
        site.promote(site.c, fail_on=(site.c,))
    assert site.history.champion() == site.b and site.history.records()[-1].kind == "reverted"
    site.consistent()
    again = rollback(store=site.store, production=site.production(), to="previous", run="rollback-2")  # its retry
    assert not again.recorded_before and again.record.identity == site.a  # its record was reverted: done now
    site.consistent()


def test_a_held_deployment_makes_the_other_operation_lose_at_once_with_nothing_changed(site):
    site.champion_is(site.a, site.b)
    with holding(site.store, "prod", "promotion", run="nightly-9"):
        with pytest.raises(OperationLost) as e:
            rollback(store=site.store, production=site.production(), to="previous", run="rollback-3")
    text = str(e.value)
    assert text.startswith("deployment prod is held by promotion nightly-9 (pid ") and "\n" not in text
    assert text.endswith("s); nothing was changed") and " until 20" in text
    assert len(site.history.records()) == 2 and served(site.file) == site.b
    assert not site.store.exists(lease_key("prod"))  # released
    assert rollback(store=site.store, production=site.production(), to="previous").record.identity == site.a


def test_gc_keeps_what_a_record_written_after_its_plan_names(site):
    """Item 4: gc plans; a rollback to a snapshot of a run gc deletes is recorded; gc deletes: the
    recorded snapshot and its chain prefix stay, and rebuild."""
    site.champion_is(site.a, site.c)
    plan = plan_gc(site.store, GcConfig(keep_runs=1))
    assert site.old in {d.identity for d in plan.doomed}
    rollback(store=site.store, production=site.production(), to=site.old)
    result = run_gc(site.store, plan)
    assert site.old in snapshots_in(site.store) and site.old not in {d.identity for d in result.deleted}
    assert rebuilds(site.store, site.old, site.tmp) == checkpoint_content(site.done.checkpoints[site.old])
    site.consistent()


def test_gc_skips_a_run_while_a_deployment_is_being_changed(site):
    site.champion_is(site.a)
    plan = plan_gc(site.store, GcConfig(keep_runs=1))
    with holding(site.store, "prod", "rollback"):
        result = run_gc(site.store, plan)
    assert result.deleted == [] and result.skipped["night-0"].startswith(
        "run night-0: deployment prod is being changed (rollback pid ")
    assert run_gc(site.store, plan_gc(site.store, GcConfig(keep_runs=1))).skipped == {}  # released: the next gc runs


def test_a_renewal_that_fails_once_is_tried_again_and_the_lease_stays_held(tmp_path):
    """One failed write of the renewer (an S3 hiccup) does not end the renewals: the lease is still
    renewed after it and the holder can go on (it was lost for good at the first error)."""
    import threading
    import time

    from posttrain.storage import StorageError

    class Hiccup(LocalStore):
        renewals = 0

        def put_bytes(self, key, data, **kw):
            if kw.get("if_match"):
                Hiccup.renewals += 1
                if Hiccup.renewals == 1:
                    raise StorageError("503 Slow Down")
            return super().put_bytes(key, data, **kw)

    store = Hiccup(tmp_path / "store")
    with holding(store, "prod", "rollback", run="r1", ttl=8.0) as lease:  # renewed every 2 s
        deadline = time.monotonic() + 60
        while Hiccup.renewals < 3:  # renewed every ttl/4: the failed one, then two that worked
            assert time.monotonic() < deadline, f"{Hiccup.renewals} renewals"
            time.sleep(0.05)
        lease.check()  # raises if the renewer gave up
        assert any(t.name == "lease-prod" for t in threading.enumerate())
