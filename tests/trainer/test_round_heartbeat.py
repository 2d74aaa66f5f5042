"""A resident trainer's wait for a round is kept alive by the flow's heartbeat while the flow works
on the round (a slow hot-load, a long sampling), and ends ``round_timeout_s`` after the heartbeat
last changed: once the flow is gone. The flow is another process here, beating with the flow's own
helper (``posttrain.runs.resident.keep_rounds_alive``); the trainer's side is ``wait_for_round``."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from pathlib import Path

import pytest

from posttrain.runs.resident import heartbeat_interval, keep_rounds_alive
from posttrain.trainer import TrainerConfig
from posttrain.trainer.resident import wait_for_round
from posttrain.trainer.rounds import ROLLOUTS_FILE, RoundError, hand_round, heartbeat_path, round_dir

TIMEOUT_S = 2.0
BEAT_S = 0.1


def config(tmp_path: Path) -> TrainerConfig:
    return TrainerConfig(mode="resident", model_name_or_path=str(tmp_path / "model"), output_dir=str(tmp_path / "out"),
                         rounds_dir=str(tmp_path / "rounds"), rounds=1, use_cpu=True, round_timeout_s=TIMEOUT_S)


def flow(rounds_dir: str, working_s: float, hand: bool) -> None:
    """The flow's process: beats while it works on round 0 for ``working_s``, then hands it (or dies)."""
    with keep_rounds_alive(rounds_dir, BEAT_S):
        time.sleep(working_s)
        if hand:
            path = round_dir(rounds_dir, 0) / ROLLOUTS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
            hand_round(rounds_dir, 0, 0)


def start_flow(tmp_path: Path, working_s: float, hand: bool):
    """The flow process, once its first beat is written (a loaded machine may take seconds to start it)."""
    rounds_dir = tmp_path / "rounds"
    proc = multiprocessing.get_context("spawn").Process(target=flow, args=(str(rounds_dir), working_s, hand))
    proc.start()
    deadline = time.monotonic() + 120
    while not heartbeat_path(rounds_dir).exists():
        assert proc.is_alive() or proc.exitcode is None, f"the flow process exited {proc.exitcode}"
        assert time.monotonic() < deadline, "no heartbeat in 120 s"
        time.sleep(0.05)
    return proc


def test_a_round_longer_than_the_timeout_is_waited_for_while_the_flow_beats(tmp_path):
    proc = start_flow(tmp_path, working_s=3 * TIMEOUT_S, hand=True)
    t0 = time.monotonic()
    try:
        ready = wait_for_round(config(tmp_path), 0, "cpu", threading.Event())
    finally:
        proc.join(timeout=120)
    assert ready is not None and ready.round == 0
    assert time.monotonic() - t0 > 2 * TIMEOUT_S  # it outlasted round_timeout_s, kept alive by the beats
    assert proc.exitcode == 0


def test_the_wait_ends_once_the_heartbeat_stops(tmp_path):
    proc = start_flow(tmp_path, working_s=1.5 * TIMEOUT_S, hand=False)  # the flow dies without handing the round
    t0 = time.monotonic()
    with pytest.raises(RoundError) as raised:
        wait_for_round(config(tmp_path), 0, "cpu", threading.Event())
    waited = time.monotonic() - t0
    proc.join(timeout=120)
    assert proc.exitcode == 0
    message = str(raised.value)
    folder, beat = round_dir(tmp_path / "rounds", 0), heartbeat_path(tmp_path / "rounds")
    assert message.startswith(f"round 0: no rollouts in {folder} after {TIMEOUT_S:g} s without a heartbeat "
                              f"from the flow (the flow's heartbeat {beat} last changed "), message
    age = float(re.search(r"last changed ([0-9.]+) s ago", message).group(1))
    assert age >= TIMEOUT_S and waited >= 1.5 * TIMEOUT_S, (age, waited)  # after the beats, not before
    assert waited < 60


def test_without_a_heartbeat_the_wait_is_round_timeout_s(tmp_path):
    # A flow that never beats (an older flow, or one gone before its first beat): the timeout counts
    # from the start of the wait, as before the heartbeat.
    t0 = time.monotonic()
    with pytest.raises(RoundError, match=rf"after {TIMEOUT_S:g} s without a heartbeat from the flow \(no flow "
                                         rf"heartbeat at .*flow-heartbeat.json in [0-9.]+ s\)"):
        wait_for_round(config(tmp_path), 0, "cpu", threading.Event())
    assert TIMEOUT_S <= time.monotonic() - t0 < 60


def test_the_flow_beats_several_times_per_timeout():
    assert heartbeat_interval(1800) == 30
    assert heartbeat_interval(6) == 1
    assert heartbeat_interval(0.6) == pytest.approx(0.1)


def test_leaving_the_block_stops_the_beats(tmp_path):
    with keep_rounds_alive(tmp_path / "rounds", 0.01):
        time.sleep(0.1)
    path = heartbeat_path(tmp_path / "rounds")
    last = path.read_bytes()
    time.sleep(0.1)
    assert path.read_bytes() == last
    assert [p.name for p in (tmp_path / "rounds").iterdir()] == ["flow-heartbeat.json"]  # no temporary file left
