"""gc and the promotion histories in the store: what a deployment's history needs (its champion
stack, every promoted and rolled-back-to version and the champions they replaced) survives any
rule, with its chain prefix, without being named; a refused candidate does not; a history record
that cannot be read stops gc with nothing deleted; a reader rebuilding a kept version during a gc
is not disturbed."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.promote.decision import Decision
from posttrain.promote.history import History, Record
from posttrain.publish.content import checkpoint_content
from posttrain.publish.gc import GcConfig, GcError, history_roots, plan_gc, run_gc
from posttrain.storage import LocalStore
from tests.support.chains import rebuilds, snapshots_in, store_files

RUNS = [f"night-{n}" for n in range(5)]


def decision(accepted: bool, candidate: str, champion: str | None) -> Decision:
    return Decision(accepted=accepted, reason=f"{'accepted' if accepted else 'refused'}: test", rule="superiority",
                    margin=0.0, confidence=0.95, bootstrap_samples=10_000, seed=0, candidate=candidate,
                    champion=champion, prompts=16, samples_per_prompt=4)


def record(kind: str, identity: str, previous: str | None, deployment: str = "prod") -> Record:
    gate = None if kind == "rollback" else decision(kind == "promotion", identity, previous)
    return Record(kind=kind, deployment=deployment, identity=identity, previous=previous, decision=gate,
                  run=None if kind == "rollback" else "nightly", reason=f"{kind} in a test")


def step(done, run: str, n: int) -> str:
    return next(i for s, i, _, _ in done.runs[run] if s == n)


def test_what_the_history_needs_survives_gc_without_being_named(nightly, tmp_path):
    store, done = nightly
    a = step(done, "night-0", 3)  # a delta of the oldest run, promoted first
    b = step(done, "night-1", 5)  # a full snapshot, promoted over it
    c = step(done, "night-2", 2)  # refused: its run is refusal-only
    d = step(done, "night-3", 4)  # promoted, then rolled back from
    prod = History(store, "", "prod")
    for r in (record("promotion", a, None), record("promotion", b, a), record("refusal", c, b),
              record("promotion", d, b), record("rollback", b, d)):
        prod.append(r)
    assert prod.champion() == b and prod.previous_champion() == a
    assert history_roots(store) == {a: "history of prod", b: "history of prod", d: "history of prod"}

    plan = plan_gc(store, GcConfig(keep_runs=1))  # only night-4 kept whole
    assert plan.held_back() == {a: "history of prod", b: "history of prod", d: "history of prod"}
    assert plan.protected_by[step(done, "night-4", 1)] == "kept run night-4"
    result = run_gc(store, plan)
    assert result.skipped == {}
    left = snapshots_in(store)
    # each history version keeps exactly its chain prefix; the refused candidate's run goes whole
    assert left == (set(done.identities("night-4")) | {step(done, "night-0", s) for s in (1, 2, 3)}
                    | {b} | {step(done, "night-3", s) for s in (1, 2, 3, 4)})
    assert c not in left and not set(done.identities("night-2")) & left
    for identity in (a, b, d, *done.identities("night-4")):
        assert rebuilds(store, identity, tmp_path) == checkpoint_content(done.checkpoints[identity])
    assert History(store, "", "prod").records() == prod.records()  # gc leaves the history alone
    assert plan_gc(store, GcConfig(keep_runs=1)).doomed == []  # a second gc finds nothing more


def test_every_deployments_history_counts_and_a_missing_snapshot_is_only_reported(nightly):
    store, done = nightly
    a, b = step(done, "night-0", 5), step(done, "night-1", 2)
    History(store, "", "prod").append(record("promotion", a, None))
    History(store, "", "canary.eu-1").append(record("promotion", b, None, deployment="canary.eu-1"))
    gone = "step-00000009-" + "e" * 32  # deleted before gc knew of histories, say
    History(store, "", "old").append(record("promotion", gone, None, deployment="old"))
    store.put_bytes(".posttrain/promotions/not a deployment/00000001.json", b"not ours")  # ignored
    plan = plan_gc(store, GcConfig(keep_runs=3))
    assert plan.held_back() == {a: "history of prod", b: "history of canary.eu-1"}
    assert plan.absent == {gone: "history of old"}
    run_gc(store, plan)
    assert {a, step(done, "night-1", 1)} <= snapshots_in(store)


def test_a_caller_root_is_kept_and_one_the_store_lacks_is_reported(nightly):
    store, done = nightly
    served = step(done, "night-0", 2)
    elsewhere = "step-00000001-" + "f" * 32
    plan = plan_gc(store, GcConfig(keep_runs=4, protect={step(done, "night-0", 5)}),
                   roots={served: "served by dep-1", elsewhere: "served by dep-2"})
    assert plan.held_back() == {served: "served by dep-1", step(done, "night-0", 5): "--protect"}
    assert plan.absent == {elsewhere: "served by dep-2"}
    assert {d.identity for d in plan.doomed} == {step(done, "night-0", s) for s in (3, 4)}


@pytest.mark.parametrize("body", [b"{not json", b'{"format": "posttrain.promotion/1", "seq": 2, "kind": "promotion"}'])
def test_a_malformed_history_record_stops_gc_with_one_line_and_nothing_deleted(nightly, body):
    store, done = nightly
    History(store, "", "prod").append(record("promotion", step(done, "night-0", 1), None))
    key = ".posttrain/promotions/prod/00000002.json"
    store.put_bytes(key, body)
    before = store_files(store)
    with pytest.raises(GcError) as e:
        plan_gc(store, GcConfig(keep_runs=1))
    text = str(e.value)
    assert "\n" not in text and key in text
    assert text.startswith("promotion history of deployment prod: ")
    assert text.endswith("; gc stopped, nothing was deleted")
    assert store_files(store) == before


class PausingStore(LocalStore):
    """A reader's store: its first read waits until gc is deleting, and every read is slow."""

    def __init__(self, root, reading: threading.Event, deleting: threading.Event):
        super().__init__(root)
        self.reading, self.deleting = reading, deleting

    def _pause(self) -> None:
        if not self.reading.is_set():
            self.reading.set()
            assert self.deleting.wait(30), "gc never started deleting"
        time.sleep(0.005)

    def get_bytes(self, key):
        self._pause()
        return super().get_bytes(key)

    def get_file(self, key, local_path):
        self._pause()
        return super().get_file(key, local_path)


