"""The checker's rule for a training job still running at the end of a soak: a GRPO run's resident
trainer outlives a failed run (kept for a retry) and must end by itself ``round_timeout_s`` after its
flow's last heartbeat; it is waited for until then and a violation after. Any other job still running
is a violation at once."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from posttrain.testing.soak import check_leftovers
from posttrain.testing.soak.check_model import CheckResult
from posttrain.trainer.rounds import HEARTBEAT_FILE


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_leftovers, "_squeue", lambda: [])


def _job(run_dir: Path, seconds: float, heartbeat_age_s: float | None) -> subprocess.Popen:
    """A local 'trainer' of ``seconds`` in a process group of its own, its marker, and the flow's heartbeat
    ``heartbeat_age_s`` old (None: no heartbeat, not a resident trainer)."""
    proc = subprocess.Popen(["sleep", str(seconds)], start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped as its supervisor would: no zombie group
    run_dir.mkdir(parents=True)
    (run_dir / "training-job.json").write_text(json.dumps({
        "job_id": str(proc.pid), "run_id": "r", "name": f"job-{run_dir.name}", "backend": "local",
        "output_dir": str(run_dir / "output"), "pgid": proc.pid}))
    if heartbeat_age_s is not None:
        beat = run_dir / "rounds" / HEARTBEAT_FILE
        beat.parent.mkdir()
        beat.write_text("{}")
        then = time.time() - heartbeat_age_s
        os.utime(beat, (then, then))
    return proc


def _check(tmp_path: Path, run_dir: Path) -> CheckResult:
    res = CheckResult("leftovers")
    check_leftovers._jobs(res, [tmp_path, run_dir])
    return res


def test_a_resident_trainer_that_ends_within_its_round_timeout_is_a_note(tmp_path: Path) -> None:
    proc = _job(tmp_path / "grpo", 2, heartbeat_age_s=0)
    try:
        res = _check(tmp_path, tmp_path / "grpo")
    finally:
        proc.kill()
        proc.wait()
    assert res.violations == [] and res.items == 1
    assert any("ended by itself" in n and "job-grpo" in n for n in res.notes), res.notes


def test_a_resident_trainer_past_its_round_timeout_is_a_violation(tmp_path: Path) -> None:
    late = check_leftovers.ROUND_TIMEOUT_S + check_leftovers.TRAINER_EXIT_S + 5
    proc = _job(tmp_path / "grpo", 60, heartbeat_age_s=late)
    try:
        t0 = time.monotonic()
        res = _check(tmp_path, tmp_path / "grpo")
        assert time.monotonic() - t0 < 10  # its deadline had passed: not waited for
    finally:
        proc.kill()
        proc.wait()
    assert len(res.violations) == 1, res.violations
    assert "local job job-grpo" in res.violations[0] and "after its flow's last heartbeat" in res.violations[0]


def test_any_other_job_still_running_is_a_violation_at_once(tmp_path: Path) -> None:
    proc = _job(tmp_path / "nightly", 60, heartbeat_age_s=None)
    try:
        res = _check(tmp_path, tmp_path / "nightly")
    finally:
        proc.kill()
        proc.wait()
    assert len(res.violations) == 1 and f"process group {proc.pid}" in res.violations[0], res.violations
