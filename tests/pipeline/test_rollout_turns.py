"""Rollout shards take turns for their subflows' API writes (posttrain/pipeline/tasks/turns.py):
one at a time on a SQLite-backed Prefect server, a few at a time on PostgreSQL, and never keep
a turn: checked without a server, with a stand-in for the subflow that gives the turn back and
takes it again where the real one does."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.pipeline.tasks import rollouts, turns
from posttrain.pipeline.tasks.api_retry import QuickRetryOn503
from posttrain.pipeline.tasks.turns import TURNS


def _fake_subflow(log: list, fail: bool = False, body=lambda: time.sleep(0.05)):
    def subflow(spec, settings, inference, tokenizer_dir):
        log.append(("start-turn-held", TURNS.held()))
        TURNS.started()  # as the flow body does first
        try:
            body()  # sampling: overlaps between shards
            if fail:
                raise RuntimeError("sampling failed")
            return spec
        finally:
            TURNS.finishing()
            log.append(("end-turn-held", TURNS.held()))
    return subflow


@pytest.mark.parametrize("db,starts", [("sqlite", 1), ("", 1), ("postgres", 2),
                                       ("postgresql+asyncpg://u:p@h/db", 2)])
def test_the_database_decides(monkeypatch, db, starts):
    monkeypatch.delenv("POSTTRAIN_SUBFLOW_STARTS", raising=False)
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", db)
    assert turns.starts_at_once() == starts


def test_the_environment_sets_the_starts_at_once(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SUBFLOW_STARTS", "5")
    assert turns.starts_at_once() == 5
    monkeypatch.setenv("POSTTRAIN_SUBFLOW_STARTS", "0")
    with pytest.raises(ValueError, match="POSTTRAIN_SUBFLOW_STARTS must be a whole number >= 1, not '0'"):
        turns.starts_at_once()


def _starts_at_once_seen(monkeypatch, shards: int) -> int:
    """Run ``shards`` shard tasks at once, each holding its start for a moment; the most that were
    starting at the same time."""
    starting, most, lock = [0], [0], threading.Lock()

    def subflow(spec, settings, inference, tokenizer_dir):
        with lock:
            starting[0] += 1
            most[0] = max(most[0], starting[0])
        time.sleep(0.05)  # the subflow's start: Prefect's API calls
        with lock:
            starting[0] -= 1
        TURNS.started()
        return spec

    monkeypatch.setattr(rollouts, "rollout_shard", subflow)
    threads = [threading.Thread(target=rollouts._rollout_shard, args=(i, None, "", "")) for i in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return most[0]


@pytest.mark.parametrize("db,most", [("sqlite", 1), ("postgres", 2)])
def test_at_most_that_many_shards_start_at_once(monkeypatch, db, most):
    monkeypatch.delenv("POSTTRAIN_SUBFLOW_STARTS", raising=False)
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", db)
    assert _starts_at_once_seen(monkeypatch, 6) == most


def test_shards_hold_the_turn_only_while_starting(monkeypatch):
    """Four shards' bodies run at once: each waits for all four to be in their bodies, which only
    happens if none holds the turn past its start (the turn waits up to 30 s; the barrier 10)."""
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    log: list = []
    together = threading.Barrier(4, timeout=10)
    met: list[bool] = []

    def body():
        try:
            together.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)

    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow(log, body=body))
    threads = [threading.Thread(target=rollouts._rollout_shard, args=(i, None, "", "")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert met == [True] * 4  # the bodies overlapped
    assert sorted(log) == [("end-turn-held", True)] * 4 + [("start-turn-held", True)] * 4
    assert _starts_at_once_seen(monkeypatch, 3) == 1  # every turn was given back


def test_a_failing_subflow_gives_the_turn_back(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    log: list = []
    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow(log, fail=True))
    with pytest.raises(RuntimeError):
        rollouts._rollout_shard(0, None, "", "")
    assert log == [("start-turn-held", True), ("end-turn-held", True)]  # its Failed write had a turn
    assert not TURNS.held()
    assert _starts_at_once_seen(monkeypatch, 2) == 1


def test_no_turn_outside_a_shard_task(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    TURNS.finishing()  # e.g. the subflow run alone: nothing would give a turn back
    assert not TURNS.held()


def test_no_turn_at_completion_on_postgres(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "postgres")
    log: list = []
    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow(log))
    rollouts._rollout_shard(0, None, "", "")
    assert log == [("start-turn-held", True), ("end-turn-held", False)]


def test_subflows_run_without_heartbeats_and_share_the_parent_task_client(monkeypatch):
    """Inside a shard task, the subflow sees no heartbeat setting (Prefect's engine would join a
    heartbeat thread sleeping in 1 s steps at the subflow's end) and the process's one async
    client, which Prefect's create_run picks up on its event loop; the settings outside are kept."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.context import AsyncClientContext, SyncClientContext
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    seen = []

    def subflow(spec, settings, inference, tokenizer_dir):
        TURNS.started()
        seen.append((get_current_settings().flows.heartbeat_frequency, AsyncClientContext.get().client))
        return spec

    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "postgres")
    monkeypatch.setattr(rollouts, "rollout_shard", subflow)
    flow_client = SyncPrefectClient("http://127.0.0.1:9/api")  # the parent flow's, which the subflow's engine uses
    token = SyncClientContext.__var__.set(SyncClientContext.model_construct(client=flow_client))
    try:
        with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing is sent
            for shard in range(2):
                rollouts._rollout_shard(shard, None, "x/y", "tok")
    finally:
        SyncClientContext.__var__.reset(token)
    assert isinstance(flow_client._client._transport, QuickRetryOn503)  # its flow-run creates too
    assert [hb for hb, _ in seen] == [None, None]
    assert seen[0][1] is seen[1][1] and not seen[0][1]._closed
    assert isinstance(seen[0][1]._client._transport, QuickRetryOn503)  # its task-run creates retry quickly
    assert get_current_settings().flows.heartbeat_frequency is not None
    assert AsyncClientContext.get() is None
