"""The grpo flow with its resident trainer (``trainer_job: resident``, the default): one training job
for the whole run on the local cluster, handed each round's rollouts; a retried flow run finds the job
and goes on from the rounds it trained; cancelling the run cancels the job."""

from __future__ import annotations

import json
import time

import pytest

from posttrain.runs.once import JobRecord, job_name
from tests.pipeline.conftest import GRPO
from tests.pipeline.flaky import FAIL_ROUND_MARKER_ENV
from tests.pipeline.runs import (
    flow_run_logs,
    prefect_cli,
    run_folder,
    start_deployment,
    task_runs,
    wait_final,
    wait_not_final,
)

pytestmark = pytest.mark.slow


def job_folders(setup, job: str) -> list[str]:
    """The local cluster's job folders of the job named ``job`` (one per submission)."""
    return sorted(p.name for p in setup.jobs_dir.iterdir() if p.name.startswith(f"{job}-"))


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "policy").glob("checkpoint-*"))


@pytest.mark.timeout(480)
def test_asynchronous_rounds_sample_ahead_within_the_bound(tiny_setup):
    """A resident GRPO run is one training job: six rounds at max_staleness 2 are sampled while earlier
    ones train, never from a policy more than 2 versions behind, and nothing is dropped; each shard
    names one snapshot, the one published of the policy version its rollouts record. (Synchronous
    rounds, the default, run in the retry, cancel and Slurm tests below.)"""
    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.rollouts.format import load_rollouts

    k, rounds = 2, 6
    state = grpo(**tiny_setup.grpo_settings("flows-grpo-async", rounds=rounds, shards=2, max_staleness=k),
                 return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    run_dir = tiny_setup.shared_dir / "runs" / report.run_name
    job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert len(job_folders(tiny_setup, job.name)) == 1  # six rounds, one job
    assert checkpoints(run_dir) == [f"checkpoint-{n}" for n in range(1, rounds + 1)]
    published = {}  # policy version -> snapshot identity published of it
    for row in report.rounds:
        published.setdefault(row["policy version"], row["snapshot"])
        assert published[row["policy version"]] == row["snapshot"]  # one version, one snapshot
    stale = []
    for r in range(rounds):
        folder = run_dir / "rounds" / f"{r:04d}"
        ready = json.loads((folder / "ready.json").read_text())
        (version,) = ready["policy_versions"]
        assert r - k <= version <= r, (r, version)  # never older than the bound
        stale.append(r - version)
        if version > 0:  # sampled only once the round that wrote that version was trained
            ckpt = run_dir / "policy" / f"checkpoint-{version}" / "trainer_state.json"
            assert ckpt.stat().st_mtime <= (folder / "rollouts.jsonl").stat().st_mtime
        for shard in sorted(folder.glob("shard-*.jsonl")):
            rollouts = load_rollouts(shard)[0]
            assert {x.snapshot_identity for x in rollouts} == {published[version]}, shard
            assert {x.policy_version for x in rollouts} == {version}
    assert max(stale) > 0, stale  # rounds were sampled ahead of training
    assert [row["staleness"] for row in report.rounds] == stale
    # The trainer trained every round on all of its rollouts, none older than the bound.
    (results,) = sorted((run_dir / "policy" / ".posttrain").glob("*.results.jsonl"))
    (result,) = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    assert result["completed"] and result["rounds_done"] == rounds
    for n in range(1, rounds + 1):
        state_file = json.loads((run_dir / "policy" / f"checkpoint-{n}" / "trainer_state.json").read_text())
        assert state_file["rollouts_dropped_stale"] == 0 and state_file["rollouts_used"] > 0, state_file
        assert state_file["metrics"]["staleness_max"] <= k, state_file
    assert tiny_setup.served_identity() == report.final_snapshot
    assert report.final_checkpoint == str(run_dir / "policy" / f"checkpoint-{rounds}")
    assert not list(run_dir.glob("rounds/*/train-job.json"))  # no step jobs
    assert job.name == job_name(f"{report.run_name}-resident") and job.backend == "local"
    assert result["mode"] == "resident"
    # Goodput: the trainer's waits for rounds are not training; the flow's sampling shows there.
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    from tests.pipeline.run_events import assert_goodput_adds_up

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]}))
    # The UI's rounds table shows each round's policy version, staleness and wait, as the terminal's does.
    table = next(a for a in artifacts if a.key == "flows-grpo-async-rounds")
    shown = json.loads(table.data)
    assert [(x["round"], x["policy"], x["stale"], x["wait s"]) for x in shown] == [
        (row["round"], row["policy version"], row["staleness"], row["wait s"]) for row in report.rounds]
    assert "asynchronous" in table.description and "the round is its rollouts' policy version" not in table.description
    seconds = assert_goodput_adds_up(flow_run_id, next(a for a in artifacts if a.key == "flows-grpo-async-goodput"))
    assert min(seconds["sampling"], seconds["training"], seconds["startup"]) > 0, seconds


