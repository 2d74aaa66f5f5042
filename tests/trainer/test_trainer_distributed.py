"""Data-parallel training on CPU (gloo) as torchrun starts it: two processes of one node here, the
same launch as one process on each of two nodes. Both modes; rank 0 alone writes. The one-process
runs they are compared with train in this process (as the two-node Slurm test's reference does):
a torchrun of one process cost a launcher and a trainer start more, for the same update."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.datasets.toy import toy_prompt_rows
from posttrain.rewards import length_reward
from posttrain.rollouts.format import write_rollouts
from posttrain.testing.sampler import sample_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.checkpoints import complete_checkpoints
from tests.trainer.test_trainer_probe import check_probe_of

AUDIT = Path(__file__).with_name("audited_trainer.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir):
    """Rollouts of the tiny model on four toy prompts, for both modes' updates."""
    return sample_rollouts(tiny_model_dir, toy_prompt_rows(4), group_size=4, max_new_tokens=8,
                           reward_func=length_reward)  # fmt: skip


def _torchrun(tmp_path: Path, config: dict, nproc: int, watched: Path) -> tuple[str, dict[int, list[str]]]:
    """Run the trainer under torchrun; its output and the writes under ``watched`` per rank."""
    cfg = tmp_path / f"trainer-{nproc}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    prefix = tmp_path / f"writes-{nproc}-"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(AUDIT), str(watched), str(prefix),
               str(cfg), "--result-file", str(watched / "results.jsonl")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    writes = {r: Path(f"{prefix}{r}").read_text().splitlines() for r in range(nproc) if Path(f"{prefix}{r}").exists()}
    return done.stdout + done.stderr, writes


@pytest.mark.slow
def test_grpo_on_two_ranks_rank0_writes_every_checkpoint_file(tiny_model_dir, staged_toy, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = dict(mode="grpo", model_name_or_path=str(tiny_model_dir), output_dir=str(out),
                  dataset_manifest=str(staged_toy.manifest_path),
                  reward_funcs=["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"],
                  learning_rate=1e-3, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=2, save_steps=1, use_cpu=True)  # fmt: skip
    log, writes = _torchrun(tmp_path, config, 2, out)
    assert "distributed: rank 0 of world size 2" in log and "distributed: rank 1 of world size 2" in log
    assert "backend gloo" in log
    assert [c.step for c in complete_checkpoints(out)] == [1, 2]
    for step in (1, 2):
        names = {p.name for p in (out / f"checkpoint-{step}").iterdir()}
        assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "trainer_state.json"} <= names
        check_probe_of(out / f"checkpoint-{step}")  # by rank 0, on its full replica of the saved weights
    assert writes.get(1, []) == []  # rank 1 never wrote under the output folder
    assert any("checkpoint-2/rng_state_1.pth" in w for w in writes[0])  # rank 0 wrote rank 1's RNG state
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["global_step"], r["completed"]) for r in results] == [(2, True)]  # one line: rank 0's
    from posttrain.trainer.timeline import read_timeline, timeline_file_for

    (attempt,) = read_timeline(timeline_file_for(out / "results.jsonl"))  # rank 0's timeline, one attempt
    assert attempt.finished and attempt.loaded is not None and [s for s, _, _ in attempt.steps] == [1, 2]
    assert len(attempt.saves) == 2 and all(b <= e for b, e in attempt.saves)


@pytest.mark.slow
def test_step_on_two_ranks_is_the_one_process_update(tiny_model_dir, rollouts, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    path = write_rollouts(tmp_path / "rollouts.jsonl", rollouts)
    weights = {}
    for nproc in (1, 2):
        out = tmp_path / f"step-{nproc}"
        config = dict(mode="step", model_name_or_path=str(tiny_model_dir), output_dir=str(out), rollouts=str(path),
                      learning_rate=1e-3, per_device_train_batch_size=6, num_iterations=2, use_cpu=True)  # fmt: skip
        if nproc == 1:
            run_training(TrainerConfig(**config))
        else:
            log, writes = _torchrun(tmp_path, config, nproc, out)
            assert "distributed: rank 1 of world size 2" in log and "backend gloo" in log
            assert writes.get(1, []) == []
            assert len((out / "results.jsonl").read_text().splitlines()) == 1  # rank 0's
        (checkpoint,) = complete_checkpoints(out)
        state = json.loads((checkpoint.path / "trainer_state.json").read_text())
        assert (state["global_step"], state["rollouts_used"]) == (2, 16)
        weights[nproc] = load_file(str(checkpoint.path / "model.safetensors"))
        check_probe_of(checkpoint.path)
    changed = False
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][name], tensor, rtol=1e-5, atol=1e-6)
        changed |= not torch.equal(tensor, load_file(str(tiny_model_dir / "model.safetensors"))[name])
    assert changed


def test_backend_and_ranks_come_from_the_launcher(monkeypatch) -> None:
    """Same settings on CPU and GPU: nccl when a GPU is there (and use_cpu is off), else gloo."""
    import torch

    from posttrain.trainer import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (distributed.backend(False), distributed.backend(True)) == ("nccl", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.backend(False) == "gloo"
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1", "SLURMD_NODENAME": "n2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(k, v)
    r = distributed.ranks()
    assert (r.rank, r.world_size, r.local_rank, r.node_rank, r.is_main) == (3, 4, 1, 1, False)
    text = distributed.describe(r, "nccl")
    assert text.startswith("distributed: rank 3 of world size 4 (node rank 1, local rank 1) on ")
    assert "(Slurm node n2), backend nccl, rendezvous 127.0.0.1:29611" in text


@pytest.mark.slow
def test_resident_on_two_ranks_is_the_one_process_run(tiny_model_dir, rollouts, tmp_path: Path) -> None:
    """Both ranks wait for each round's marker and train their share; rank 0 alone writes."""
    import torch
    from safetensors.torch import load_file

    from posttrain.trainer.rounds import hand_round, round_dir

    rounds_dir = tmp_path / "rounds"
    for r in range(2):
        write_rollouts(round_dir(rounds_dir, r) / "rollouts.jsonl", rollouts)
        hand_round(rounds_dir, r, 0)
    weights = {}
    for nproc in (1, 2):
        out = tmp_path / f"resident-{nproc}"
        config = dict(mode="resident", model_name_or_path=str(tiny_model_dir), output_dir=str(out),
                      rounds_dir=str(rounds_dir), rounds=2, round_timeout_s=60, learning_rate=1e-3,
                      per_device_train_batch_size=6, max_staleness=2, use_cpu=True)  # fmt: skip
        if nproc == 1:
            result = run_training(TrainerConfig(**config))
            assert (result.rounds_done, result.completed) == (2, True)
        else:
            log, writes = _torchrun(tmp_path, config, nproc, out)
            assert "distributed: rank 1 of world size 2" in log
            assert writes.get(1, []) == []
            results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            assert [(r["mode"], r["rounds_done"], r["completed"]) for r in results] == [("resident", 2, True)]
        assert [c.step for c in complete_checkpoints(out)] == [1, 2]
        weights[nproc] = load_file(str(out / "checkpoint-2" / "model.safetensors"))
        check_probe_of(out / "checkpoint-2")
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][name], tensor, rtol=1e-5, atol=1e-6)
