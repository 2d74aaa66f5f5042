"""mode: step: one GRPO update on rollouts sampled elsewhere, saved atomically."""

from __future__ import annotations

import json
import threading

import pytest

from posttrain.datasets.toy import toy_prompt_rows
from posttrain.rewards import length_reward
from posttrain.rollouts.format import RolloutError, load_rollouts, write_rollouts
from posttrain.testing.sampler import sample_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.checkpoints import inspect_checkpoint
from posttrain.trainer.step import StepError
from tests.support.tensorboard import scalar_curves


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir):
    """16 rollouts (4 prompts x 4) sampled by the tiny model, policy version 0."""
    return sample_rollouts(
        tiny_model_dir, toy_prompt_rows(4), group_size=4, max_new_tokens=8, reward_func=length_reward
    )


def _config(model_dir, out, rollouts_path, **changes) -> TrainerConfig:
    base = dict(
        mode="step",
        model_name_or_path=str(model_dir),
        output_dir=str(out),
        rollouts=str(rollouts_path),
        learning_rate=1e-3,
        per_device_train_batch_size=6,  # 3 micro-batches
        use_cpu=True,
    )
    return TrainerConfig(**{**base, **changes})


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_step_writes_a_new_policy_and_is_idempotent(tiny_model_dir, rollouts, tmp_path):
    path = write_rollouts(tmp_path / "rollouts.jsonl", rollouts)
    config = _config(tiny_model_dir, tmp_path / "out", path)
    result = run_training(config)
    assert (result.global_step, result.policy_version, result.completed) == (1, 1, True)
    ckpt = result.checkpoint
    assert ckpt == tmp_path / "out" / "checkpoint-1"
    assert inspect_checkpoint(ckpt).policy_version == 1  # the watch accepts it
    assert {"config.json", "tokenizer.json", "chat_template.jinja", "optimizer.pt"} <= {p.name for p in ckpt.iterdir()}
    assert [p.name for p in ckpt.parent.iterdir()] == ["checkpoint-1"]  # no temp folder left
    before, after = _weights(tiny_model_dir), _weights(ckpt)
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before)
    # The sampler's log-probs are the trainer's: on-policy importance weights are 1.
    assert abs(result.metrics["mean_logp_old_minus_behaviour"]) < 1e-4
    assert result.metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["source_checkpoint"] == str(tiny_model_dir) and state["rollouts_used"] == 16

    written = (ckpt / "model.safetensors").stat().st_mtime_ns
    again = run_training(config)  # a requeued attempt of the same step
    assert again.already_done and again.checkpoint == ckpt and again.policy_version == 1
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == written

    other = write_rollouts(tmp_path / "other.jsonl", rollouts[:8])
    with pytest.raises(StepError, match="already holds a step"):
        run_training(_config(tiny_model_dir, tmp_path / "out", other))


def test_next_step_trains_on_one_version_stale_rollouts(tiny_model_dir, rollouts, tmp_path):
    path = write_rollouts(tmp_path / "v0.jsonl", rollouts)
    first = run_training(_config(tiny_model_dir, tmp_path / "out", path, num_iterations=2))
    assert first.global_step == 2 and first.policy_version == 1
    # Policy 1 trains on rollouts of version 0 (one stale): importance weights differ from 1.
    second = run_training(_config(first.checkpoint, tmp_path / "out", path, importance_sampling_cap=1.05))
    assert (second.global_step, second.policy_version) == (3, 2)
    assert (first.metrics["optimizer_state_restored"], second.metrics["optimizer_state_restored"]) == (0.0, 1.0)
    assert second.metrics["rollouts_used"] == 16
    assert abs(second.metrics["mean_logp_old_minus_behaviour"]) > 1e-3
    assert second.metrics["is_capped_fraction"] > 0
    # Version 2 may not use version-0 rollouts with max_staleness=1.
    with pytest.raises(RolloutError, match="more than max_staleness=1"):
        run_training(_config(second.checkpoint, tmp_path / "out", path))
    stale_ok = run_training(
        _config(
            second.checkpoint,
            tmp_path / "out",
            path,
            max_staleness=2,
            beta=0.1,
            ref_model_name_or_path=str(tiny_model_dir),
        )
    )
    assert stale_ok.policy_version == 3


def test_stale_rollouts_are_dropped_and_future_ones_refused(tiny_model_dir, rollouts, tmp_path):
    base = run_training(_config(tiny_model_dir, tmp_path / "out", write_rollouts(tmp_path / "a.jsonl", rollouts)))
    mixed = [r.model_copy(update={"policy_version": 1}) for r in rollouts[:8]] + rollouts[8:]
    result = run_training(
        _config(base.checkpoint, tmp_path / "out", write_rollouts(tmp_path / "b.jsonl", mixed), max_staleness=0)
    )
    assert result.metrics["rollouts_used"] == 8 and result.metrics["rollouts_dropped_stale"] == 8
    future = [r.model_copy(update={"policy_version": 5}) for r in rollouts]
    with pytest.raises(RolloutError, match=r"policy_version \[5\] newer"):
        run_training(_config(tiny_model_dir, tmp_path / "o2", write_rollouts(tmp_path / "c.jsonl", future)))


