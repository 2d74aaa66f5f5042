"""Acceptance: LoRA through the nightly flow on the local backend. Real TRL GRPO trains an adapter;
every checkpoint is merged into the base, published as a chain (full, then deltas) and hot-loaded
into the reference server; each published version is peft's merge_and_unload() of its checkpoint
bit for bit, and so are the weights the server serves at the end (on disk and in memory).

The flow runs in this process against the Prefect server (``prefect_api``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lora import peft_merged
from tests.support.tensorboard import scalar_curves
from tests.support.tensors import load_bytes, tensor_bytes

pytestmark = pytest.mark.slow
LORA = {"use_lora": True, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.timeout(600)
def test_nightly_lora_merged_published_and_served_bit_exact(tiny_setup, tmp_path):
    from posttrain.chain.ops import reconstruct
    from posttrain.lora import read_adapter
    from posttrain.pipeline.flows.nightly import nightly_post_training

    params = tiny_setup.settings("flows-lora", **LORA, learning_rate=5e-2, max_steps=3,
                                 reward_funcs=["posttrain.rewards:correctness_reward",
                                               "posttrain.rewards:length_reward"])
    state = nightly_post_training(**params, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert report.checkpoints == 3 and report.final_step == 3
    assert [row["kind"] for row in report.snapshots] == ["full", "delta", "delta"]
    assert all(row["served"] == row["snapshot"] for row in report.snapshots)

    run_dir = Path(report.run_dir)
    checkpoints = sorted((run_dir / "output").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not (run_dir / "merged").exists() or not list((run_dir / "merged").iterdir())  # removed once published
    adapters = [read_adapter(p) for p in checkpoints]
    assert all(a.base.path == str(tiny_setup.base_model) for a in adapters)

    references = []
    for row, ckpt in zip(report.snapshots, checkpoints, strict=True):
        (chain_dir,) = {p.parent for p in tiny_setup.store.rglob(row["snapshot"]) if p.is_dir()}
        rebuilt = reconstruct(chain_dir, row["snapshot"], tmp_path / row["snapshot"])
        want = peft_merged(tiny_setup.base_model, ckpt)
        got = load_bytes(rebuilt.path)
        assert set(got) <= set(want)
        assert all(raw == tensor_bytes(want[name]) for name, (_, _, raw) in got.items()), row["snapshot"]
        references.append((got, want))
    # the adapter learned: the last version differs from the base in the target matrices only
    base = load_bytes(tiny_setup.base_model)
    last, want = references[-1]
    changed = {n for n in base if base[n][2] != last[n][2]}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)

    served = tiny_setup.server.engine.slot.current()
    assert served.identity == report.snapshots[-1]["snapshot"] == tiny_setup.served_identity()
    assert load_bytes(served.path) == last
    state_dict = served.model.state_dict()
    assert all(tensor_bytes(state_dict[name]) == raw for name, (_, _, raw) in last.items())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainer_job", ["resident"])  # per_round's step jobs with LoRA: tests/trainer
def test_grpo_lora_rounds_train_one_adapter_and_serve_its_merge(tiny_setup, trainer_job):
    from posttrain.lora import read_adapter
    from posttrain.pipeline.flows.grpo import grpo

    params = tiny_setup.grpo_settings(f"flows-grpo-lora-{trainer_job.replace('_', '-')}", **LORA, rounds=2,
                                      learning_rate=5e-2, reward_funcs=["posttrain.rewards:length_reward"],
                                      trainer_job=trainer_job)
    state = grpo(**params, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert [r["kind"] for r in report.rounds] == ["full", "delta"]
    # report_to: tensorboard (the default): one point per round, at step = the round, from each round's job
    # (per_round: a process of its own) or the one resident job, in the run folder's curves.
    curves = scalar_curves(report.tensorboard_dir)
    assert [s for s, _ in curves["train/loss"]] == [s for s, _ in curves["train/reward"]] == [0, 1], curves
    assert report.tensorboard_dir == str(Path(report.run_dir) / "tensorboard")
    final = Path(report.final_checkpoint)
    adapter = read_adapter(final)
    assert adapter.base.path == str(tiny_setup.base_model) and final.name == "checkpoint-2"
    served = tiny_setup.server.engine.slot.current()
    assert served.identity == report.final_snapshot
    want = peft_merged(tiny_setup.base_model, final)
    got = load_bytes(served.path)
    assert got and all(raw == tensor_bytes(want[name]) for name, (_, _, raw) in got.items())