def mtimes(paths) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in paths}


@pytest.mark.timeout(720)
def test_a_retried_resident_run_finds_its_job_and_goes_on_from_its_last_round(process_worker, tiny_setup, tmp_path):
    # Round 2's reward fails (not transient) while the marker file exists: the first attempt fails
    # there, after rounds 0 and 1 trained, and so does a retry, which finds the job still waiting.
    # Then the job is lost (its process group stopped, as with its node); the marker is removed and the
    # run retried as the UI does: the job is submitted again and resumes from round 1's checkpoint.
    # Result persistence is on (issue 33, item 10): the retry's second ``submit`` (after the dead job's
    # marker is retired) must submit, not return the first attempt's cached record of the dead job.
    from posttrain.runs.once import cancel_job

    run = "flows-grpo-resident-retry"
    marker = tmp_path / "fail-round-2"
    marker.write_text("fail\n")
    settings = tiny_setup.grpo_settings(run, rounds=3, reward_funcs=["tests.pipeline.flaky:round_failing_reward"])
    proc, flow_run_id = start_deployment(GRPO, settings, env={FAIL_ROUND_MARKER_ENV: f"2:{marker}",
                                                              "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"})
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    run_dir = run_folder(tiny_setup, run, flow_run_id)
    first = wait_final(flow_run_id, timeout=300)
    assert first.state.is_failed(), f"{first.state_name}: {first.state.message}\n{process_worker.tail()}"
    assert "injected: round 2" in (first.state.message or ""), first.state.message
    job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert checkpoints(run_dir) == ["checkpoint-1", "checkpoint-2"]
    assert not (run_dir / "rounds" / "0002" / "rollouts.jsonl").exists()
    kept = [run_dir / "rounds" / f"{r:04d}" / name for r in (0, 1) for name in ("rollouts.jsonl", "ready.json")]
    kept += [run_dir / "policy" / c / "trainer_state.json" for c in ("checkpoint-1", "checkpoint-2")]
    before = mtimes(kept)

    def retry(count: int):
        done = prefect_cli("flow-run", "retry", flow_run_id)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_not_final(flow_run_id)
        final = wait_final(flow_run_id, timeout=300)
        assert final.run_count == count
        return final

    # A retry while the job waits for round 2: it finds the job (not submitted again), fails at round 2 again.
    second = retry(2)
    assert second.state.is_failed() and "injected: round 2" in (second.state.message or "")
    assert JobRecord.model_validate_json((run_dir / "training-job.json").read_text()) == job
    assert len(job_folders(tiny_setup, job.name)) == 1, job_folders(tiny_setup, job.name)
    logs = flow_run_logs(flow_run_id)
    assert any(f"training job {job.job_id} was submitted before" in m for m in logs), logs

    # The job is lost meanwhile; the next retry submits it again, and the new job resumes.
    assert "stopped process group" in cancel_job(job, None)
    marker.unlink()
    third = retry(3)
    assert third.state.is_completed(), f"{third.state_name}: {third.state.message}\n{process_worker.tail()}"
    assert JobRecord.model_validate_json((run_dir / "training-job.1.json").read_text()) == job  # kept
    again = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert again.job_id != job.job_id and again.name == job.name
    assert len(job_folders(tiny_setup, job.name)) == 2, job_folders(tiny_setup, job.name)
    (results,) = sorted((run_dir / "policy" / ".posttrain").glob(f"*{again.run_id}.results.jsonl"))
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0]["completed"] and lines[0]["rounds_done"] == 3, lines
    assert lines[0]["resumed_from"].endswith("checkpoint-2"), lines
    assert checkpoints(run_dir) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # Rounds 0 and 1 were not sampled or trained again: their files untouched, their shards ran once.
    assert mtimes(kept) == before
    shards = [r.name for r in task_runs(flow_run_id)]
    assert shards.count("round-0-shard-0") == shards.count("round-1-shard-0") == 1, shards
    assert shards.count("round-2-shard-0") >= 3, shards  # failed twice, then sampled again
    logs = flow_run_logs(flow_run_id)
    assert any(f"resident training job {job.job_id} ended before the run's last round" in m for m in logs), logs
    assert any("round 1: sampled by an earlier attempt" in m for m in logs), logs
    assert [t.name for t in task_runs(flow_run_id)].count("publish-step-3") == 1
    assert tiny_setup.served_identity().startswith("step-00000003-")
    # Persistence was on: the retries reused the checks' results; every submit ran (none was Cached).
    runs = task_runs(flow_run_id)
    assert any(t.state_name == "Cached" for t in runs), sorted({(t.name, t.state_name) for t in runs})
    assert not [t.name for t in runs if t.name.startswith("submit-") and t.state_name == "Cached"]