def test_bad_rollout_lines_are_reported_by_number(tmp_path, rollouts):
    good = json.dumps(rollouts[0].model_dump(mode="json"))
    bad = dict(rollouts[0].model_dump(mode="json"), logprobs=[-1.0])
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good, json.dumps(bad), "{", json.dumps({"reward": 1})]) + "\n")
    with pytest.raises(RolloutError) as info:
        load_rollouts(path)
    assert str(path) in str(info.value)
    where = [p.split(":")[0] for p in info.value.problems]
    assert where[0] == "line 2" and "logprobs has 1 entries" in info.value.problems[0]
    assert where[1] == "line 3" and set(where[2:]) == {"line 4"}


def test_out_of_vocabulary_tokens_and_stop_requests(tiny_model_dir, rollouts, tmp_path):
    broken = [rollouts[0].model_copy(update={"completion_ids": [10_000] * len(rollouts[0].completion_ids)})]
    with pytest.raises(RolloutError, match="outside the model's vocabulary"):
        run_training(_config(tiny_model_dir, tmp_path / "out", write_rollouts(tmp_path / "v.jsonl", broken)))
    stop = threading.Event()
    stop.set()
    result = run_training(
        _config(tiny_model_dir, tmp_path / "out", write_rollouts(tmp_path / "ok.jsonl", rollouts)), stop_event=stop
    )
    assert result.stopped_early and result.checkpoint is None
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_each_round_logs_one_point_per_metric_to_tensorboard(tiny_model_dir, rollouts, tmp_path):
    """Rounds as the GRPO flow runs them (one process each in the flow): successive updates append to
    the run's curves, at step = the round (the policy version trained from)."""
    path = write_rollouts(tmp_path / "v0.jsonl", rollouts)
    policy, results = tiny_model_dir, []
    for _ in range(3):
        result = run_training(_config(policy, tmp_path / "policy", path, max_staleness=2, run_name="tb-run"))
        policy = result.checkpoint
        results.append(result)
    assert not (tmp_path / "policy" / "runs").exists()  # not transformers' default place
    curves = scalar_curves(tmp_path / "tensorboard")  # the run folder's, beside output_dir
    for tag, key in (("train/loss", "loss"), ("train/reward", "mean_reward"), ("train/grad_norm", "grad_norm"),
                     ("train/is_weight_mean", "is_weight_mean"), ("train/staleness_mean", "staleness_mean")):
        assert [step for step, _ in curves[tag]] == [0, 1, 2], tag
        assert [v for _, v in curves[tag]] == pytest.approx([r.metrics[key] for r in results], rel=1e-5), tag
    assert [v for _, v in curves["train/staleness_max"]] == [0.0, 1.0, 2.0]  # version-0 rollouts throughout

    again = run_training(_config(results[0].checkpoint, tmp_path / "policy", path,
                                 max_staleness=2))  # a retried round 1 finds its step written: no second point
    assert again.already_done
    assert [step for step, _ in scalar_curves(tmp_path / "tensorboard")["train/loss"]] == [0, 1, 2]


def test_report_to_none_and_other_trackers_in_step_mode(tiny_model_dir, rollouts, tmp_path, monkeypatch):
    """none writes no event files; another tracker gets the point through transformers' integration
    callback, with the run name; a tracker that fails never fails the step."""
    from transformers import TrainerCallback
    from transformers.integrations import integration_utils

    seen = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append((args.run_name, state.global_step, logs))

    class Broken(TrainerCallback):
        def on_train_begin(self, *a, **k):
            raise RuntimeError("no account")

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "recorder", Recorder)
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "broken", Broken)
    path = write_rollouts(tmp_path / "v0.jsonl", rollouts)
    none = run_training(_config(tiny_model_dir, tmp_path / "a" / "out", path, report_to=["none"]))
    assert none.completed and not (tmp_path / "a" / "tensorboard").exists()
    result = run_training(_config(tiny_model_dir, tmp_path / "b" / "out", path, report_to=["broken", "recorder"],
                                  run_name="night-1"))
    assert result.completed and not (tmp_path / "b" / "tensorboard").exists()
    [(name, step, logs)] = seen
    assert (name, step) == ("night-1", 0)
    assert logs["loss"] == result.metrics["loss"] and logs["reward"] == result.metrics["mean_reward"]
