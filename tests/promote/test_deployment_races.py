"""Promotion, rollback and gc racing in real processes on one folder store (tests/support/deployment_race.py):
production is a file a hot-load writes (not a reference server: a server per process would cost
more than the races themselves, and what is checked is the history against what production
serves). After every race: production serves the history's champion, the loser changed nothing
and says why in one line, and what a record names is in the store."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from posttrain.promote.history import History
from posttrain.promote.lease import lease_key
from posttrain.storage import LocalStore
from posttrain.storage.lease import read_lease
from tests.promote.test_one_writer import Site
from tests.support.chains import snapshots_in
from tests.support.deployment_race import (gc_worker, promote_worker, release_together, result, rollback_worker,
                                           seed_evals, served, start)

pytestmark = pytest.mark.timeout(300)


def wait_for(condition, what: str, timeout: float = 90.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def lost_in_one_line(outcome: dict) -> str:
    assert not outcome["ok"] and outcome["error"] == "OperationLost", outcome
    assert "\n" not in outcome["message"]
    return outcome["message"]


@pytest.fixture
def site(tmp_path) -> Site:
    s = Site(tmp_path)
    s.champion_is(s.a, s.b)
    return s


def test_a_rollback_recorded_while_the_gate_evaluates_makes_the_promotion_lose(site, tmp_path):
    """Item 1: the promotion read champion b and is evaluating; an operator rolls back to a; the
    promotion then loses with nothing changed: production keeps serving a, which the history names."""
    seed_evals(site.store, {site.b: 0.1, site.c: 0.9})
    gate, reached = tmp_path / "go", tmp_path / "reached"
    out_p, out_r = tmp_path / "p.json", tmp_path / "r.json"
    p = start(promote_worker, str(site.store.root), site.c, "nightly-7", str(site.file), str(out_p),
              store_kw={"read_pause": ".posttrain/evals/", "gate": gate, "reached": reached})
    wait_for(reached.exists, "the promotion to start its evals")
    r = start(rollback_worker, str(site.store.root), "previous", "rollback-1", str(site.file), str(out_r))
    assert result(out_r, r)["identity"] == site.a
    gate.touch()
    message = lost_in_one_line(result(out_p, p))
    assert message.startswith(f"deployment prod: its champion changed while {site.c} was evaluated ({site.b} then, "
                              f"{site.a} now, record #3)")
    assert [r.kind for r in site.history.records()] == ["promotion", "promotion", "rollback"]
    assert served(site.file) == site.a == site.history.champion()


@pytest.mark.parametrize("delay", [0.0, 1.5])
def test_promote_and_rollback_at_once(site, tmp_path, delay):
    """Both start together; with a slow hot-load the first holds the deployment while the other asks."""
    seed_evals(site.store, {site.a: 0.1, site.b: 0.1, site.c: 0.9})
    out_p, out_r, go = tmp_path / "p.json", tmp_path / "r.json", tmp_path / "go"
    p = start(promote_worker, str(site.store.root), site.c, "nightly-8", str(site.file), str(out_p),
              loader={"delay": delay}, go=str(go))
    r = start(rollback_worker, str(site.store.root), "previous", "rollback-2", str(site.file), str(out_r),
              loader={"delay": delay}, go=str(go))
    release_together(go, [out_p, out_r])
    outcomes = [result(out_p, p), result(out_r, r)]
    for outcome in outcomes:
        if not outcome["ok"]:
            lost_in_one_line(outcome)
    new = [r.seq for r in site.history.records()][2:]
    assert sorted(o["seq"] for o in outcomes if o["ok"]) == new  # a loser recorded nothing
    assert served(site.file) == site.history.champion()


def test_promote_against_promote(site, tmp_path):
    """Two promotions decided against the same champion: one is recorded and served, the other loses."""
    seed_evals(site.store, {site.b: 0.1, site.c: 0.9, site.old: 0.8})
    outs, go = [tmp_path / "p1.json", tmp_path / "p2.json"], tmp_path / "go"
    procs = [start(promote_worker, str(site.store.root), candidate, f"nightly-{i}", str(site.file), str(out),
                   loader={"delay": 1.0}, go=str(go)) for i, (candidate, out) in enumerate(zip((site.c, site.old), outs))]
    release_together(go, outs)
    outcomes = [result(out, proc) for out, proc in zip(outs, procs)]
    assert sorted(o["ok"] for o in outcomes) == [False, True], outcomes
    winner = (site.c, site.old)[[o["ok"] for o in outcomes].index(True)]
    message = lost_in_one_line(next(o for o in outcomes if not o["ok"]))
    assert message.startswith(("deployment prod is held by promotion nightly-", "deployment prod: its champion changed"))
    records = site.history.records()
    assert [r.kind for r in records] == ["promotion"] * 3 and records[-1].identity == winner
    assert served(site.file) == winner == site.history.champion()


@pytest.mark.parametrize("plan_pause", [0.0, 0.4, 1.2])
def test_rollback_against_gc(site, tmp_path, plan_pause):
    """Item 4, concurrently: gc deletes the older run while a rollback to one of its snapshots goes on.
    Whatever the order, a snapshot a record names is whole in the store, and production serves the champion."""
    out_g, out_r = tmp_path / "g.json", tmp_path / "r.json"
    g = start(gc_worker, str(site.store.root), str(out_g), 1, plan_pause=plan_pause, delete_pause=0.05)
    r = start(rollback_worker, str(site.store.root), site.old, "rollback-3", str(site.file), str(out_r),
              loader={"delay": 0.3})
    gc_done, rolled = result(out_g, g), result(out_r, r)
    assert gc_done["ok"], gc_done
    if not rolled["ok"]:  # gc deleted it before the rollback held the deployment: nothing recorded
        assert rolled["error"] == "PromotionError" and f"unknown identity {site.old}" in rolled["message"], rolled
    store = LocalStore(site.store.root)
    named = {i for r in History(store, "", "prod").records() for i in (r.identity, r.previous) if i}
    chain = site.done.identities("night-0")
    if site.old in named:
        assert set(chain) <= snapshots_in(store)  # its whole chain prefix
    assert served(site.file) == History(store, "", "prod").champion()


def test_a_holder_killed_between_record_and_switch_is_repaired_by_its_retry_or_the_next_operation(site, tmp_path):
    out = tmp_path / "r.json"
    r = start(rollback_worker, str(site.store.root), "previous", "rollback-4", str(site.file), str(out),
              loader={"hang_on": (site.a,)}, lease_ttl=3.0)
    wait_for(lambda: len(site.history.records()) == 3, "the rollback's record")
    time.sleep(0.3)
    os.kill(r.pid, signal.SIGKILL)
    r.join(30)
    assert site.history.champion() == site.a and served(site.file) == site.b  # the moment the invariant covers
    held, _ = read_lease(site.store, lease_key("prod"))
    assert held.pending == site.a and held.run == "rollback-4"

    retry = start(rollback_worker, str(site.store.root), "previous", "rollback-4", str(site.file), str(out))
    done = result(out, retry)  # the same run takes its live lease over, serves the champion, records nothing
    assert done["ok"] and done["again"] and done["seq"] == 3, done
    assert served(site.file) == site.a and len(site.history.records()) == 3
    assert not site.store.exists(lease_key("prod"))

    # killed again, and this time another operation comes after the lease expired
    r = start(rollback_worker, str(site.store.root), site.c, "rollback-5", str(site.file), str(out),
              loader={"hang_on": (site.c,)}, lease_ttl=2.0)
    wait_for(lambda: len(site.history.records()) == 4, "the second rollback's record")
    time.sleep(0.3)
    os.kill(r.pid, signal.SIGKILL)
    r.join(30)
    time.sleep(2.5)
    seed_evals(site.store, {site.c: 0.9, site.b: 0.1})
    out_p = tmp_path / "p.json"
    p = start(promote_worker, str(site.store.root), site.b, "nightly-3", str(site.file), str(out_p))
    refused = result(out_p, p)
    assert refused["ok"] and not refused["promoted"], refused
    assert served(site.file) == site.c == site.history.champion()  # repaired first, then refused
    assert json.loads(out_p.read_text())["seq"] == 5
