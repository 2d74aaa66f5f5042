"""The trainer on two Slurm nodes (one slurmd per node name on this host, all at 127.0.0.1): TRL GRPO
data-parallel over gloo, one torchrun per node meeting at the first node's NodeAddr, each checkpoint
holding both ranks' RNG states; a requeue of the running 2-node job resumes on both nodes from the
last checkpoint (one run for both: a GRPO run that completed untouched proved nothing the requeued
one does not). The step mode's update on two nodes is the one process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.cluster import JobState
from posttrain.runs.follow import TrainingRun, run_and_watch
from posttrain.runs.goodput import JobTimeline, compute_goodput
from posttrain.runs.job import parse_training_settings, timeline_path
from posttrain.trainer.checkpoints import complete_checkpoints, last_complete_checkpoint
from posttrain.trainer.timeline import read_timeline
from tests.support.training import job_grpo_trainer, job_shared_dir

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """'Shared storage' of the two nodes (tests.support.training.job_shared_dir)."""
    return job_shared_dir(tmp_path_factory.mktemp("shared2"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_cluster(shared_dir: Path, *extra_paths: str) -> dict:
    """A SlurmConfig (as a dict) for two nodes, one torchrun per node, CPU."""
    venv_bin = str(Path(sys.executable).parent)
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": f"{venv_bin}:/usr/bin:/bin",
           "PYTHONPATH": os.pathsep.join([str(REPO), *extra_paths])}
    return {"shared_dir": str(shared_dir), "image": None, "python": sys.executable, "nodes": 2, "gpus_per_node": 0,
            "memory": "1G", "exclusive": False, "time_limit": "10", "launcher": "torchrun",
            "master_port": free_port(), "poll_interval_s": 1, "env": env}  # fmt: skip


def _settings(shared: Path, out: str, *, slow: bool = False, **trainer) -> dict:
    return {"name": "tiny-2nodes", "backend": "slurm", "cluster": two_node_cluster(shared, str(shared / "pymod")),
            "trainer": job_grpo_trainer(shared, out, slow=slow, **{"per_device_train_batch_size": 4, **trainer})}


def _scontrol_show(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def job_processes(job_dir: str) -> list[int]:
    """Live processes of a job (their command line names its folder): on every node, as all run here."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if job_dir in cmd and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def assert_one_rank_per_node(run: TrainingRun, attempt_text: str = "") -> None:
    logs = [run.handle.tail_log(3000, rank=r) for r in (0, 1)]
    assert "distributed: rank 0 of world size 2 (node rank 0, local rank 0)" in logs[0], logs[0][-3000:]
    assert "distributed: rank 1 of world size 2 (node rank 1, local rank 0)" in logs[1], logs[1][-3000:]
    assert "(Slurm node n1)" in logs[0] and "(Slurm node n2)" in logs[1]
    assert "backend gloo, rendezvous 127.0.0.1:" in logs[0]  # the first node's NodeAddr, not "n1"


