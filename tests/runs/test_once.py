"""submit_once: one submission per marker, whatever the number of calls; results from the trainer's file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import posttrain.runs.once as once
from posttrain.cluster import LocalConfig
from posttrain.runs.job import TrainingRunConfig, results_path
from posttrain.trainer.config import TrainerConfig


def config(tmp_path) -> TrainingRunConfig:
    trainer = TrainerConfig(mode="grpo", model_name_or_path="/m", output_dir=str(tmp_path / "out"),
                            dataset_manifest=str(tmp_path / "m.json"), reward_funcs=["posttrain.rewards:format_reward"],
                            max_steps=1)
    return TrainingRunConfig(name="nightly-abc", run_id="r1", cluster=LocalConfig(), trainer=trainer)


def test_a_marker_means_one_submission(tmp_path, monkeypatch):
    calls = []

    def fake_submit(cfg):
        calls.append(cfg)
        return SimpleNamespace(job_id="42", spec=SimpleNamespace(run_id="r1", name=cfg.name), log_path="/log")

    monkeypatch.setattr(once, "submit_training", fake_submit)
    monkeypatch.setattr(once, "_RUNS", {})
    marker = tmp_path / "run" / "training-job.json"
    first, new = once.submit_once(config(tmp_path), marker)
    again, new_again = once.submit_once(config(tmp_path), marker)
    assert (new, new_again) == (True, False)
    assert again == first and len(calls) == 1

    # after a restart (no handle), completion comes from the trainer's results file
    monkeypatch.setattr(once, "_RUNS", {})
    with pytest.raises(RuntimeError, match="left no completed result"):
        once.completed_result(first)
    path = Path(results_path(first.output_dir, first.name, first.run_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"mode": "grpo", "global_step": 1, "completed": true}\n')
    assert once.completed_result(first).global_step == 1
    assert once.job_ended(first, backend=None)


def test_long_names_are_shortened_to_a_stable_job_name():
    name = "a" * 40 + "-nightly-1234abcd"
    short = once.job_name(name)
    assert len(short) <= 31 and short == once.job_name(name) and short != once.job_name(name + "x")
    assert once.job_name("short") == "short"
