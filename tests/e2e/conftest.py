"""Fixtures of the acceptance tests: a real GRPO run of the tiny model, the real SeaweedFS S3
server (tests/storage/conftest.py), and the reference inference server on that store.

Planted secrets: ``TOKEN`` (the hot-load API token) and ``S3_SECRET`` (the S3 secret key) are
used everywhere a real secret would be, so any leak of them is visible to a grep.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.s3 import raw_client  # noqa: F401 - re-exported for the e2e tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TOKEN = "tok-PLANTED-9f3a"
S3_SECRET = "s3secret-PLANTED-77c1"
S3_KEY_ID = "e2e-access-key"
DEPLOYMENT = "dep-e2e"
MODEL_NAME = "tiny"
QUESTIONS = ["What is 3 + 4? Answer with a number.", "Repeat the word apple.", "What is 9 + 1? Answer with a number."]
# Large enough that three GRPO steps change the tiny model's greedy output (1e-3 does not).
LEARNING_RATE = 3e-2


@dataclass
class TrainedRun:
    base: Path  # the tiny model the run started from: the server's boot weights
    checkpoints: list[Path]  # checkpoint-1, -2, -3 of the run, in step order
    prompts: list[list[int]]  # QUESTIONS as chat prompts, in token ids


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """Three checkpoints of a real TRL GRPO run (CPU, a few seconds), one per step."""
    from transformers import AutoTokenizer

    from posttrain.datasets.staging import stage_dataset
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.models.tiny import build_tiny_model
    from posttrain.trainer import TrainerConfig, run_training

    root = tmp_path_factory.mktemp("run")
    base = build_tiny_model(root / "base", seed=0)
    staged = stage_dataset(write_toy_jsonl(root / "toy.jsonl", n=8, seed=0), root / "datasets")
    result = run_training(TrainerConfig(
        mode="grpo", model_name_or_path=str(base), output_dir=root / "output",
        dataset_manifest=staged.manifest_path,
        reward_funcs=["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"],
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, max_steps=3, save_steps=1, use_cpu=True,
    ))
    assert result.completed and result.global_step == 3
    checkpoints = [root / "output" / f"checkpoint-{step}" for step in (1, 2, 3)]
    assert all((c / "model.safetensors").is_file() for c in checkpoints)
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
               for q in QUESTIONS]
    return TrainedRun(base, checkpoints, prompts)


def s3_options(endpoint: str) -> dict:
    """S3StoreConfig fields for the local server, with the planted secret key."""
    return dict(endpoint_url=endpoint, region="us-east-1", access_key_id=S3_KEY_ID, secret_access_key=S3_SECRET,
                addressing_style="path", part_size=5 << 20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed
