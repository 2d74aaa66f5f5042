"""gc and publishers of the same run (``posttrain.publish.lease``): gc skips a run being published,
a publisher waits for gc, expired leases hold nothing, and a publisher whose chain gc retired
goes on with a full snapshot. And gc on an S3 store (moto)."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher
from posttrain.publish.content import checkpoint_content
from posttrain.publish.gc import GcConfig, plan_gc, run_gc
from posttrain.publish.lease import GcLease, LeaseLost, LeaseRecord, RunBusy, leases_prefix, publishing
from posttrain.storage import LocalStore
from tests.support.chains import checkpoints, publish_runs, rebuilds, snapshots_in


def two_runs(tmp_path, steps: int = 3):
    store = LocalStore(tmp_path / "store")
    return store, publish_runs(store, tmp_path, runs=2, steps=steps)


def test_gc_skips_a_run_whose_publisher_holds_its_lease(tmp_path):
    store, done = two_runs(tmp_path)
    with publishing(store, "night-0", tmp_path / "elsewhere"):  # a publisher of night-0 mid-step
        result = run_gc(store, plan_gc(store, GcConfig(keep_runs=1)))
    assert result.deleted == [] and list(result.skipped) == ["night-0"]
    assert "night-0: being published (publisher pid" in result.skipped["night-0"]
    assert snapshots_in(store) == done.all_identities()  # nothing of it went
    assert not list(store.list(leases_prefix("night-0")))  # both leases are released
    result = run_gc(store, plan_gc(store, GcConfig(keep_runs=1)))  # the step is done: the next gc deletes it
    assert result.skipped == {} and snapshots_in(store) == set(done.identities("night-1"))


def test_gc_skips_a_run_that_published_since_the_plan(tmp_path):
    store, done = two_runs(tmp_path)
    plan = plan_gc(store, GcConfig(keep_runs=1))
    more = checkpoints(tmp_path / "more", seed=0, steps=4)[-1]
    with Publisher(store, PublishConfig(run="night-0", work_dir=tmp_path / "night-0" / "work", async_publish=False,
                                        policy=ChainPolicy(max_deltas=3))) as pub:
        pub.publish_step(more, 4)
    result = run_gc(store, plan)
    assert result.deleted == [] and "its ledger changed since the plan (4 snapshots, 3 planned)" in \
        result.skipped["night-0"]
    assert done.all_identities() <= snapshots_in(store)


def test_a_publisher_waits_while_gc_holds_the_run(tmp_path):
    store = LocalStore(tmp_path / "store")
    lease = GcLease(store, "night-0").acquire()
    entered = threading.Event()

    def publisher_step() -> None:
        with publishing(store, "night-0", tmp_path / "work", poll=0.05):
            entered.set()

    thread = threading.Thread(target=publisher_step)
    thread.start()
    assert not entered.wait(0.5)  # gc holds the run: the publisher does not start its step
    lease.release()
    assert entered.wait(10)
    thread.join(10)
    assert not list(store.list(leases_prefix("night-0")))


def test_expired_leases_hold_nothing(tmp_path):
    store, done = two_runs(tmp_path, steps=2)
    past = LeaseRecord(holder="publisher", host="gone", pid=1, expires_at=time.time() - 1)
    store.put_bytes(leases_prefix("night-0") + "publish-crashed.json", past.model_dump_json().encode())
    result = run_gc(store, plan_gc(store, GcConfig(keep_runs=1)))  # a crashed publisher's lease ran out
    assert result.skipped == {} and snapshots_in(store) == set(done.identities("night-1"))
    # a gc whose lease ran out is taken over, and stops at its next renewal
    stale = GcLease(store, "night-1", clock=lambda: time.time() - 3600).acquire()
    fresh = GcLease(store, "night-1").acquire()
    with pytest.raises(RunBusy, match="^run night-1: held by another gc pid"):
        GcLease(store, "night-1").acquire()
    with pytest.raises(LeaseLost, match="^run night-1: gc's lease was taken over; stopped$"):
        stale.renew()
    stale.release()  # not its own any more: leaves the store alone
    assert store.exists(fresh.key)
    fresh.renew()
    fresh.release()
    assert list(store.list(leases_prefix("night-1"))) == []


def test_a_publisher_whose_chain_gc_retired_goes_on_with_a_full_snapshot(tmp_path):
    store, done = two_runs(tmp_path)
    run_gc(store, plan_gc(store, GcConfig(keep_runs=1)))
    assert not set(done.identities("night-0")) & snapshots_in(store)
    ckpt = checkpoints(tmp_path / "more", seed=0, steps=4)[-1]
    config = PublishConfig(run="night-0", work_dir=tmp_path / "night-0" / "work", async_publish=False,
                           policy=ChainPolicy(max_deltas=3))
    with Publisher(store, config) as pub:  # the same work folder: its head is step 3, gone from the store
        published = pub.publish_step(ckpt, 4)
    assert published.kind == "full"
    assert rebuilds(store, published.identity, tmp_path) == checkpoint_content(ckpt)


def test_gc_on_an_s3_store(store_factory, tmp_path):
    store = store_factory("moto")
    done = publish_runs(store, tmp_path, runs=3, steps=2)
    plan = plan_gc(store, GcConfig(keep_runs=1, protect={done.identities("night-0")[0]}))
    result = run_gc(store, plan)
    assert result.skipped == {}
    assert snapshots_in(store) == set(done.identities("night-2")) | {done.identities("night-0")[0]}
    for identity in snapshots_in(store):
        assert rebuilds(store, identity, tmp_path) == checkpoint_content(done.checkpoints[identity])
    assert not [k for k in store.list(".posttrain/runs/night-1/")]
