"""The trainer's YAML config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.trainer.config import ConfigError, TrainerConfig, load_trainer_config

GRPO = {
    "model_name_or_path": "/shared/models/tiny",
    "output_dir": "/shared/runs/a",
    "dataset_manifest": "/shared/datasets/abc/manifest.json",
    "reward_funcs": ["posttrain.rewards:correctness_reward"],
    "max_steps": 10,
}


def test_loads_yaml_with_trl_names(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "mode: grpo\nmodel_name_or_path: /shared/models/tiny\noutput_dir: /shared/runs/a\n"
        "dataset_manifest: /shared/datasets/abc/manifest.json\n"
        "reward_funcs: [posttrain.rewards:correctness_reward, posttrain.rewards:format_reward]\n"
        "reward_weights: [1.0, 0.2]\nlearning_rate: 1.0e-5\nper_device_train_batch_size: 16\n"
        "num_generations: 8\nmax_steps: 100\nsave_steps: 10\nsave_total_limit: 3\nbeta: 0.04\n"
    )
    config = load_trainer_config(path)
    assert config.learning_rate == 1e-5 and config.save_total_limit == 3 and config.beta == 0.04
    assert str(config.output_dir) == "/shared/runs/a"


def test_errors_name_the_file_and_fields(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: runs/a\nlearning_rat: 0.1\nmax_steps: 0\n")
    with pytest.raises(ConfigError) as info:
        load_trainer_config(path)
    text = str(info.value)
    assert str(path) in text
    for field in ("output_dir", "learning_rat", "max_steps"):
        assert f"- {field}:" in text
    with pytest.raises(ConfigError, match="not valid YAML"):
        (tmp_path / "x.yaml").write_text("a: [")
        load_trainer_config(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        load_trainer_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dataset_manifest": None}, "dataset_manifest: required when mode is grpo"),
        ({"reward_funcs": []}, "reward_funcs: at least one"),
        ({"reward_funcs": ["posttrain.rewards.correctness"]}, "module:function"),
        ({"reward_weights": [1.0, 2.0]}, "2 weights for 1 reward_funcs"),
        ({"per_device_train_batch_size": 6, "num_generations": 4}, "multiple of num_generations"),
        ({"mode": "step"}, "rollouts: required when mode is step"),
        ({"mode": "step", "rollouts": "/r.jsonl", "beta": 0.1}, "ref_model_name_or_path"),
        ({"dataset_manifest": "datasets/manifest.json"}, "absolute path"),
    ],
)
def test_mode_specific_requirements(changes, message):
    with pytest.raises(ValidationError, match=message):
        TrainerConfig.model_validate({**GRPO, **changes})


def test_step_mode_needs_no_grpo_fields():
    config = TrainerConfig(mode="step", model_name_or_path="/m", output_dir="/o", rollouts="/r.jsonl")
    assert config.importance_sampling_cap == 2.0 and config.max_staleness == 1 and config.beta == 0.0
