"""runs.once: one submission per marker; after a restart, what was handled, what is left, and the result."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import posttrain.runs.once as once
from posttrain.cluster import JobState, LocalConfig, SlurmConfig
from posttrain.runs.job import TrainingSettings, results_path
from posttrain.runs.watch import watch_checkpoints
from posttrain.trainer.config import TrainerConfig


def settings(tmp_path) -> TrainingSettings:
    trainer = TrainerConfig(mode="grpo", model_name_or_path="/m", output_dir=str(tmp_path / "out"),
                            dataset_manifest=str(tmp_path / "m.json"), reward_funcs=["posttrain.rewards:format_reward"],
                            max_steps=1)
    return TrainingSettings(name="nightly-abc", run_id="r1", cluster=LocalConfig(), trainer=trainer)


def slurm(**fields) -> SlurmConfig:
    return SlurmConfig(shared_dir="/mnt/shared", image="/mnt/shared/posttrain.sqsh", **fields)


def record(tmp_path, backend: str = "slurm") -> once.JobRecord:
    """A job an earlier process submitted (this process holds no handle on it)."""
    return once.JobRecord(job_id="77", run_id="r1", name="nightly-abc", backend=backend,
                          log_path=str(tmp_path / "jobs" / "77" / "log.out"), output_dir="/mnt/shared/runs/out",
                          watch_dir=str(tmp_path / "out"))  # as the cluster sees it, and as this machine does


def write_result(job: once.JobRecord, *, step: int, completed: bool = True) -> None:
    path = Path(results_path(job.watch_dir, job.name, job.run_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f'{{"mode": "grpo", "global_step": {step}, "completed": {str(completed).lower()}}}\n')


class FakeSlurm:
    """A Slurm backend whose attached job reports ``states`` one poll at a time (the last one stays);
    ``on_state(state)`` runs at each poll."""

    def __init__(self, states: list[JobState], on_state=None):
        self.states, self.on_state, self.attached = list(states), on_state, []

    def attach(self, job_id: str, job_dir: str):
        self.attached.append((job_id, job_dir))
        return SimpleNamespace(state=self._state)

    def _state(self) -> JobState:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if self.on_state is not None:
            self.on_state(state)
        return state


@pytest.fixture(autouse=True)
def no_live_runs(monkeypatch):
    monkeypatch.setattr(once, "_RUNS", {})


def test_a_marker_means_one_submission(tmp_path, monkeypatch):
    calls = []

    def fake_submit(cfg):
        calls.append(cfg)
        return SimpleNamespace(job_id="42", spec=SimpleNamespace(run_id="r1", name=cfg.name), log_path="/log",
                               watch_dir=cfg.local_output_dir)

    monkeypatch.setattr(once, "submit_training", fake_submit)
    marker = tmp_path / "run" / "training-job.json"
    first, new = once.submit_once(settings(tmp_path), marker)
    again, new_again = once.submit_once(settings(tmp_path), marker)
    assert (new, new_again) == (True, False)
    assert again == first and len(calls) == 1
    assert [p.name for p in marker.parent.iterdir()] == [marker.name]  # written whole, no temporary left
    assert once.JobRecord.model_validate_json(marker.read_text()) == first

    # after a restart (no handle), completion comes from the trainer's results file
    monkeypatch.setattr(once, "_RUNS", {})
    with pytest.raises(RuntimeError, match="left no completed result"):
        once.completed_result(first)
    write_result(first, step=1)
    assert once.completed_result(first).global_step == 1
    assert once.job_ended(first)


def test_a_job_whose_output_this_machine_cannot_see_says_so(tmp_path):
    job = record(tmp_path).model_copy(update={"watch_dir": None})
    cursor = tmp_path / "cursor.json"
    cursor.write_text("{}")
    with pytest.raises(ValueError, match="/mnt/shared/runs/out is not visible here; set watch_dir"):
        once.handled_before(job, cursor)
    with pytest.raises(ValueError, match="not visible here"):
        once.completed_result(job)


def test_long_names_are_shortened_to_a_stable_job_name():
    name = "a" * 40 + "-nightly-1234abcd"
    short = once.job_name(name)
    assert len(short) <= 31 and short == once.job_name(name) and short != once.job_name(name + "x")
    assert once.job_name("short") == "short"


def test_handled_before_is_what_the_cursor_passed_less_what_it_skipped(tmp_path, make_checkpoint):
    job = record(tmp_path)
    out = Path(job.watch_dir)
    cursor = tmp_path / "run" / "watch-cursor.json"
    assert once.handled_before(job, cursor) == []  # a first attempt: no cursor yet
    for step in (1, 2, 3, 4):
        make_checkpoint(out, step)
    make_checkpoint(out, 5, state=False)  # incomplete
    # an earlier attempt: checkpoint 1 was skipped, 2 and 3 handed out, it died handling 3
    watch = watch_checkpoints(out, cursor_path=cursor, is_job_done=lambda: False, poll_interval=0)
    (out / "checkpoint-1" / "trainer_state.json").rename(out / "checkpoint-1" / "state.bak")
    assert next(watch).step == 2
    assert next(watch).step == 3  # the cursor moves past 2 only now
    watch.close()
    (out / "checkpoint-1" / "state.bak").rename(out / "checkpoint-1" / "trainer_state.json")
    assert [c.step for c in once.handled_before(job, cursor)] == [2]


def test_checkpoints_after_a_restart_continue_after_the_cursor_until_slurm_says_the_job_ended(
        tmp_path, make_checkpoint, monkeypatch):
    job = record(tmp_path)
    out = Path(job.watch_dir)
    cursor = tmp_path / "run" / "watch-cursor.json"
    make_checkpoint(out, 1)
    make_checkpoint(out, 2)
    first = once.checkpoints_to_handle(job, slurm(), cursor_path=cursor, poll_interval=0)
    assert next(first).step == 1
    assert next(first).step == 2  # handled 1; dies while handling 2
    first.close()

    def job_progress(state: JobState) -> None:  # checkpoint 3 appears while the job runs
        if state == JobState.RUNNING and not (out / "checkpoint-3").exists():
            make_checkpoint(out, 3)

    fake = FakeSlurm([JobState.RUNNING, JobState.RUNNING, JobState.COMPLETED], job_progress)
    monkeypatch.setattr(once, "open_backend", lambda cluster: fake)
    again = once.checkpoints_to_handle(job, slurm(), cursor_path=cursor, poll_interval=0)
    assert [c.step for c in again] == [2, 3]
    assert fake.attached == [("77", str(tmp_path / "jobs" / "77"))]  # attached once, polled thrice
    assert fake.states == [JobState.COMPLETED]


def test_a_local_job_of_an_earlier_process_is_drained_without_waiting(tmp_path, make_checkpoint, monkeypatch):
    job = record(tmp_path, backend="local")
    make_checkpoint(Path(job.watch_dir), 1)
    monkeypatch.setattr(once, "open_backend", lambda cluster: pytest.fail("a local job is never attached to"))
    steps = [c.step for c in once.checkpoints_to_handle(job, LocalConfig(), cursor_path=tmp_path / "c.json",
                                                        poll_interval=0)]
    assert steps == [1]


def test_waiting_for_a_job_an_earlier_process_submitted(tmp_path, monkeypatch):
    job = record(tmp_path)
    write_result(job, step=3, completed=False)  # an attempt stopped to be requeued

    def finish(state: JobState) -> None:
        if state == JobState.COMPLETED:
            write_result(job, step=8)

    fake = FakeSlurm([JobState.PENDING, JobState.RUNNING, JobState.COMPLETED], finish)
    monkeypatch.setattr(once, "open_backend", lambda cluster: fake)
    sleeps: list[float] = []
    result = once.wait_for_result(job, slurm(poll_interval_s=7.5), sleep=sleeps.append)
    assert result.global_step == 8 and result.completed
    assert sleeps == [7.5, 7.5]  # the cluster's poll interval, once per unfinished poll


def test_waiting_for_a_job_that_failed_without_a_result_raises(tmp_path, monkeypatch):
    job = record(tmp_path)
    monkeypatch.setattr(once, "open_backend", lambda cluster: FakeSlurm([JobState.RUNNING, JobState.FAILED]))
    with pytest.raises(RuntimeError, match=r"training job 77 left no completed result in .*out"):
        once.wait_for_result(job, slurm(poll_interval_s=1), sleep=lambda s: None)


def test_waiting_for_a_job_this_process_submitted_follows_its_handle(tmp_path, monkeypatch):
    job = record(tmp_path)
    states = [JobState.RUNNING, JobState.RUNNING, JobState.FAILED]
    run = SimpleNamespace(state=lambda: states.pop(0) if len(states) > 1 else states[0],
                          failure_reason=lambda: "out of memory")
    monkeypatch.setattr(once, "_RUNS", {job.job_id: run})
    monkeypatch.setattr(once, "open_backend", lambda cluster: pytest.fail("the handle is enough"))
    write_result(job, step=1)  # a completed result of another attempt does not hide the failure
    sleeps: list[float] = []
    with pytest.raises(RuntimeError, match="ended FAILED: out of memory"):
        once.wait_for_result(job, slurm(poll_interval_s=2), sleep=sleeps.append)
    assert sleeps == [2, 2]


def _group(tmp_path, seconds: float):
    """A real child process group (a shell and its sleep), as a local job's controller leads one."""
    import subprocess

    return subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds}; echo done"], start_new_session=True,
                            stdout=subprocess.DEVNULL)


