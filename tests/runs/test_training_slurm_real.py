"""The trainer as a cluster job, end to end: a real tiny GRPO run on the real single-node Slurm
(checkpoints watched in order; a requeue that resumes from the last checkpoint is
tests/runs/test_training_slurm_2nodes.py's, on two nodes) and on the local
backend (through `posttrain train`), plus the failure path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.cluster import JobState
from posttrain.runs.follow import TrainingFailed, TrainingRun, run_and_watch
from posttrain.runs.job import parse_training_settings
from posttrain.trainer.checkpoints import last_complete_checkpoint
from tests.support.training import job_grpo_trainer, job_shared_dir

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for the model build here; jobs get it from cluster.env


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """'Shared storage' of the single node (tests.support.training.job_shared_dir)."""
    return job_shared_dir(tmp_path_factory.mktemp("shared"))


def _settings(shared: Path, out: str, backend: str, *, slow: bool = False, **trainer) -> dict:
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(shared / "pymod")}
    if backend == "slurm":
        cluster = {"shared_dir": str(shared), "image": None, "python": sys.executable, "gpus_per_node": 0,
                   "memory": "2G", "exclusive": False, "time_limit": "10", "launcher": "python",
                   "poll_interval_s": 1, "env": env}  # fmt: skip
    else:
        cluster = {"folder": str(shared / "local-jobs"), "poll_interval_s": 0.3, "env": env}
    return {"name": f"tiny-{backend}", "backend": backend, "cluster": cluster,
            "trainer": job_grpo_trainer(shared, out, slow=slow, **trainer)}


def _global_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("slurm_cluster")
def test_slurm_trains_and_hands_out_checkpoints_in_order(shared: Path, slurm_jobs: list, tmp_path: Path) -> None:
    config = parse_training_settings(_settings(shared, "slurm-run", "slurm"))
    runs: list[TrainingRun] = []
    states: list[JobState] = []

    def submitted(run: TrainingRun) -> None:
        runs.append(run)
        slurm_jobs.append(run.handle)

    steps = [
        info.step
        for info in run_and_watch(
            config, on_submit=submitted, cursor_path=tmp_path / "cursor.json", poll_interval=0.3, on_state=states.append
        )
    ]
    (run,) = runs
    assert steps == [1, 2, 3]
    assert states[-1] == JobState.COMPLETED and run.state() == JobState.COMPLETED
    assert set(states) <= {JobState.PENDING, JobState.RUNNING, JobState.COMPLETED}
    (result,) = run.results()
    assert (result.global_step, result.completed, result.resumed_from) == (3, True, None)
    assert _global_step(shared / "slurm-run" / "checkpoint-3") == 3
    job_dir = Path(run.handle.job_dir)
    assert (job_dir / "trainer.yaml").read_text() == run.spec.files["trainer.yaml"]
    assert "export HF_HUB_OFFLINE=1" in (job_dir / "node.sh").read_text()
    assert Path(run.log_path).exists() and '"global_step": 3' in run.handle.tail_log(200)
    # a second watch of the same cursor has nothing new
    assert list(run.checkpoints(cursor_path=tmp_path / "cursor.json", poll_interval=0.3)) == []


@pytest.mark.timeout(180)
def test_local_backend_runs_the_same_trainer_through_the_cli(shared: Path, tmp_path: Path, capsys) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text(yaml.safe_dump(_settings(shared, "local-run", "local")))
    assert main(["train", str(settings), "--cursor", str(tmp_path / "cursor.json")]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [c["step"] for c in lines] == [1, 2, 3]
    assert lines[-1]["path"] == str(shared / "local-run" / "checkpoint-3")
    assert "submitted " in captured.err and "RUNNING" in captured.err
    assert f"ended COMPLETED: global_step 3, last checkpoint {shared / 'local-run' / 'checkpoint-3'}" in captured.err


@pytest.mark.timeout(120)
def test_a_failing_trainer_raises_with_the_reason_and_the_log(shared: Path, tmp_path: Path) -> None:
    doc = _settings(shared, "local-bad", "local")
    doc["trainer"]["dataset_manifest"] = str(shared / "missing" / "manifest.json")
    config = parse_training_settings(doc)
    with pytest.raises(TrainingFailed) as failed:
        for _ in run_and_watch(config, cursor_path=tmp_path / "cursor.json", poll_interval=0.3):
            pass
    assert failed.value.state == "FAILED"
    assert "command exited with status 2" in failed.value.reason
    assert "posttrain.trainer: error:" in failed.value.reason and "manifest.json" in failed.value.reason


@pytest.mark.timeout(120)
def test_leaving_the_watch_early_cancels_the_job(shared: Path, tmp_path: Path) -> None:
    """What Ctrl-C in `posttrain train` does: the iterator owns the job and cancels it when left."""
    config = parse_training_settings(_settings(shared, "local-cancel", "local", slow=True, max_steps=50))
    runs: list[TrainingRun] = []
    watch = run_and_watch(config, on_submit=runs.append, cursor_path=tmp_path / "cursor.json", poll_interval=0.3)
    assert next(watch).step == 1
    watch.close()
    (run,) = runs
    assert run.handle.wait(timeout_s=30) == JobState.CANCELLED
    assert last_complete_checkpoint(shared / "local-cancel").step < 50