class SlowDeletes(LocalStore):
    def __init__(self, root, deleting: threading.Event):
        super().__init__(root)
        self.deleting = deleting
        self.first_delete: float | None = None

    def delete(self, keys):
        if self.first_delete is None:
            self.first_delete = time.monotonic()
        self.deleting.set()
        time.sleep(0.01)
        super().delete(keys)


def test_a_reader_rebuilding_a_kept_version_while_gc_deletes_its_neighbours(nightly, tmp_path):
    """The reader rebuilds a history champion of a run gc is emptying (its chain prefix stays, the
    rest of the run goes) and one of a kept run, both from the store, while gc deletes."""
    store, done = nightly
    champion = step(done, "night-0", 4)
    History(store, "", "prod").append(record("promotion", champion, None))
    reading, deleting = threading.Event(), threading.Event()
    reader_store = PausingStore(store.root, reading, deleting)
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    finished: list[float] = []

    def reader() -> None:
        try:
            for identity in (champion, step(done, "night-4", 3)):
                got[identity] = rebuilds(reader_store, identity, tmp_path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            finished.append(time.monotonic())

    thread = threading.Thread(target=reader)
    thread.start()
    assert reading.wait(30)
    gc_store = SlowDeletes(store.root, deleting)
    try:
        result = run_gc(gc_store, plan_gc(gc_store, GcConfig(keep_runs=1)))
    finally:
        deleting.set()
        thread.join(timeout=120)
    assert not errors, errors
    assert got == {i: checkpoint_content(done.checkpoints[i]) for i in got} and len(got) == 2
    assert gc_store.first_delete is not None and gc_store.first_delete < finished[0]  # they did overlap
    assert {d.identity for d in result.deleted} == (
        {i for run in RUNS[1:4] for i in done.identities(run)} | {step(done, "night-0", 5)})
