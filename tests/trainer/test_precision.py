"""Checkpoints in the base model's dtype: a bfloat16 base trained in float32 is saved in bfloat16 (its
size, not twice it), with a probe an engine loading the folder answers exactly, and the float32
weights beside it that the next step goes on from; a float32 base is saved as before."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.chain.safetensors_io import read_header
from posttrain.datasets.toy import toy_prompt_rows
from posttrain.rewards import length_reward
from posttrain.rollouts.format import write_rollouts
from posttrain.serve.probe import judge, read_probe, score_with_model
from posttrain.testing.sampler import sample_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.precision import MASTER_FILE, saved_model, weights_dtype
from tests.support.updates import saved_as


@pytest.fixture(scope="module")
def bf16_base(tiny_model_dir, tmp_path_factory):
    return saved_as(tiny_model_dir, tmp_path_factory.mktemp("bf16") / "base", "bfloat16")


@pytest.fixture(scope="module")
def rollouts_file(bf16_base, tmp_path_factory):
    rollouts = sample_rollouts(bf16_base, toy_prompt_rows(4), group_size=4, max_new_tokens=8, reward_func=length_reward)
    return write_rollouts(tmp_path_factory.mktemp("rollouts") / "r.jsonl", rollouts)


def step_config(model_dir, out, rollouts, **changes) -> TrainerConfig:
    return TrainerConfig(**{"mode": "step", "model_name_or_path": str(model_dir), "output_dir": str(out),
                            "rollouts": str(rollouts), "learning_rate": 1e-3, "use_cpu": True,
                            "report_to": ["none"], **changes})


def dtypes(folder) -> set[str]:
    return {t.dtype for t in read_header(folder / "model.safetensors").tensors.values()}


def engine_verdict(folder):
    """What an engine that loads the folder as it says (config.json's dtype) finds of its probe."""
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(folder)
    probe = read_probe(folder)
    return engine.dtype, probe, judge(score_with_model(engine, probe.sequences()), probe, None, None,
                                      engine_dtype=str(engine.dtype))


def test_a_bfloat16_base_is_saved_in_bfloat16_with_its_float32_weights_beside(bf16_base, rollouts_file, tmp_path):
    first = run_training(step_config(bf16_base, tmp_path / "out", rollouts_file)).checkpoint
    assert dtypes(first) == {"BF16"} and weights_dtype(first) == "bfloat16"
    assert (first / "model.safetensors").stat().st_size == pytest.approx((bf16_base / "model.safetensors").stat().st_size,
                                                                        rel=0.01)
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"
    dtype, probe, verdict = engine_verdict(first)
    assert dtype == torch.bfloat16 and probe.dtype == "bfloat16"
    assert verdict.ok and verdict.max_difference == 0.0, verdict.reason  # the probe is of the weights as saved

    master = torch.load(first / MASTER_FILE, weights_only=True)
    assert {t.dtype for t in master.values()} == {torch.float32}
    from safetensors.torch import load_file

    saved = load_file(str(first / "model.safetensors"))
    rounded = [k for k in saved if not torch.equal(saved[k].float(), master[k])]
    assert rounded  # an update the bf16 file rounds away, which the float32 copy keeps
    # the next step goes on from the float32 weights, not from their bf16 rounding
    from posttrain.trainer.grpo_update import load_policy

    model, _ = load_policy(first, step_config(first, tmp_path / "out", rollouts_file), torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], master[k]) for k in master)


def test_save_dtype_overrides_the_base_and_a_float32_base_is_saved_as_before(bf16_base, tiny_model_dir, rollouts_file,
                                                                            tmp_path):
    wide = run_training(step_config(bf16_base, tmp_path / "a", rollouts_file, save_dtype="float32")).checkpoint
    assert dtypes(wide) == {"F32"} and not (wide / MASTER_FILE).exists()
    assert engine_verdict(wide)[2].ok
    as_before = run_training(step_config(tiny_model_dir, tmp_path / "b", rollouts_file)).checkpoint
    assert dtypes(as_before) == {"F32"} and not (as_before / MASTER_FILE).exists()


def test_the_saved_copy_casts_parameters_and_keeps_float32_buffers_as_from_pretrained_does(bf16_base):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32)
    copy = saved_model(trained, torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(bf16_base)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {n: b.dtype for n, b in copy.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}
    assert next(trained.parameters()).dtype == torch.float32  # the weights trained on are left as they are
    if trained.config.tie_word_embeddings:
        assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight


def test_the_nightly_trainer_saves_a_bfloat16_base_in_bfloat16(bf16_base, staged_toy, tmp_path):
    config = TrainerConfig(mode="grpo", model_name_or_path=str(bf16_base), output_dir=str(tmp_path / "run"),
                           dataset_manifest=str(staged_toy.manifest_path), reward_funcs=["posttrain.rewards:length_reward"],
                           learning_rate=1e-3, per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=8, max_steps=1, save_steps=1, use_cpu=True, report_to=["none"])
    checkpoint = run_training(config).checkpoint
    assert dtypes(checkpoint) == {"BF16"} and (checkpoint / MASTER_FILE).is_file()
    assert {"optimizer.pt", "scheduler.pt", "training_args.bin", "tokenizer.json"} <= {p.name for p in checkpoint.iterdir()}
    dtype, probe, verdict = engine_verdict(checkpoint)
    assert probe.dtype == "bfloat16" and verdict.ok and verdict.max_difference == 0.0, verdict.reason
