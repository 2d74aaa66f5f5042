"""Retention across runs (``posttrain.publish.gc``): what the rule keeps, the order it deletes in,
readers during a gc, and bad input refused with nothing deleted."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from posttrain.chain.checkpoint import INDEX_NAME
from posttrain.chain.fetch import SnapshotSource
from posttrain.publish.content import checkpoint_content
from posttrain.publish.gc import GcConfig, GcError, plan_gc, run_gc
from posttrain.publish.ledger import RUNS_PREFIX, Ledger, published_steps
from posttrain.storage import LocalStore
from posttrain.storage.prefixed import PrefixedStore
from tests.support.chains import age_run, publish_runs, rebuilds, snapshots_in, store_files

RUNS = [f"night-{n}" for n in range(5)]


def test_keep_two_runs_deletes_the_rest_and_every_kept_version_rebuilds(nightly, tmp_path):
    store, done = nightly
    plan = plan_gc(store, GcConfig(keep_runs=2))
    assert [r.run for r in plan.runs] == RUNS[::-1]
    assert [r.run for r in plan.runs if r.kept] == ["night-4", "night-3"]
    assert plan.whole == {"night-0", "night-1", "night-2"}
    result = run_gc(store, plan)
    assert result.skipped == {}
    gone = {i for run in RUNS[:3] for i in done.identities(run)}
    assert {d.identity for d in result.deleted} == gone
    assert result.freed_bytes == plan.total_bytes > 0
    kept = {i for run in RUNS[3:] for i in done.identities(run)}
    assert snapshots_in(store) == kept
    assert not any(k.split("/")[0] in gone for k in store.list())  # no file of a deleted snapshot is left
    runs_left = {k[len(RUNS_PREFIX):].split("/")[0] for k in store.list(RUNS_PREFIX)}
    assert runs_left == {"night-3", "night-4"}  # deleted runs lose their whole ledger folder
    for identity in kept:
        assert rebuilds(store, identity, tmp_path) == checkpoint_content(done.checkpoints[identity])
    assert plan_gc(store, GcConfig(keep_runs=2)).doomed == []  # a second gc finds nothing


def test_a_protected_version_keeps_exactly_its_chain_prefix(nightly, tmp_path):
    store, done = nightly
    steps = {step: (identity, kind) for step, identity, kind, _ in done.runs["night-1"]}
    assert [steps[s][1] for s in range(1, 6)] == ["full", "delta", "delta", "delta", "full"]
    protected = steps[3][0]  # the second delta of night-1's first chain
    result = run_gc(store, plan_gc(store, GcConfig(keep_runs=2, protect={protected})))
    left = snapshots_in(store)
    assert {steps[1][0], steps[2][0], steps[3][0]} <= left  # its full snapshot and the deltas up to it
    assert steps[4][0] not in left and steps[5][0] not in left  # the delta after it, the other chain
    assert not any(i in left for run in ("night-0", "night-2") for i in done.identities(run))
    assert rebuilds(store, protected, tmp_path) == checkpoint_content(done.checkpoints[protected])
    # the partly kept run keeps its ledger for what is left, its step claims and latest pointer
    assert sorted(published_steps(store, "night-1")) == [1, 2, 3]
    assert Ledger(store, "night-1").claim(5) is not None and Ledger(store, "night-1").latest()[0] is not None


def test_keep_days_keeps_runs_published_within_the_window(nightly):
    store, done = nightly
    for n, run in enumerate(RUNS):
        age_run(store, run, days=10 - 2 * n)  # 10, 8, 6, 4, 2 days ago
    plan = plan_gc(store, GcConfig(keep_days=5))
    assert [r.run for r in plan.runs if r.kept] == ["night-4", "night-3"]
    run_gc(store, plan)
    assert snapshots_in(store) == {i for run in RUNS[3:] for i in done.identities(run)}


def test_dry_run_is_a_plan_that_deletes_nothing_and_reports_the_bytes(nightly):
    store, done = nightly
    before = store_files(store)
    plan = plan_gc(store, GcConfig(keep_runs=4))
    assert {d.identity for d in plan.doomed} == set(done.identities("night-0"))
    assert [(d.run, d.kind, d.step) for d in plan.doomed] == [  # the newer chain first, its deltas newest first
        ("night-0", "full", 5), ("night-0", "delta", 4), ("night-0", "delta", 3), ("night-0", "delta", 2),
        ("night-0", "full", 1)]
    ledger = {e.identity: e.stored_bytes for e in Ledger(store, "night-0").entries()}
    assert plan.total_bytes == sum(ledger.values()) == sum(d.bytes for d in plan.doomed)
    sizes = {i: sum(store.size(k) for k in store.list(f"{i}/")) for i in ledger}
    assert sizes == ledger  # the bytes reported are the bytes in the store
    assert store_files(store) == before


class RecordingStore(LocalStore):
    """Records every key deleted, in order."""

    def __init__(self, root):
        super().__init__(root)
        self.deleted: list[str] = []

    def delete(self, keys):
        keys = list(keys)
        self.deleted += keys
        super().delete(keys)


def test_deletion_order_is_newest_first_index_first_ledger_last(nightly):
    store, done = nightly
    recording = RecordingStore(store.root)
    run_gc(recording, plan_gc(recording, GcConfig(keep_runs=4)))
    order = [k for k in recording.deleted if ".posttrain/runs/night-0/leases/" not in k]
    first = {}
    for pos, key in enumerate(order):
        first.setdefault(key, pos)
    steps = {step: identity for step, identity, _, _ in done.runs["night-0"]}
    for chain in ([1, 2, 3, 4], [5]):
        for step in chain:
            identity = steps[step]
            files = [first[k] for k in first if k.startswith(f"{identity}/") and not k.endswith(INDEX_NAME)]
            assert files and first[f"{identity}/{INDEX_NAME}"] < min(files)  # the commit marker first
            assert max(files) < first[f".posttrain/runs/night-0/ledger/{identity}.json"]  # its record last
        indexes = [first[f"{steps[s]}/{INDEX_NAME}"] for s in chain]
        assert indexes == sorted(indexes, reverse=True)  # the last delta first, the full snapshot last
    ledger_folder = [p for k, p in first.items() if k.endswith("/run.json") or k.endswith("/latest.json")]
    assert ledger_folder and min(ledger_folder) > first[f"{steps[1]}/{INDEX_NAME}"]  # the run's ledger at the end


class SlowStore(LocalStore):
    """Deletes slowly, so a reader has time to run while gc is deleting."""

    def delete(self, keys):
        time.sleep(0.01)
        super().delete(keys)


def test_readers_of_kept_versions_never_fail_during_a_gc(nightly, tmp_path):
    store, done = nightly
    slow = SlowStore(store.root)
    kept = [i for run in RUNS[3:] for i in done.identities(run)]
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        n = 0
        while not stop.is_set() and n < 200:  # bounded
            identity = kept[n % len(kept)]
            try:  # resolve and fetch the chain afresh from the store, every byte checked
                source = SnapshotSource(LocalStore(store.root), "", tmp_path / f"cache-{n}")
                for name in source.plan(identity, held=None).snapshots:
                    source.fetch(name)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            n += 1
            reads[0] = n

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        result = run_gc(slow, plan_gc(slow, GcConfig(keep_runs=2)))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors[:3]
    assert len(result.deleted) == 15 and reads[0] >= 2


def test_bad_input_is_refused_with_nothing_deleted(nightly):
    store, done = nightly
    before = store_files(store)
    for kwargs, field in [({"keep_runs": 0}, "keep_runs"), ({"keep_runs": -1}, "keep_runs"),
                          ({"keep_days": 0}, "keep_days"), ({"keep_runs": 2, "keep_days": 3}, "exactly one"),
                          ({}, "exactly one"), ({"keep_runs": 2, "bogus": 1}, "bogus")]:
        with pytest.raises(ValidationError, match=field):
            GcConfig(**kwargs)
    real = done.identities("night-0")[1]
    typo = real[:-1] + ("0" if real[-1] != "0" else "1")
    with pytest.raises(GcError, match=rf"^protected identity '{typo}' is not a snapshot in {store.uri} .*a typo\? "
                                      "nothing was deleted$"):
        plan_gc(store, GcConfig(keep_runs=1, protect=[real, typo]))
    with pytest.raises(GcError, match="'../x' is not a snapshot"):
        plan_gc(store, GcConfig(keep_runs=1, protect={"../x"}))
    assert store_files(store) == before


def test_a_snapshot_no_ledger_has_can_be_protected_and_its_base_is_kept(nightly, tmp_path):
    """Another producer's delta on top of a published version protects that version's prefix."""
    store, done = nightly
    steps = {step: identity for step, identity, _, _ in done.runs["night-0"]}
    index = ('{"metadata": {"version": "foreign-1", "base_version": "%s", "delta_encoding": "xor", '
             '"compression_format": "zstd", "checksum_format": "adler32"}, "weight_map": {}}') % steps[2]
    store.put_bytes(f"foreign-1/{INDEX_NAME}", index.encode())
    run_gc(store, plan_gc(store, GcConfig(keep_runs=4, protect={"foreign-1"})))
    assert snapshots_in(store) & set(done.identities("night-0")) == {steps[1], steps[2]}
    assert "foreign-1" in snapshots_in(store)  # gc never deletes what no ledger lists


def test_a_prefix_of_the_store_is_collected_alone(tmp_path):
    base = LocalStore(tmp_path / "store")
    a, b = PrefixedStore(base, "team-a"), PrefixedStore(base, "team-b")
    done_a = publish_runs(a, tmp_path / "a", runs=2, steps=2)
    publish_runs(b, tmp_path / "b", runs=2, steps=2)
    before_b = sorted(b.list())
    run_gc(a, plan_gc(a, GcConfig(keep_runs=1)))
    assert snapshots_in(a) == set(done_a.identities("night-1"))
    assert sorted(b.list()) == before_b
