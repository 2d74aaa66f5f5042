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
    monkeypatch.setenv("POSTTRAIN_PREFECT_DB", "sqlite")
    log: list = []
    monkeypatch.setattr(rollouts, "rollout_shard", _fake_subflow(log, body_s=0.2))
    threads = [threading.Thread(target=rollouts._rollout_shard, args=(i, None, "", "")) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 0.6  # the bodies overlapped (4 x 0.2 s one after another: 0.8 s)
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
