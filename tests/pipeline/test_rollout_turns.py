"""Rollout shards take turns for their subflows' API writes on a SQLite-backed Prefect server
(posttrain/pipeline/tasks/rollouts.py), and never keep the turn: checked without a server, with a
stand-in for the subflow that marks where the real one releases and takes the turn."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.pipeline.tasks import rollouts


def _fake_subflow(log: list, fail: bool = False, body_s: float = 0.05):
    def subflow(spec, settings, inference, tokenizer_dir):
        log.append(("start-turn-held", rollouts._TURNS.locked()))
        rollouts._release()  # as the flow body does first
        time.sleep(body_s)  # sampling: overlaps between shards
        if fail:
            raise RuntimeError("sampling failed")
        return spec
    return subflow


@pytest.mark.parametrize("db,serial", [("sqlite", True), ("", True), ("postgres", False),
                                       ("postgresql+asyncpg://u:p@h/db", False)])
def test_the_database_decides(monkeypatch, db, serial):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", db)
    assert rollouts.serial_subflow_writes() is serial


def test_shards_hold_the_turn_only_while_starting(monkeypatch):
    """Four shards' bodies run at once: each waits for all four to be in their bodies, which only
    happens if none holds the turn past its start (the turn waits up to 30 s; the barrier 10)."""
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    log: list = []
    together = threading.Barrier(4, timeout=10)
    met: list[bool] = []
    fake = _fake_subflow(log, body_s=0)

    def subflow(*args):
        out = fake(*args)
        try:
            together.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        return out

    monkeypatch.setattr(rollouts, "rollout_shard", subflow)
    threads = [threading.Thread(target=rollouts._rollout_shard, args=(i, None, "", "")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert met == [True] * 4  # the bodies overlapped
    assert log == [("start-turn-held", True)] * 4
    assert not rollouts._TURNS.locked()


def test_a_failing_subflow_gives_the_turn_back(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow([], fail=True))
    with pytest.raises(RuntimeError):
        rollouts._rollout_shard(0, None, "", "")
    assert not rollouts._TURNS.locked()


def test_no_turn_outside_a_shard_task(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    rollouts._acquire()  # e.g. the subflow run alone: nothing would release a turn
    assert not rollouts._TURNS.locked()


def test_no_turns_on_postgres(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "postgres")
    log: list = []
    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow(log))
    rollouts._rollout_shard(0, None, "", "")
    assert log == [("start-turn-held", False)]


def test_subflows_run_without_heartbeats_and_share_the_parent_task_client(monkeypatch):
    """Inside a shard task, the subflow sees no heartbeat setting (Prefect's engine would join a
    heartbeat thread sleeping in 1 s steps at the subflow's end) and the process's one async
    client, which Prefect's create_run picks up on its event loop; the settings outside are kept."""
    from prefect.context import AsyncClientContext
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    seen = []

    def subflow(spec, settings, inference, tokenizer_dir):
        rollouts._release()
        seen.append((get_current_settings().flows.heartbeat_frequency, AsyncClientContext.get().client))
        return spec

    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "postgres")
    monkeypatch.setattr(rollouts, "rollout_shard", subflow)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing is sent
        for shard in range(2):
            rollouts._rollout_shard(shard, None, "x/y", "tok")
    assert [hb for hb, _ in seen] == [None, None]
    assert seen[0][1] is seen[1][1] and not seen[0][1]._closed
    assert get_current_settings().flows.heartbeat_frequency is not None
    assert AsyncClientContext.get() is None
