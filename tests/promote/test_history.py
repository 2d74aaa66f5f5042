"""The promotion history: create-only records per deployment, the champion stack, races."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime

import pytest
from pydantic import ValidationError

from posttrain.errors import describe_validation_error
from posttrain.promote.decision import Decision
from posttrain.promote.history import History, HistoryConflict, HistoryError, Record
from posttrain.storage import PreconditionFailed, Store

A, B, C, D = (f"step-0000000{i}-{'abcd'[i - 1] * 32}" for i in range(1, 5))


def decision(accepted: bool, candidate: str, champion: str | None) -> Decision:
    return Decision(accepted=accepted, reason=f"{'accepted' if accepted else 'refused'}: test", rule="superiority",
                    margin=0.0, confidence=0.95, bootstrap_samples=10_000, seed=0, candidate=candidate,
                    champion=champion, prompts=16, samples_per_prompt=4)


def promotion(identity: str, previous: str | None, deployment: str = "prod") -> Record:
    return Record(kind="promotion", deployment=deployment, identity=identity, previous=previous, run="nightly-1",
                  decision=decision(True, identity, previous), reason="accepted: better")


def refusal(identity: str, previous: str | None) -> Record:
    return Record(kind="refusal", deployment="prod", identity=identity, previous=previous, run="nightly-2",
                  decision=decision(False, identity, previous), reason="refused: not better")


def rollback(identity: str, previous: str) -> Record:
    return Record(kind="rollback", deployment="prod", identity=identity, previous=previous,
                  reason="rolled back by an operator")


@pytest.mark.parametrize("kind,prefix", [("local", ""), ("local", "chains/nightly"), ("moto", "chains/nightly")])
def test_records_round_trip_in_order_next_to_the_chain(store_factory: Callable[..., Store], kind: str,
                                                       prefix: str) -> None:
    store = store_factory(kind)
    history = History(store, prefix, "prod")
    assert history.records() == [] and history.champion() is None and history.previous_champion() is None
    written = [history.append(promotion(A, None)), history.append(promotion(B, A)),
               history.append(refusal(C, B)), history.append(rollback(A, B))]
    assert [r.seq for r in written] == [1, 2, 3, 4]
    assert History(store, prefix, "prod").records() == written
    root = f"{prefix}/" if prefix else ""
    assert list(store.list(root + ".posttrain/promotions/")) == [
        f"{root}.posttrain/promotions/prod/0000000{i}.json" for i in range(1, 5)]
    stored = json.loads(store.get_bytes(f"{root}.posttrain/promotions/prod/00000002.json")[0])
    assert stored["kind"] == "promotion" and stored["previous"] == A and stored["decision"]["accepted"] is True
    assert stored["at"].endswith("Z") and stored["format"] == "posttrain.promotion/1"
    assert history.champion() == A and history.identities() == {A, B, C}
    assert History(store, prefix, "staging").records() == []  # one history per deployment


@pytest.fixture
def history(store_factory: Callable[..., Store]) -> History:
    return History(store_factory("local"), "", "prod")


def test_champion_after_promotion_refusal_and_rollback(history: History) -> None:
    history.append(promotion(A, None))
    assert (history.champion(), history.previous_champion()) == (A, None)
    history.append(promotion(B, A))
    assert (history.champion(), history.previous_champion()) == (B, A)
    history.append(refusal(C, B))  # a refusal changes nothing
    assert (history.champion(), history.previous_champion()) == (B, A)
    history.append(rollback(A, B))
    assert (history.champion(), history.previous_champion()) == (A, None)


def test_rolling_back_to_the_previous_champion_walks_back_and_never_returns_to_the_bad_one(history: History) -> None:
    for identity, previous in ((A, None), (B, A), (C, B)):
        history.append(promotion(identity, previous))
    history.append(rollback(history.previous_champion(), C))
    assert (history.champion(), history.previous_champion()) == (B, A)
    history.append(rollback(history.previous_champion(), B))
    assert (history.champion(), history.previous_champion()) == (A, None)
    history.append(promotion(D, A))
    history.append(rollback(C, D))  # back to one rolled back from earlier: pushed like a promotion
    assert (history.champion(), history.previous_champion()) == (C, D)
    assert history.identities() == {A, B, C, D}


def test_each_record_is_read_once_and_records_written_meanwhile_are_seen(history: History) -> None:
    """A rollback asks for the records five times (target, champion, record): a record is written once,
    so it is read once; every call lists the folder again."""
    history.append(promotion(A, None))
    history.append(promotion(B, A))
    reads: list[str] = []
    get_bytes = history.store.get_bytes
    history.store.get_bytes = lambda key: (reads.append(key), get_bytes(key))[1]
    reader = History(history.store, "", "prod")
    for _ in range(3):
        assert (reader.champion(), reader.previous_champion()) == (B, A)
    assert sorted(reads) == [history.key(1), history.key(2)]
    history.append(promotion(C, B))  # another writer: what it wrote it knows, and does not read back
    assert reads[2:] == []
    assert reader.champion() == C and reads[2:] == [history.key(3)]


def test_a_record_decided_against_another_champion_is_a_conflict(history: History) -> None:
    history.append(promotion(A, None))
    history.append(promotion(B, A))
    with pytest.raises(HistoryConflict) as e:
        history.append(promotion(C, A))
    assert str(e.value) == (f"deployment prod serves {B} according to its history, not {A} (recorded meanwhile, or "
                            "the record's previous is wrong): decide again against the current champion")
    with pytest.raises(HistoryConflict, match="no champion"):
        History(history.store, "", "other").append(promotion(A, B, deployment="other"))
    with pytest.raises(HistoryError, match="cannot join the history of prod"):
        history.append(promotion(C, B, deployment="staging"))
    assert [r.identity for r in history.records()] == [A, B]


class RacingStore:
    """A store whose next create-only put first lets ``before`` run: another writer that gets there first."""

    def __init__(self, inner: Store, before: Callable[[], None] | None = None, land_then_fail: bool = False):
        self.inner, self.before, self.land_then_fail = inner, before, land_then_fail
        self.puts: list[str] = []

    def put_bytes(self, key: str, data: bytes, **kw: object) -> str:
        self.puts.append(key)
        if self.before is not None:
            before, self.before = self.before, None
            before()
        if self.land_then_fail:  # the write lands, its response is lost, the client's retry finds it
            self.land_then_fail = False
            self.inner.put_bytes(key, data, **kw)
            raise PreconditionFailed(f"{key}: exists (if_none_match)")
        return self.inner.put_bytes(key, data, **kw)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_writer_that_loses_the_race_for_a_number_takes_the_next(store_factory: Callable[..., Store]) -> None:
    store = store_factory("local")
    History(store, "", "prod").append(promotion(A, None))
    other = History(store, "", "prod")
    racing = RacingStore(store, before=lambda: other.append(refusal(C, A)))
    won = History(racing, "", "prod").append(refusal(D, A))  # type: ignore[arg-type]
    assert won.seq == 3 and racing.puts == [other.key(2), other.key(3)]
    assert [(r.seq, r.identity) for r in other.records()] == [(1, A), (2, C), (3, D)]
    # a promotion that loses its number to a promotion is decided against a champion that is gone
    racing = RacingStore(store, before=lambda: other.append(promotion(B, A)))
    with pytest.raises(HistoryConflict, match=f"serves {B}"):
        History(racing, "", "prod").append(promotion(C, A))  # type: ignore[arg-type]
    assert other.champion() == B and len(other.records()) == 4


def test_a_write_that_landed_before_its_response_was_lost_is_not_written_twice(
        store_factory: Callable[..., Store]) -> None:
    racing = RacingStore(store_factory("local"), land_then_fail=True)
    history = History(racing, "", "prod")  # type: ignore[arg-type]
    assert history.append(promotion(A, None)).seq == 1
    assert [r.seq for r in history.records()] == [1] and racing.puts == [history.key(1)]


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_concurrent_writers_each_get_their_own_number(store_factory: Callable[..., Store], kind: str) -> None:
    store = store_factory(kind)
    History(store, "", "prod").append(promotion(A, None))
    writers = 6
    start = threading.Barrier(writers)
    results: list[object] = [None] * writers

    def write(i: int, record: Record) -> None:
        start.wait()
        try:
            results[i] = History(store, "", "prod").append(record)
        except HistoryConflict as e:
            results[i] = e

    def race(records: list[Record]) -> None:
        threads = [threading.Thread(target=write, args=(i, r)) for i, r in enumerate(records)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    race([refusal(f"step-{i:08d}-{i:032x}", A) for i in range(writers)])  # refusals: every one lands
    assert sorted(r.seq for r in results) == list(range(2, 2 + writers))
    race([promotion(f"step-{i:08d}-{i:032x}", A) for i in range(writers)])  # promotions over A: one lands
    won = [r for r in results if isinstance(r, Record)]
    assert len(won) == 1 and all(isinstance(r, HistoryConflict) for r in results if r not in won)
    history = History(store, "", "prod")
    assert [r.seq for r in history.records()] == list(range(1, 3 + writers))
    assert history.champion() == won[0].identity and history.previous_champion() == A


@pytest.mark.parametrize("body,problem", [
    (b"not json", "Record: Invalid JSON"),
    (b'{"format": "other/2", "kind": "promotion"}', "format: Input should be 'posttrain.promotion/1'"),
    (b"\xff\xfe", "Record: Invalid JSON"),
])
def test_a_record_that_is_not_one_is_a_one_line_error_naming_its_key(history: History, body: bytes,
                                                                     problem: str) -> None:
    history.append(promotion(A, None))
    history.store.put_bytes(history.key(2), body)
    with pytest.raises(HistoryError) as e:
        history.champion()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{history.store.uri}: .posttrain/promotions/prod/00000002.json "
                                                       "is not a posttrain.promotion/1 record: ")
    assert problem in message


def test_a_record_under_another_number_is_an_error_and_other_files_are_ignored(history: History) -> None:
    history.append(promotion(A, None))
    history.store.put_bytes(".posttrain/promotions/prod/notes.txt", b"hello")
    assert len(history.records()) == 1
    history.store.put_bytes(history.key(7), history.store.get_bytes(history.key(1))[0])
    with pytest.raises(HistoryError, match="00000007.json holds record 1 of deployment prod, not record 7 of prod"):
        history.records()


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "", "-x", "x" * 129, "prod\n", "naïve"])
def test_a_deployment_name_must_be_one_path_segment(store_factory: Callable[..., Store], name: str) -> None:
    with pytest.raises(HistoryError) as e:
        History(store_factory("local"), "", name)
    assert str(e.value).startswith(f"deployment name {name!r} must be 1-128 letters") and "\n" not in str(e.value)
    with pytest.raises(ValidationError, match="deployment name"):
        promotion(A, None, deployment=name)


@pytest.mark.parametrize("fields,problem", [
    ({"decision": None}, "Record: a promotion needs the gate's decision"),
    ({"decision": decision(False, B, A)}, "a promotion needs a decision that accepted the candidate; this one refused"),
    ({"decision": decision(True, C, A)}, f"the decision compared {C} with {A}, not {B} with {A}"),
    ({"decision": decision(True, B, D)}, f"the decision compared {B} with {D}, not {B} with {A}"),
    ({"identity": "../x"}, "identity: identity '../x' is not one path segment"),
    ({"at": datetime(2024, 1, 1)}, "at: must carry a time zone"),
    ({"reason": "two\nlines"}, "reason: must be one non-empty line"),
    ({"kind": "rollback"}, "a rollback carries no gate decision"),
    ({"previous": B, "decision": decision(True, B, B)}, f"{B} is already the champion"),
])
def test_a_record_must_be_consistent(fields: dict, problem: str) -> None:
    base = promotion(B, A).model_dump()
    with pytest.raises(ValidationError) as e:
        Record(**{**base, **fields})
    assert problem in describe_validation_error(e.value)
