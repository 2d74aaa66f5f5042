"""Fixtures for the training tests: a tiny model, a staged toy dataset, fake checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model folder, built once per session. Tests must not modify it."""
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def staged_toy(tmp_path_factory):
    """The toy prompt set (8 rows with answers) staged under a session 'shared storage' folder."""
    from posttrain.datasets.staging import stage_dataset
    from posttrain.datasets.toy import write_toy_jsonl

    root = tmp_path_factory.mktemp("shared")
    source = write_toy_jsonl(root / "toy.jsonl", n=8, seed=0)
    return stage_dataset(source, root / "store")


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, rows): rows verbatim (strings as raw lines), for good and bad source files."""
    return _write_jsonl


@pytest.fixture
def make_checkpoint():
    """make_checkpoint(output_dir, step, ...): a fake checkpoint folder (see _make_checkpoint)."""
    return _make_checkpoint


def _write_jsonl(path: Path, rows: list) -> Path:
    """Write rows verbatim (strings as raw lines), to build good and bad source files."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _make_checkpoint(
    output_dir: Path,
    step: int,
    *,
    shards: int = 1,
    state: bool = True,
    config: bool = True,
    truncate: str | None = None,
    name: str | None = None,
) -> Path:
    """A fake checkpoint folder with real safetensors files (numpy, no torch).

    ``truncate`` names a weight file to cut short; ``state``/``config`` False leave those out.
    """
    import numpy as np
    from safetensors.numpy import save_file

    path = output_dir / (name or f"checkpoint-{step}")
    path.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        files = {"model.safetensors": {"w": np.full((4, 4), step, dtype=np.float32)}}
    else:
        files = {
            f"model-{i + 1:05d}-of-{shards:05d}.safetensors": {f"w{i}": np.full((4,), i, dtype=np.float32)}
            for i in range(shards)
        }
        weight_map = {name: fname for fname, tensors in files.items() for name in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for fname, tensors in files.items():
        save_file(tensors, str(path / fname))
    if truncate:
        data = (path / truncate).read_bytes()
        (path / truncate).write_bytes(data[: len(data) - 8])
    if config:
        (path / "config.json").write_text(json.dumps({"model_type": "fake"}))
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


# A reward that takes a while, so that a requeue lands mid-run; importable by a job via PYTHONPATH.
SLOW_REWARD = '''
import time
from posttrain.rewards import length_reward

def slow_length_reward(completions, **kwargs):
    time.sleep(0.6)
    return length_reward(completions, **kwargs)
'''


def job_shared_dir(root: Path) -> Path:
    """'Shared storage' for cluster jobs: the tiny model, a staged toy dataset, and ``pymod/`` with
    the slow reward (``slow_rewards:slow_length_reward``)."""
    from posttrain.datasets.staging import stage_dataset
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model

    build_tiny_model(root / "model", seed=0)
    stage_dataset(write_toy_jsonl(root / "toy.jsonl", n=8, seed=0), root / "store")
    (root / "pymod").mkdir()
    (root / "pymod" / "slow_rewards.py").write_text(SLOW_REWARD)
    return root


def job_grpo_trainer(shared: Path, out: str, *, slow: bool = False, **trainer) -> dict:
    """A TRL GRPO trainer section on ``job_shared_dir``: 3 steps, a checkpoint after each, CPU;
    ``slow``: with the slow reward."""
    manifest = next((shared / "store").glob("datasets/*/manifest.json"))
    reward = "slow_rewards:slow_length_reward" if slow else "posttrain.rewards:length_reward"
    return {
        "mode": "grpo", "model_name_or_path": str(shared / "model"), "output_dir": str(shared / out),
        "dataset_manifest": str(manifest), "reward_funcs": ["posttrain.rewards:correctness_reward", reward],
        "learning_rate": 1e-3, "per_device_train_batch_size": 8, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 3, "save_steps": 1, "use_cpu": True, **trainer,
    }  # fmt: skip