@pytest.mark.timeout(420)
def test_cancelling_a_resident_run_mid_run_stops_its_trainer(process_worker, tiny_setup):
    # Many rounds whose sampling lasts seconds each: cancelled once round 0 trained, the job waits
    # for round 1's rollouts (or trains it).
    from tests.pipeline.flaky import SLOW_SECONDS_ENV
    from tests.pipeline.runs import wait_submitted
    from tests.pipeline.test_flows_cancel import cancel_and_check_stopped, wait_for_trainer

    run = "flows-cancel-resident"
    settings = tiny_setup.grpo_settings(run, rounds=50, prompts_per_round=1,
                                        reward_funcs=["tests.pipeline.flaky:slow_reward"])
    proc, flow_run_id = start_deployment(GRPO, settings, env={SLOW_SECONDS_ENV: "2"})
    assert flow_run_id, f"no flow run created:\n{proc.stdout}\n{proc.stderr}"
    job = wait_submitted(tiny_setup, process_worker, run, flow_run_id, "training-job.json")
    wait_for_trainer(job, process_worker)
    run_dir = run_folder(tiny_setup, run, flow_run_id)
    deadline = time.monotonic() + 180
    while not (run_dir / "policy" / "checkpoint-1" / "trainer_state.json").exists():
        assert time.monotonic() < deadline, f"round 0 did not train in 180 s\n{process_worker.tail()}"
        time.sleep(0.5)
    stopped_s = cancel_and_check_stopped(flow_run_id, job)
    assert "checkpoint-50" not in checkpoints(run_dir)
    print(f"resident trainer gone {stopped_s:.1f} s after the cancel request")


