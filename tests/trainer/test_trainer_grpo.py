"""mode: grpo through run_training: real tiny GRPOTrainer runs that resume."""

from __future__ import annotations

import threading

import pytest

from posttrain.rollouts.format import Rollout, write_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.checkpoints import complete_checkpoints
from tests.support.tensorboard import scalar_curves


@pytest.fixture
def grpo_config(tiny_model_dir, staged_toy, tmp_path):
    def make(**changes) -> TrainerConfig:
        base = dict(
            mode="grpo",
            model_name_or_path=str(tiny_model_dir),
            output_dir=str(tmp_path / "run"),
            dataset_manifest=str(staged_toy.manifest_path),
            reward_funcs=["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"],
            learning_rate=1e-3,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            max_steps=2,
            save_steps=1,
            use_cpu=True,
        )
        return TrainerConfig(**{**base, **changes})

    return make


def _global_step(path) -> int:
    import json

    return json.loads((path / "trainer_state.json").read_text())["global_step"]


def test_checkpoints_then_resumes_instead_of_restarting(grpo_config):
    first = run_training(grpo_config(max_steps=2))
    out = first.checkpoint.parent
    assert (first.global_step, first.completed, first.resumed_from) == (2, True, None)
    assert [c.step for c in complete_checkpoints(out)] == [1, 2]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "config.json", "tokenizer.json"} <= {
        p.name for p in first.checkpoint.iterdir()
    }
    assert "reward" in first.metrics

    # A leftover from a killed attempt must not be mistaken for progress.
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "config.json").write_text("{}")

    second = run_training(grpo_config(max_steps=4, save_total_limit=2))
    assert second.resumed_from == out / "checkpoint-2"
    assert (second.global_step, second.completed, second.already_done) == (4, True, False)
    assert [c.step for c in complete_checkpoints(out)] == [3, 4]  # rotation kept the last two
    assert _global_step(out / "checkpoint-4") == 4

    third = run_training(grpo_config(max_steps=4))
    assert (third.already_done, third.global_step, third.checkpoint) == (True, 4, out / "checkpoint-4")

    # report_to: tensorboard (the default): TRL's logs, one point per logging step, in the run folder's
    # tensorboard/ (beside output_dir), the resumed attempt going on with the same curves.
    assert not (out / "runs").exists()  # not transformers' default place
    curves = scalar_curves(out.parent / "tensorboard")
    for tag in ("train/loss", "train/reward", "train/grad_norm"):
        assert [step for step, _ in curves[tag]] == [1, 2, 3, 4], tag
    assert curves["train/reward"][-1][1] == pytest.approx(second.metrics["reward"])

    # A step run can continue from a Trainer checkpoint: its version is its global step.
    rollouts = [
        Rollout(
            prompt_ids=[1, 5],
            completion_ids=[7, 2],
            logprobs=[-6.0, -6.0],
            reward=float(i),
            group_id=0,
            policy_version=4,
        )
        for i in range(2)
    ]
    step = run_training(
        TrainerConfig(
            mode="step",
            model_name_or_path=str(second.checkpoint),
            output_dir=str(out.parent / "steps"),
            rollouts=str(write_rollouts(out.parent / "r.jsonl", rollouts)),
            use_cpu=True,
        )
    )
    assert (step.global_step, step.policy_version, step.metrics["optimizer_state_restored"]) == (5, 5, 0.0)


def test_a_stop_request_saves_at_the_step_end_and_the_next_attempt_resumes(grpo_config):
    """What the trainer does on SIGTERM (a requeue): stop at the end of the step, save, return;
    the next attempt resumes from that checkpoint."""
    config = grpo_config(max_steps=3, save_steps=100)
    stop = threading.Event()
    stop.set()
    first = run_training(config, stop_event=stop)
    assert first.stopped_early and not first.completed
    assert first.checkpoint.name == f"checkpoint-{first.global_step}" and first.global_step < 3

    second = run_training(config)
    assert second.resumed_from == first.checkpoint
    assert (second.global_step, second.completed) == (3, True)
