"""mode: resident: one job for all the rounds of a GRPO run; rounds handed on shared storage."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from posttrain.datasets.toy import toy_prompt_rows
from posttrain.rewards import length_reward
from posttrain.rollouts.format import RolloutError, write_rollouts
from posttrain.testing.sampler import sample_rollouts
from posttrain.trainer import TrainerConfig, grpo_update, run_training
from posttrain.trainer import resident as resident_mode
from posttrain.trainer.checkpoints import complete_checkpoints, try_inspect
from posttrain.trainer.rounds import READY_FILE, ROLLOUTS_FILE, RoundError, hand_round, read_ready, round_dir
from tests.trainer.test_trainer_step import _config as step_config
from tests.trainer.test_trainer_step import _weights


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    """16 rollouts (4 prompts x 4) sampled by the tiny model, policy version 0."""
    return sample_rollouts(tiny_model_dir, toy_prompt_rows(4), group_size=4, max_new_tokens=8,
                           reward_func=length_reward)  # fmt: skip


def round_rollouts(sampled, r: int):
    """Round r's rollouts: a different set of whole groups (4 rollouts each) per round, all version 0."""
    return [sampled[:16], sampled[4:16], sampled[:12]][r]


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(resident_mode, "POLL_INTERVAL_S", 0.05)


@pytest.fixture
def loads(monkeypatch):
    """The folders the trainer loaded a policy from, in order."""
    seen: list[Path] = []
    original = grpo_update.load_policy

    def counting(model_dir, config, dtype):
        seen.append(Path(model_dir))
        return original(model_dir, config, dtype)

    monkeypatch.setattr(grpo_update, "load_policy", counting)
    return seen


def resident_config(model_dir, out: Path, rounds_dir: Path, **changes) -> TrainerConfig:
    base = dict(mode="resident", model_name_or_path=str(model_dir), output_dir=str(out), rounds_dir=str(rounds_dir),
                rounds=3, learning_rate=1e-3, per_device_train_batch_size=6, use_cpu=True, max_staleness=2,
                round_timeout_s=120)  # fmt: skip
    return TrainerConfig(**{**base, **changes})


def hand(rounds_dir: Path, r: int, rollouts, *, mark: bool = True) -> Path:
    """The flow's side of round r: the rollouts file (atomically), then the marker."""
    path = write_rollouts(round_dir(rounds_dir, r) / ROLLOUTS_FILE, rollouts)
    if mark:
        hand_round(rounds_dir, r, sorted({x.policy_version for x in rollouts}))
    return path


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Background:
    """run_training in a thread, with its stop event; ``join`` returns its result or raises its error."""

    def __init__(self, config: TrainerConfig):
        self.stop = threading.Event()
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self.thread.start()

    def _run(self, config):
        try:
            self.outcome["result"] = run_training(config, stop_event=self.stop)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.outcome["error"] = e

    def join(self, timeout: float = 300.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the trainer did not end"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["result"]


def test_three_rounds_in_one_job_train_as_three_step_jobs(tiny_model_dir, sampled, tmp_path, loads):
    rounds_dir, out = tmp_path / "rounds", tmp_path / "policy"
    run = Background(resident_config(tiny_model_dir, out, rounds_dir))
    for r in range(3):
        hand(rounds_dir, r, round_rollouts(sampled, r), mark=False)  # rollouts without the marker: not yet
        time.sleep(0.3)
        assert not (out / f"checkpoint-{r + 1}").exists()
        hand_round(rounds_dir, r, 0)
        wait_for(lambda r=r: try_inspect(out / f"checkpoint-{r + 1}") is not None)
        assert [c.step for c in complete_checkpoints(out)] == list(range(1, r + 2))
        assert run.thread.is_alive() or r == 2
    result = run.join()
    assert (result.mode, result.completed, result.rounds_done) == ("resident", True, 3)
    assert (result.global_step, result.policy_version, result.checkpoint) == (3, 3, out / "checkpoint-3")
    assert loads == [tiny_model_dir]  # the policy was loaded once
    assert [c.policy_version for c in complete_checkpoints(out)] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]

    # The same rounds as step-mode jobs, one process (and one load) each: the same policies.
    policy, steps = tiny_model_dir, []
    for r in range(3):
        done = run_training(step_config(policy, tmp_path / "steps", round_dir(rounds_dir, r) / ROLLOUTS_FILE,
                                        max_staleness=2))  # fmt: skip
        policy = done.checkpoint
        steps.append(done)
    assert len(loads) == 4
    import torch

    for r, done in enumerate(steps):
        mine = json.loads((out / f"checkpoint-{r + 1}" / "trainer_state.json").read_text())
        theirs = json.loads((done.checkpoint / "trainer_state.json").read_text())
        for key in ("global_step", "policy_version", "rollouts_sha256", "rollouts_used", "rollouts_dropped_stale"):
            assert mine[key] == theirs[key], key
        assert mine["source_checkpoint"] == str(tiny_model_dir if r == 0 else out / f"checkpoint-{r}")
        assert mine["metrics"] == pytest.approx(theirs["metrics"], rel=1e-4, abs=1e-6)
        a, b = _weights(out / f"checkpoint-{r + 1}"), _weights(done.checkpoint)
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert result.metrics == pytest.approx(steps[-1].metrics, rel=1e-4, abs=1e-6)
    assert steps[1].metrics["optimizer_state_restored"] == result.metrics["optimizer_state_restored"] == 1.0


