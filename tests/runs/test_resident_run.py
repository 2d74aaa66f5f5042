"""runs.resident: the policy a round samples from under a staleness bound (newest trained, no wait;
a wait, never a drop, at the bound), handing rounds, and a job that ends before a round's checkpoint.

The job is a local job of an earlier process whose process group is this test's (alive while the
test runs); its checkpoints are fake ones written by the test, as the trainer would write them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from posttrain.runs.once import JobRecord
from posttrain.runs.resident import Policy, ResidentRun
from posttrain.trainer.config import TrainerConfig
from posttrain.trainer.rounds import read_ready


def resident(tmp_path, *, alive: bool = True, rounds: int = 6) -> ResidentRun:
    out = tmp_path / "policy"
    out.mkdir(exist_ok=True)
    (tmp_path / "base").mkdir(exist_ok=True)
    trainer = TrainerConfig(mode="resident", model_name_or_path=str(tmp_path / "base"), output_dir=str(out),
                            rounds_dir=str(tmp_path / "rounds"), rounds=rounds, max_staleness=2)
    record = JobRecord(job_id="local-1", run_id="r1", name="run-resident", backend="local", log_path=None,
                       output_dir=str(out), watch_dir=str(out), pgid=os.getpgid(0) if alive else None)
    return ResidentRun(record, None, trainer, cursor_path=tmp_path / "cursor.json", poll_interval=0.02)


def train(make_checkpoint, job: ResidentRun, round: int, after: float = 0.0) -> threading.Thread:
    """The trainer writing round ``round``'s checkpoint, ``after`` seconds from now."""
    def write() -> None:
        time.sleep(after)
        make_checkpoint(job.record.local_dir(), round + 1)

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def timed_policy(job: ResidentRun, round: int, k: int) -> tuple[Policy, float, bool]:
    waited: list[bool] = []
    t0 = time.monotonic()
    policy = job.policy_for(round, k, waiting=lambda: waited.append(True))
    return policy, time.monotonic() - t0, bool(waited)


def test_round_zero_samples_the_initial_policy(tmp_path):
    job = resident(tmp_path)
    assert job.policy_for(0, 0) == Policy(0, str(tmp_path / "base"))
    assert job.recorded_version(job.policy_for(0, 2)) == 0


@pytest.mark.parametrize("k", [1, 2])
def test_rounds_within_the_bound_sample_at_once_from_the_newest_policy(tmp_path, make_checkpoint, k):
    job = resident(tmp_path)
    for r in range(1, k + 1):  # nothing trained yet: rounds 1..k may sample the initial policy
        policy, seconds, waited = timed_policy(job, r, k)
        assert policy.version == 0 and not waited and seconds < 1
    train(make_checkpoint, job, 0).join()  # round 0 trained: the next round takes it without waiting
    policy, _, waited = timed_policy(job, k, k)
    assert policy == Policy(1, str(tmp_path / "policy" / "checkpoint-1")) and not waited


@pytest.mark.parametrize("k", [0, 1, 2])
def test_sampling_waits_at_the_bound_for_the_trainer(tmp_path, make_checkpoint, k):
    job = resident(tmp_path)
    r = k + 1  # the first round that needs round 0 trained
    writer = train(make_checkpoint, job, 0, after=0.5)
    policy, seconds, waited = timed_policy(job, r, k)
    writer.join()
    assert waited and seconds >= 0.4
    assert policy == Policy(1, str(tmp_path / "policy" / "checkpoint-1"))  # never older than r - k


def test_taking_the_newest_skips_to_every_round_trained(tmp_path, make_checkpoint):
    job = resident(tmp_path)
    for r in range(3):
        train(make_checkpoint, job, r).join()
    assert job.policy_for(4, 2).version == 3  # rounds 0, 1, 2 trained: version 3, though 2 would do
    assert job.policy_for(5, 2).version == 3  # nothing newer: 5 - 3 = 2 is within the bound


def test_a_job_that_ends_before_the_round_the_bound_needs_fails_with_its_reason(tmp_path):
    job = resident(tmp_path, alive=False)  # no process group recorded: the job counts as ended
    with pytest.raises(RuntimeError, match=r"round 0: training job local-1 ended before writing checkpoint-1"):
        job.policy_for(1, 0)


def test_hand_records_the_sampling_policy_version_and_again_is_a_no_op(tmp_path, make_checkpoint):
    job = resident(tmp_path)
    folder = tmp_path / "rounds" / "0003"
    folder.mkdir(parents=True)
    (folder / "rollouts.jsonl").write_text("{}\n")
    assert job.sampled(3) and job.handed(3) is None
    job.hand(3, 2)
    job.hand(3, 5)  # a retried flow run hands it again: the first hand-over stands
    assert read_ready(tmp_path / "rounds", 3).policy_versions == [2] == job.handed(3)


def test_finish_waits_for_every_round_then_the_jobs_result(tmp_path, make_checkpoint):
    from posttrain.runs.job import results_path

    job = resident(tmp_path, rounds=2)
    writers = [train(make_checkpoint, job, r, after=0.2 * (r + 1)) for r in range(2)]
    path = Path(results_path(job.record.watch_dir, job.record.name, job.record.run_id))

    def complete() -> None:  # the trainer's result comes after its last checkpoint
        for w in writers:
            w.join()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"mode": "resident", "global_step": 2, "completed": true, "rounds_done": 2}\n')

    threading.Thread(target=complete).start()
    ended: list[tuple] = []
    job._on_end = lambda outcome, reason: ended.append((outcome, reason))
    policy, result = job.finish(2)
    assert policy == Policy(2, str(tmp_path / "policy" / "checkpoint-2"))
    assert result.completed and result.rounds_done == 2 and ended == [("completed", None)]


def test_a_job_found_ended_without_completing_is_to_be_submitted_again(tmp_path):
    from posttrain.runs.job import results_path
    from posttrain.runs.resident import ended_unfinished, retire_if_ended, retired_markers

    running = resident(tmp_path).record
    assert ended_unfinished(running, None) is None  # its process group lives: follow it
    marker = tmp_path / "run" / "training-job.json"
    marker.parent.mkdir()
    marker.write_text(running.model_dump_json())
    assert retire_if_ended(running, None, marker) is None and marker.exists()  # the marker stays
    gone = resident(tmp_path, alive=False).record  # it timed out waiting for a round, say
    assert "left no completed result" in ended_unfinished(gone, None)
    for n in (1, 2):  # each ended job's marker moves aside, numbered in order: submit_once submits again
        marker.write_text(gone.model_dump_json())
        retired, why = retire_if_ended(gone, None, marker)
        assert retired == marker.with_name(f"training-job.{n}.json") and not marker.exists()
        assert "left no completed result" in why and retired.read_text() == gone.model_dump_json()
    marker.write_text(running.model_dump_json())
    assert retired_markers(marker) == [marker.with_name(f"training-job.{n}.json") for n in (1, 2)] + [marker]
    path = Path(results_path(gone.watch_dir, gone.name, gone.run_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"mode": "resident", "global_step": 6, "completed": true, "rounds_done": 6}\n')
    assert ended_unfinished(gone, None) is None  # it completed: nothing to submit
