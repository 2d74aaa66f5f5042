"""The local backend runs the same JobSpec through submitit's LocalExecutor, end to end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from posttrain.cluster import JobFailed, JobSpec, JobState, LocalConfig, open_backend
from posttrain.cluster.local import LocalBackend
from posttrain.cluster.smoke import CountingJob


def _backend(tmp_path: Path, **change) -> LocalBackend:
    return LocalBackend(LocalConfig(folder=str(tmp_path / "jobs"), poll_interval_s=0.2, **change))


def _wait_for_step(state: Path, step: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(state.read_text())["step"] >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{state} never reached step {step}")


def _starts(state: Path) -> list[dict]:
    return [json.loads(line) for line in Path(f"{state}.starts").read_text().splitlines()]


def test_default_backend_is_local() -> None:
    assert isinstance(open_backend(), LocalBackend)


def test_checkpointable_job_is_restarted_and_resumes(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    spec = JobSpec(name="count", function=CountingJob(), args=(12, str(state), 0.15), env={"SMOKE_PROBE": "a b"})
    handle = _backend(tmp_path).submit(spec)
    _wait_for_step(state, 3)
    assert handle.state() == JobState.RUNNING
    handle.interrupt()  # what Slurm sends before a timeout or at preemption
    result = handle.result(timeout_s=60)
    assert result == {"step": 12, "env_probe": "a b"}
    first, second = _starts(state)
    assert first["resumed_from"] == 0 and second["resumed_from"] >= 3
    assert "Requeued job" in handle.tail_log(200)


def test_command_job_runs_with_job_dir_files(tmp_path: Path) -> None:
    spec = JobSpec(
        name="cmd",
        command=["python", "-m", "posttrain.cluster.smoke", "--steps", "3", "--sleep", "0.05",
                 "--state", "{job_dir}/state.json"],  # fmt: skip
        files={"note.txt": "hello\n"},
    )
    backend = _backend(tmp_path)
    handle = backend.submit(spec)
    assert handle.wait(timeout_s=60) == JobState.COMPLETED
    assert handle.failure_reason() is None
    assert "step 3" in handle.tail_log(10)
    job_dir = Path(backend.job_dir(spec))
    assert (job_dir / "note.txt").read_text() == "hello\n"
    assert json.loads((job_dir / "state.json").read_text())["step"] == 3


def test_failing_command_reports_its_status(tmp_path: Path) -> None:
    spec = JobSpec(
        name="fail",
        command=[sys.executable, "-m", "posttrain.cluster.smoke", "--steps", "5", "--fail-at", "1",
                 "--sleep", "0.05", "--state", "{job_dir}/state.json"],  # fmt: skip
    )
    handle = _backend(tmp_path).submit(spec)
    assert handle.wait(timeout_s=60) == JobState.FAILED
    with pytest.raises(JobFailed, match="exited with status 3"):
        handle.result()
    assert "failing at step 1 as asked" in handle.failure_reason()


def test_cancel_on_abort(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    spec = JobSpec(name="abort", function=CountingJob(), args=(1000, str(state), 0.1))
    with pytest.raises(KeyboardInterrupt):
        with _backend(tmp_path).submit(spec) as handle:
            _wait_for_step(state, 1)
            raise KeyboardInterrupt
    assert handle.wait(timeout_s=30) == JobState.CANCELLED
    with pytest.raises(JobFailed, match="CANCELLED"):
        handle.result()


def test_dry_run_starts_nothing(tmp_path: Path, capsys, no_contact) -> None:
    backend = _backend(tmp_path, dry_run=True, env={"NCCL_DEBUG": "WARN"})
    spec = JobSpec(name="dry", run_id="r1", command=["python", "-m", "posttrain.trainer", "{job_dir}/t.yaml"])
    assert backend.submit(spec).state() == JobState.DRY_RUN
    out = capsys.readouterr().out
    assert f"{backend.job_dir(spec)}/t.yaml" in out and "NCCL_DEBUG=WARN" in out
    assert not (tmp_path / "jobs").exists()


def test_torchrun_launch_line_forms_a_process_group(tmp_path: Path) -> None:
    # two CPU processes under torchrun with the topology flags posttrain builds (gloo without GPUs)
    backend = _backend(tmp_path, launcher="torchrun", gpus=2)
    handle = backend.submit(JobSpec(name="ddp", command=["python", "-m", "posttrain.cluster.smoke", "--all-reduce"]))
    assert handle.wait(timeout_s=120) == JobState.COMPLETED, handle.failure_reason()
    log = handle.tail_log(50)
    assert "rank 0 of 2" in log and "all-reduce sum 1 (expected 1" in log