def test_a_restart_resumes_after_the_last_written_round(tiny_model_dir, sampled, tmp_path, loads, monkeypatch):
    rounds_dir, out = tmp_path / "rounds", tmp_path / "policy"
    config = resident_config(tiny_model_dir, out, rounds_dir)
    for r in range(2):
        hand(rounds_dir, r, round_rollouts(sampled, r))
    # A stop request during round 1's update (SIGTERM of a requeue): round 0 is written, round 1 is not.
    stop = threading.Event()
    calls = []
    original = grpo_update.train

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stop.set()
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo_update, "train", stopping)
    first = run_training(config, stop_event=stop)
    assert (first.completed, first.stopped_early, first.rounds_done) == (False, True, 1)
    assert (first.checkpoint, first.global_step, first.policy_version) == (out / "checkpoint-1", 1, 1)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]  # no partial checkpoint, no staging folder
    written = (out / "checkpoint-1" / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(grpo_update, "train", original)

    hand(rounds_dir, 2, round_rollouts(sampled, 2))
    second = run_training(config)  # the restarted job
    assert (second.completed, second.rounds_done, second.resumed_from) == (True, 3, out / "checkpoint-1")
    assert loads == [tiny_model_dir, out / "checkpoint-1"]  # weights and optimizer.pt of round 0's checkpoint
    assert (out / "checkpoint-1" / "model.safetensors").stat().st_mtime_ns == written  # round 0 not trained again
    assert [c.step for c in complete_checkpoints(out)] == [1, 2, 3]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["metrics"]["optimizer_state_restored"] == 1.0 and state["source_checkpoint"] == str(
        out / "checkpoint-1")

    # The same rounds as step-mode jobs give the same policy: the restart lost nothing.
    policy = tiny_model_dir
    for r in range(3):
        policy = run_training(step_config(policy, tmp_path / "steps", round_dir(rounds_dir, r) / ROLLOUTS_FILE,
                                          max_staleness=2)).checkpoint  # fmt: skip
    import torch

    a, b = _weights(out / "checkpoint-3"), _weights(policy)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)

    third = run_training(config)  # every round written: nothing to load or train
    assert (third.already_done, third.completed, third.rounds_done, third.checkpoint) == (
        True, True, 3, out / "checkpoint-3")
    assert len(loads) == 5


def test_a_round_that_never_comes_ends_the_job(tiny_model_dir, sampled, tmp_path, capsys):
    from posttrain.trainer.__main__ import main

    rounds_dir, out = tmp_path / "rounds", tmp_path / "policy"
    config = resident_config(tiny_model_dir, out, rounds_dir, round_timeout_s=1.0, rounds=1)
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    started = time.monotonic()
    try:
        assert main([str(path)]) == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert time.monotonic() - started < 30  # the load, then 1 s of waiting
    assert f"round 0: no rollouts in {rounds_dir / '0000'} after 1 s" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []

    # Rollouts replaced after the hand-over are refused, not trained on.
    hand(rounds_dir, 0, round_rollouts(sampled, 0))
    write_rollouts(round_dir(rounds_dir, 0) / ROLLOUTS_FILE, round_rollouts(sampled, 1))
    with pytest.raises(RoundError, match="round 0: .* its marker hands"):
        run_training(config)