@pytest.mark.timeout(360)
@pytest.mark.usefixtures("slurm_cluster_2nodes")
def test_requeue_of_a_two_node_job_resumes_on_both_nodes(shared: Path, slurm_jobs: list, tmp_path: Path) -> None:
    out = shared / "requeue-2nodes"
    config = parse_training_settings(_settings(shared, out.name, slow=True, max_steps=6, save_steps=2))
    runs: list[TrainingRun] = []
    seen: list[int] = []
    last = None
    stopped_s = None
    before: dict[Path, int] = {}

    def submitted(run: TrainingRun) -> None:
        runs.append(run)
        slurm_jobs.append(run.handle)

    for info in run_and_watch(config, on_submit=submitted, cursor_path=tmp_path / "c.json", poll_interval=0.3):
        seen.append(info.step)
        if len(seen) == 1:
            job_id, job_dir = runs[0].job_id, runs[0].handle.job_dir
            t0 = time.monotonic()
            subprocess.run(["scontrol", "requeue", job_id], check=True)
            while job_processes(job_dir):  # both nodes' tasks stop
                assert time.monotonic() - t0 < 120, f"left running: {job_processes(job_dir)}"
                time.sleep(0.2)
            stopped_s = time.monotonic() - t0
            # the first attempt is gone: what it left is what the second must resume from
            last = last_complete_checkpoint(out)
            before = {c.path: (c.path / "trainer_state.json").stat().st_mtime_ns for c in complete_checkpoints(out)}

    (run,) = runs
    assert run.state() == JobState.COMPLETED
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", run.job_id, "-o", "NNodes,NodeList,State"],
                           capture_output=True, text=True).stdout.split()
    assert sacct == ["2|n[1-2]|COMPLETED"], sacct
    assert seen == sorted(seen) and len(set(seen)) == len(seen) and seen[-1] == 6
    assert last is not None and 2 <= last.step < 6
    assert "Restarts=1" in _scontrol_show(run.job_id)
    results = run.results()
    assert (results[-1].resumed_from, results[-1].global_step, results[-1].completed) == (last.path, 6, True)
    for rank in (0, 1):  # both nodes' second attempt resumed from that checkpoint
        assert f"resuming from {last.path}" in run.handle.tail_log(5000, rank=rank), rank
    assert_one_rank_per_node(run)
    for c in complete_checkpoints(out):  # rank 0 wrote both ranks' RNG states, before and after the requeue
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in c.path.iterdir()}, c.path
    steps = [json.loads((c.path / "trainer_state.json").read_text())["global_step"] for c in complete_checkpoints(out)]
    assert steps == [c.step for c in complete_checkpoints(out)] and steps[-1] == 6
    # not from scratch: the checkpoints of the first attempt were never rewritten
    assert before and all((p / "trainer_state.json").stat().st_mtime_ns == t for p, t in before.items())
    # Its timeline (docs/goodput.md): two attempts, and the time the requeue lost is measured:
    # from the first attempt's last completed save to the second attempt's start.
    attempts = read_timeline(timeline_path(out, run.spec.name, run.spec.run_id))
    assert len(attempts) == 2 and not attempts[0].finished and attempts[1].finished, attempts
    assert [a.slurm_restart_count for a in attempts] == [0, 1]
    first, second = attempts
    g = compute_goodput(first.start, second.ended, [JobTimeline(None, attempts)], [])
    assert g.restarts == 1 and g.seconds["lost"] == pytest.approx(second.start - first.last_save_end)
    assert g.seconds["lost"] > 0 and g.lost_restart_s > 0 and sum(g.seconds.values()) == pytest.approx(g.wall_s)
    print(f"both nodes stopped {stopped_s:.1f} s after the requeue; resumed from checkpoint-{last.step}; "
          f"lost {g.seconds['lost']:.1f} s ({g.lost_redone_s:.1f} s redone, {g.lost_restart_s:.1f} s restart gap)")


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("slurm_cluster_2nodes")
def test_step_mode_on_two_slurm_nodes_is_the_one_process_update(shared: Path, slurm_jobs: list,
                                                                 tmp_path: Path) -> None:
    """mode: step on external rollouts across both nodes: each rank takes half the micro-batches,
    gradients are summed over gloo; the update equals one process's, written once by rank 0."""
    import torch
    from safetensors.torch import load_file

    from posttrain.datasets.toy import toy_prompt_rows
    from posttrain.rewards import length_reward
    from posttrain.rollouts.format import write_rollouts
    from posttrain.testing.sampler import sample_rollouts
    from posttrain.trainer import TrainerConfig, run_training

    rollouts = sample_rollouts(shared / "model", toy_prompt_rows(4), group_size=4, max_new_tokens=8,
                               reward_func=length_reward)  # fmt: skip
    path = write_rollouts(shared / "rollouts-2nodes.jsonl", rollouts)
    trainer = {"mode": "step", "model_name_or_path": str(shared / "model"), "rollouts": str(path),
               "learning_rate": 1e-3, "per_device_train_batch_size": 4, "num_iterations": 2, "use_cpu": True}
    settings = {"name": "step-2nodes", "backend": "slurm", "cluster": two_node_cluster(shared),
                "trainer": {**trainer, "output_dir": str(shared / "step-2nodes")}}  # fmt: skip
    runs: list[TrainingRun] = []

    def submitted(run: TrainingRun) -> None:
        runs.append(run)
        slurm_jobs.append(run.handle)

    steps = [i.step for i in run_and_watch(parse_training_settings(settings), on_submit=submitted,
                                           cursor_path=tmp_path / "c.json", poll_interval=0.3)]
    (run,) = runs
    assert steps == [2] and run.state() == JobState.COMPLETED
    assert_one_rank_per_node(run)
    (result,) = run.results()
    assert (result.global_step, result.policy_version, result.completed) == (2, 1, True)
    single = run_training(TrainerConfig(**trainer, output_dir=str(tmp_path / "single")))
    two = load_file(str(shared / "step-2nodes" / "checkpoint-2" / "model.safetensors"))
    for name, tensor in load_file(str(single.checkpoint / "model.safetensors")).items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-5, atol=1e-6)
