"""LoRA in both modes: real TRL GRPO and the step on external rollouts write peft adapters with a
base reference; the checkpoints resume, and merge bit-exactly with peft's merge_and_unload()."""

from __future__ import annotations

import json

from posttrain.lora import BASE_REF, base_fingerprint, read_adapter
from posttrain.lora.merge import merge_adapter
from posttrain.rollouts.format import Rollout, write_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.checkpoints import complete_checkpoints
from posttrain.trainer.config import LoraSettings
from tests.support.lora import assert_bit_exact, peft_merged

LORA = LoraSettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_grpo_lora_checkpoints_resume_and_merge_exactly(tiny_model_dir, staged_toy, tmp_path):
    def config(**changes):
        return TrainerConfig(**{**dict(
            mode="grpo", model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "run"),
            dataset_manifest=str(staged_toy.manifest_path), reward_funcs=["tests.support.lora:varied_reward"],
            learning_rate=5e-2, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
            max_steps=2, save_steps=1, use_cpu=True, lora=LORA), **changes})

    first = run_training(config())
    out = first.checkpoint.parent
    assert [c.step for c in complete_checkpoints(out)] == [1, 2]
    assert all(c.adapter and c.weight_files == ["adapter_model.safetensors"] for c in complete_checkpoints(out))
    files = {p.name for p in first.checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", BASE_REF, "optimizer.pt"} <= files
    assert "model.safetensors" not in files
    adapter = read_adapter(first.checkpoint)
    assert adapter.config["base_model_name_or_path"] == str(tiny_model_dir)
    assert adapter.base.fingerprint == base_fingerprint(tiny_model_dir)
    assert (adapter.config["r"], adapter.config["lora_alpha"]) == (4, 8)

    second = run_training(config(max_steps=3))
    assert second.resumed_from == out / "checkpoint-2" and second.global_step == 3

    from safetensors.torch import load_file

    b = [t for k, t in load_file(str(second.checkpoint / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert any(t.abs().sum() > 0 for t in b), "the adapter learned nothing (B is still zero)"
    merged = merge_adapter(second.checkpoint, tiny_model_dir, tmp_path / "merged" / "checkpoint-3")
    assert assert_bit_exact(merged.path, peft_merged(tiny_model_dir, second.checkpoint)) == merged.total_tensors
    assert json.loads((merged.path / "trainer_state.json").read_text())["global_step"] == 3


def test_step_lora_starts_an_adapter_then_continues_it(tiny_model_dir, tmp_path):
    def rollouts(version: int, name: str):
        rows = [Rollout(prompt_ids=[1, 5, 9], completion_ids=[7, 2 + i, 11], logprobs=[-6.0, -6.0, -6.0],
                        reward=float(i % 2), group_id=i // 2, policy_version=version) for i in range(4)]
        return write_rollouts(tmp_path / name, rows)

    def step(model, version, name):
        return run_training(TrainerConfig(mode="step", model_name_or_path=str(model), output_dir=str(tmp_path / "out"),
                                          rollouts=str(rollouts(version, name)), learning_rate=5e-2, use_cpu=True,
                                          lora=LORA))

    first = step(tiny_model_dir, 0, "r0.jsonl")
    assert first.checkpoint.name == "checkpoint-1" and first.policy_version == 1
    assert read_adapter(first.checkpoint).base.path == str(tiny_model_dir)
    second = step(first.checkpoint, 1, "r1.jsonl")
    assert second.policy_version == 2 and second.metrics["optimizer_state_restored"] == 1.0
    adapter = read_adapter(second.checkpoint)
    assert adapter.config["base_model_name_or_path"] == str(tiny_model_dir)  # the base, not the previous adapter
    merged = merge_adapter(second.checkpoint, tiny_model_dir, tmp_path / "merged")
    assert assert_bit_exact(merged.path, peft_merged(tiny_model_dir, second.checkpoint)) == merged.total_tensors


def test_lora_section_in_the_yaml(tmp_path):
    import pytest

    from posttrain.trainer.config import ConfigError, load_trainer_config

    text = ("mode: step\nmodel_name_or_path: /m\noutput_dir: /o\nrollouts: /r.jsonl\n"
            "lora: {r: 8, lora_alpha: 16, lora_dropout: 0.05, target_modules: [q_proj, o_proj]}\n")
    (tmp_path / "t.yaml").write_text(text)
    lora = load_trainer_config(tmp_path / "t.yaml").lora
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.target_modules) == (8, 16, 0.05, ["q_proj", "o_proj"])
    assert lora.peft_config().target_modules == {"q_proj", "o_proj"}
    (tmp_path / "t.yaml").write_text(text.replace("r: 8", "rank: 8"))
    with pytest.raises(ConfigError, match="lora.rank: Extra inputs are not permitted"):
        load_trainer_config(tmp_path / "t.yaml")