def test_a_local_job_of_an_earlier_process_has_ended_only_when_its_process_group_has(tmp_path):
    proc = _group(tmp_path, 1.5)
    job = record(tmp_path, "local").model_copy(update={"pgid": proc.pid})
    ended = once.ended_check(job, None)
    assert not ended()  # still training: a retried run keeps following it
    proc.wait(10)
    assert ended()


def test_a_local_job_with_a_completed_result_has_ended_even_while_its_group_lives(tmp_path):
    proc = _group(tmp_path, 30)
    try:
        job = record(tmp_path, "local").model_copy(update={"pgid": proc.pid})
        write_result(job, step=2)
        assert once.job_ended(job)
    finally:
        proc.kill()
        proc.wait()


def test_cancel_job_stops_the_whole_process_group_of_a_local_job(tmp_path):
    from posttrain.cluster.local import group_members

    proc = _group(tmp_path, 60)
    job = record(tmp_path, "local").model_copy(update={"pgid": proc.pid})
    import time

    deadline = time.monotonic() + 60
    while len(group_members(proc.pid)) < 2 and time.monotonic() < deadline:  # the shell and its sleep
        time.sleep(0.05)
    assert len(group_members(proc.pid)) == 2
    said = once.cancel_job(job, None)
    assert f"stopped process group {proc.pid} (2 processes)" in said
    proc.wait(60)
    assert group_members(proc.pid) == []
    assert once.job_ended(job)
    assert "had already ended" in once.cancel_job(job, None)