def test_stale_rollouts_are_dropped_per_round(tiny_model_dir, sampled, tmp_path):
    rounds_dir, out = tmp_path / "rounds", tmp_path / "policy"
    config = resident_config(tiny_model_dir, out, rounds_dir, max_staleness=0)
    hand(rounds_dir, 0, sampled)
    # Round 1 trains version 1: with max_staleness 0, its version-0 rollouts are dropped.
    hand(rounds_dir, 1, [r.model_copy(update={"policy_version": 1}) for r in sampled[:8]] + sampled[8:])
    hand(rounds_dir, 2, sampled)  # all version 0, two versions older than version 2
    with pytest.raises(RolloutError, match="more than max_staleness=0 versions older than policy version 2"):
        run_training(config)
    states = [json.loads((out / f"checkpoint-{s}" / "trainer_state.json").read_text()) for s in (1, 2)]
    assert [(s["rollouts_used"], s["rollouts_dropped_stale"]) for s in states] == [(16, 0), (8, 8)]
    assert states[1]["metrics"]["staleness_max"] == 0.0
    assert not (out / "checkpoint-3").exists()


def test_round_markers(tmp_path):
    rounds_dir = tmp_path / "rounds"
    assert read_ready(rounds_dir, 0) is None
    (round_dir(rounds_dir, 0)).mkdir(parents=True)
    (round_dir(rounds_dir, 0) / ROLLOUTS_FILE).write_text('{"a": 1}\n')
    ready = hand_round(rounds_dir, 0, [1, 0, 1])
    assert ready.policy_versions == [0, 1] and read_ready(rounds_dir, 0) == ready
    assert hand_round(rounds_dir, 0, 1) == ready  # a retried hand-over of the same file
    (round_dir(rounds_dir, 0) / ROLLOUTS_FILE).write_text('{"a": 2}\n')
    with pytest.raises(RoundError, match="round 0: .* already hands rollouts"):
        hand_round(rounds_dir, 0, 1)
    (round_dir(rounds_dir, 1)).mkdir()
    (round_dir(rounds_dir, 1) / READY_FILE).write_text((round_dir(rounds_dir, 0) / READY_FILE).read_text())
    with pytest.raises(RoundError, match="round 1: .* hands round 0"):
        read_ready(rounds_dir, 1)


def test_resident_config_fields():
    with pytest.raises(ValueError, match="rounds_dir: required when mode is resident"):
        TrainerConfig(mode="resident", model_name_or_path="/m", output_dir="/o", rounds=2)
    config = TrainerConfig(mode="resident", model_name_or_path="/m", output_dir="/o", rounds_dir="/r", rounds=2)
    assert config.round_timeout_s == 3600 and config.max_staleness == 1


def test_flow_settings_per_mode():
    """The flows' trainer settings: the resident fields only in resident mode, the shared step fields in both."""
    from posttrain.pipeline.settings import GrpoTrainerSettings, StepTrainerSettings, trainer_settings

    resident = set(trainer_settings("resident").model_fields)
    step, grpo = set(StepTrainerSettings.model_fields), set(GrpoTrainerSettings.model_fields)
    assert "round_timeout_s" in resident and "round_timeout_s" not in step | grpo
    assert {"rounds", "rounds_dir", "rollouts"}.isdisjoint(resident | step | grpo)  # the flow fills them in
    assert {"importance_sampling_cap", "ref_model_name_or_path", "per_device_train_batch_size"} <= resident & step
    assert "max_staleness" not in grpo and "per_device_train_batch_size" in grpo
    # the GRPO flow sets temperature (the rollouts') and max_staleness (its own, GrpoSettings.max_staleness) itself
    assert resident - step == {"round_timeout_s", "temperature", "max_staleness"}