@pytest.mark.timeout(300)
def test_a_resident_job_that_ends_before_a_rounds_checkpoint_fails_the_run_with_its_reason(tiny_setup, monkeypatch):
    # The flow's heartbeat is switched off, so the trainer sees the flow as gone: it waits 1 s for
    # round 0's rollouts, whose sampling takes longer, and ends (RoundError) before the round is
    # handed; the flow run fails with that reason instead of waiting forever.
    from contextlib import nullcontext

    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.runs.resident import ResidentRun
    from tests.pipeline.flaky import SLOW_SECONDS_ENV

    monkeypatch.setenv(SLOW_SECONDS_ENV, "20")
    monkeypatch.setattr(ResidentRun, "keep_alive", lambda self: nullcontext())
    params = tiny_setup.grpo_settings("flows-resident-late", rounds=2, prompts_per_round=1, round_timeout_s=1,
                                      reward_funcs=["tests.pipeline.flaky:slow_reward"])
    state = grpo(**params, return_state=True)
    assert state.is_failed(), state.message
    assert "no rollouts in" in (state.message or "") and "after 1 s without a heartbeat" in state.message, \
        state.message


@pytest.mark.timeout(300)
def test_a_round_longer_than_round_timeout_s_is_waited_for_while_the_flow_works_on_it(tiny_setup, monkeypatch):
    # The same run with the flow's heartbeat on: each round's sampling (5 s) outlasts the trainer's
    # round_timeout_s (2 s), and the trainer waits for it (issue 33, item 12: a slow hot-load or
    # sampling killed the job).
    from posttrain.pipeline.flows.grpo import grpo
    from tests.pipeline.flaky import SLOW_SECONDS_ENV

    monkeypatch.setenv(SLOW_SECONDS_ENV, "5")
    params = tiny_setup.grpo_settings("flows-resident-slow-round", rounds=2, prompts_per_round=1, round_timeout_s=2,
                                      reward_funcs=["tests.pipeline.flaky:slow_reward"])
    state = grpo(**params, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert [row["round"] for row in report.rounds] == [0, 1]
    assert all(row["sample s"] > 2 for row in report.rounds), report.rounds  # each round outlasted the timeout


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("slurm_cluster")
@pytest.mark.parametrize("nodes", [2])  # one node: the requeue test below runs a resident job on one
def test_a_resident_grpo_run_on_slurm_is_one_sbatch_job(tiny_setup, nodes, request):
    import subprocess

    if nodes == 2:
        request.getfixturevalue("slurm_cluster_2nodes")

    from posttrain.cluster import SlurmConfig
    from posttrain.pipeline.blocks import SlurmCluster
    from posttrain.pipeline.flows.grpo import grpo
    from tests.runs.test_training_slurm_2nodes import two_node_cluster

    block = f"flows-grpo-resident-slurm-{nodes}"
    SlurmCluster(settings=SlurmConfig(**{**two_node_cluster(tiny_setup.root), "nodes": nodes})).save(block,
                                                                                                   overwrite=True)
    params = tiny_setup.grpo_settings(f"flows-resident-slurm{nodes}", rounds=6, max_staleness=1,
                                      cluster=f"posttrain-slurm-cluster/{block}")
    state = grpo(**params, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    run_dir = tiny_setup.shared_dir / "runs" / report.run_name
    job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
    assert job.backend == "slurm"
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "--name", job.name, "-o", "JobID,State"],
                           capture_output=True, text=True, timeout=20).stdout.split()
    assert sacct == [f"{job.job_id}|COMPLETED"], sacct  # one sbatch job for the six rounds
    assert checkpoints(run_dir) == [f"checkpoint-{n}" for n in range(1, 7)]
    assert [row["round"] for row in report.rounds] == list(range(6))
    assert all(0 <= row["staleness"] <= 1 for row in report.rounds), report.rounds
    assert tiny_setup.served_identity() == report.final_snapshot
    if nodes == 2:  # one rank on each node, in the one job
        from tests.pipeline.test_flows_multinode import rank_log

        logs = [rank_log(job.log_path, r) for r in (0, 1)]
        assert "distributed: rank 0 of world size 2 (node rank 0" in logs[0], logs[0][-2000:]
        assert "distributed: rank 1 of world size 2 (node rank 1" in logs[1], logs[1][-2000:]


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("slurm_cluster")
def test_a_requeued_resident_job_resumes_from_its_last_round(tiny_setup, monkeypatch):
    # Round sampling lasts >= 4 s (a slow reward) until the requeue; once round 0's checkpoint is
    # written, the job is requeued (scontrol requeue) while it waits for round 1: its second start
    # resumes from checkpoint-1 and trains rounds 1 to 5; the flow follows the same job throughout (six
    # rounds, one node, one sbatch job). The rounds sampled after the requeue are quick (they are
    # sampled in this process, which reads the reward's delay at each call).
    import os
    import subprocess
    import threading

    from posttrain.cluster import SlurmConfig
    from posttrain.pipeline.blocks import SlurmCluster
    from posttrain.pipeline.flows.grpo import grpo
    from tests.cluster.test_cluster_slurm_real import _requeue_and_release, _scontrol_show
    from tests.pipeline.flaky import SLOW_SECONDS_ENV
    from tests.runs.test_training_slurm_2nodes import two_node_cluster

    monkeypatch.setenv(SLOW_SECONDS_ENV, "4")
    block = "flows-grpo-resident-requeue"
    SlurmCluster(settings=SlurmConfig(**{**two_node_cluster(tiny_setup.root), "nodes": 1})).save(block, overwrite=True)
    run = "flows-resident-requeue"
    params = tiny_setup.grpo_settings(run, rounds=6, prompts_per_round=1, cluster=f"posttrain-slurm-cluster/{block}",
                                      reward_funcs=["tests.pipeline.flaky:slow_reward"])
    requeued: dict = {}

    def requeue_after_round_0() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            found = list(tiny_setup.shared_dir.glob(f"runs/{run}-*/policy/checkpoint-1/trainer_state.json"))
            if found:
                run_dir = found[0].parents[2]
                job = JobRecord.model_validate_json((run_dir / "training-job.json").read_text())
                requeued["mtime"] = found[0].stat().st_mtime_ns
                requeued["had_2"] = (run_dir / "policy" / "checkpoint-2").exists()
                _requeue_and_release(job.job_id)
                requeued["job"] = job
                os.environ[SLOW_SECONDS_ENV] = "0"  # monkeypatch puts the variable back at teardown
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=requeue_after_round_0, daemon=True)
    watcher.start()
    state = grpo(**params, return_state=True)
    watcher.join(timeout=60)
    assert state.is_completed(), state.message
    assert "job" in requeued and not requeued["had_2"], requeued  # requeued mid-run, before round 1 trained
    report = state.result()
    run_dir = tiny_setup.shared_dir / "runs" / report.run_name
    job = requeued["job"]
    assert "Restarts=1" in _scontrol_show(job.job_id)
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "--name", job.name, "-o", "JobID,State"],
                           capture_output=True, text=True, timeout=20).stdout.split()
    assert sacct == [f"{job.job_id}|COMPLETED"], sacct  # the same one job
    assert checkpoints(run_dir) == [f"checkpoint-{n}" for n in range(1, 7)]
    assert (run_dir / "policy" / "checkpoint-1" / "trainer_state.json").stat().st_mtime_ns == requeued["mtime"]
    (results,) = sorted((run_dir / "policy" / ".posttrain").glob("*.results.jsonl"))
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    assert lines[-1]["completed"] and lines[-1]["rounds_done"] == 6, lines
    assert lines[-1]["resumed_from"] == str(run_dir / "policy" / "checkpoint-1"), lines
    assert tiny_setup.served_identity() == report.final_snapshot
    # The run's goodput (issue 23: "a run with a requeue shows the lost time"): it adds up to the flow run's
    # wall time, and the requeue's restart gap is counted as lost, not as training.
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    from tests.pipeline.run_events import assert_goodput_adds_up

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]}))
    seconds = assert_goodput_adds_up(flow_run_id, next(a for a in found if a.key == f"{run}-goodput"))
    assert seconds["lost"] > 0 and seconds["training"] > 0, seconds
