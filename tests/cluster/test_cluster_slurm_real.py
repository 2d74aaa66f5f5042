"""The Slurm backend against a real Slurm (started by the slurm_cluster fixture; two nodes on this host):
submit, poll, tail, cancel, requeue with resume from a checkpoint, and the ssh path."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.cluster import JobFailed, JobSpec, JobState, SlurmConfig
from posttrain.cluster.shell import SshShell
from posttrain.cluster.slurm import SlurmBackend
from posttrain.cluster.smoke import CountingJob

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    # one node: any local folder is "shared" between the submitter and the job
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "job.env").write_text("SMOKE_PROBE=from-env-file\nHF_TOKEN=hf_not_in_logs\n")
    return tmp_path


def _config(shared: Path, **change) -> SlurmConfig:
    return SlurmConfig(
        **{
            "shared_dir": str(shared),
            "image": None,
            "python": sys.executable,
            "nodes": 1,
            "gpus_per_node": 0,
            "memory": "500M",
            "exclusive": False,
            "time_limit": "10",
            "launcher": "python",
            "poll_interval_s": 1,
            **change,
        }
    )


def _step(state: Path) -> int:
    """The step a counting job wrote last (0 before its first)."""
    try:
        return json.loads(state.read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _wait_for_step(state: Path, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _step(state) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"{state} never reached step {step}")


def _starts(state: Path) -> list[dict]:
    return [json.loads(line) for line in Path(f"{state}.starts").read_text().splitlines()]


def _scontrol_show(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def _requeue_and_release(job_id: str) -> None:
    """`scontrol requeue`, then lift the ~120 s BeginTime hold Slurm puts on requeued jobs (not to
    `now`: a relaunch in the second of the requeue is killed with "credential revoked")."""
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    _release(job_id)


def _release(job_id: str) -> None:
    """Lift the BeginTime hold of a job just requeued (``_requeue_and_release``)."""
    deadline = time.monotonic() + 60
    while "Reason=BeginTime" not in _scontrol_show(job_id):
        assert time.monotonic() < deadline, _scontrol_show(job_id)
        time.sleep(0.2)
    time.sleep(1.1)
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+3"], check=True)


def test_submit_poll_and_tail(shared: Path, slurm_jobs: list) -> None:
    config = _config(shared, env_file=str(shared / "secrets" / "job.env"), env={"SMOKE_PROBE": "from-env"})
    state = shared / "count.json"
    handle = SlurmBackend(config).submit(JobSpec(name="count", function=CountingJob(), args=(3, str(state), 0.2)))
    slurm_jobs.append(handle)
    assert handle.job_id.isdigit()
    seen = set()
    while not handle.done():
        seen.add(handle.state())
        time.sleep(0.3)
    assert handle.state() == JobState.COMPLETED
    assert handle.result() == {"step": 3, "env_probe": "from-env"}  # env wins over env_file
    assert seen <= {JobState.PENDING, JobState.RUNNING}
    log = handle.tail_log(20)
    assert "step 3" in log and "hf_not_in_logs" not in log
    assert Path(handle.log_path).exists() and handle.log_path.endswith(f"{handle.job_id}_0_log.out")
    again = SlurmBackend(config).attach(handle.job_id, handle.job_dir)
    assert again.state() == JobState.COMPLETED and again.result()["step"] == 3


def test_torchrun_under_slurm(shared: Path, slurm_jobs: list) -> None:
    # the torchrun line with MASTER_ADDR from the first node's NodeAddr and the node rank from Slurm
    spec = JobSpec(name="ddp", command=[sys.executable, "-m", "posttrain.cluster.smoke", "--all-reduce"])
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"  # torchrun of this environment
    config = _config(shared, launcher="torchrun", gpus_per_node=0, env={"PATH": path})
    handle = SlurmBackend(config).submit(spec)
    slurm_jobs.append(handle)
    assert handle.wait(timeout_s=120) == JobState.COMPLETED, handle.failure_reason()
    assert "rank 0 of 1" in handle.tail_log(50)


@pytest.mark.usefixtures("slurm_cluster_2nodes")
def test_torchrun_across_two_nodes_meets_at_the_first_nodes_address(shared: Path, slurm_jobs: list) -> None:
    """Two slurmd on this host (n1, n2): their names do not resolve, their NodeAddr does."""
    spec = JobSpec(name="ddp2", command=[sys.executable, "-m", "posttrain.cluster.smoke", "--all-reduce"])
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = _config(shared, launcher="torchrun", gpus_per_node=0, nodes=2, master_port=port, env={"PATH": path})
    handle = SlurmBackend(config).submit(spec)
    slurm_jobs.append(handle)
    assert handle.wait(timeout_s=120) == JobState.COMPLETED, handle.failure_reason()
    assert "rank 0 of 2" in handle.tail_log(50, rank=0) and "rank 1 of 2" in handle.tail_log(50, rank=1)


def test_failing_command_reports_why(shared: Path, slurm_jobs: list) -> None:
    spec = JobSpec(
        name="fail",
        command=[sys.executable, "-m", "posttrain.cluster.smoke", "--steps", "5", "--fail-at", "1",
                 "--sleep", "0.1", "--state", "{job_dir}/state.json"],  # fmt: skip
    )
    handle = SlurmBackend(_config(shared)).submit(spec)
    slurm_jobs.append(handle)
    assert handle.wait(timeout_s=90) == JobState.FAILED
    reason = handle.failure_reason()
    assert "exited with status 3" in reason and "failing at step 1 as asked" in reason
    with pytest.raises(JobFailed):
        handle.result()


def test_cancel_when_the_caller_aborts(shared: Path, slurm_jobs: list) -> None:
    state = shared / "long.json"
    spec = JobSpec(name="long", function=CountingJob(), args=(1000, str(state), 0.2))
    handle = SlurmBackend(_config(shared)).submit(spec)
    slurm_jobs.append(handle)
    with pytest.raises(KeyboardInterrupt):
        with handle:
            _wait_for_step(state, 1)
            raise KeyboardInterrupt
    assert handle.wait(timeout_s=90) == JobState.CANCELLED
    assert "CANCELLED" in handle.failure_reason()


def test_requeued_jobs_resume_from_their_checkpoints(shared: Path, slurm_jobs: list) -> None:
    """A callable and a command, each requeued while it counts; both jobs at once, one CPU each (each
    alone waited for its own requeue hold and restart)."""
    specs = {
        "callable": JobSpec(name="resume", function=CountingJob(), args=(40, str(shared / "callable.json"), 0.25)),
        "command": JobSpec(
            name="resume-cmd",
            command=[sys.executable, "-m", "posttrain.cluster.smoke", "--steps", "40", "--sleep", "0.25",
                     "--state", str(shared / "command.json")],  # fmt: skip
        ),
    }
    backend = SlurmBackend(_config(shared, max_requeues=2))
    handles = {kind: backend.submit(spec) for kind, spec in specs.items()}
    slurm_jobs.extend(handles.values())
    requeued: list[str] = []  # each as soon as it counted to 3, so neither finishes before its requeue
    deadline = time.monotonic() + 60
    while len(requeued) < len(handles):
        for kind, handle in handles.items():
            if kind not in requeued and _step(shared / f"{kind}.json") >= 3:
                subprocess.run(["scontrol", "requeue", handle.job_id], check=True)
                requeued.append(kind)
        assert time.monotonic() < deadline, f"only {requeued} counted to 3 in 60 s"
        time.sleep(0.2)
    for handle in handles.values():
        _release(handle.job_id)
    for kind, handle in handles.items():
        state = shared / f"{kind}.json"
        assert handle.wait(timeout_s=120) == JobState.COMPLETED, kind
        first, second = _starts(state)
        assert first == {"resumed_from": 0, "slurm_restart_count": "0"}, kind
        assert 3 <= second["resumed_from"] < 40 and second["slurm_restart_count"] == "1", kind  # not from scratch
        assert json.loads(state.read_text())["step"] == 40, kind


def test_timeout_signal_checkpoints_the_command_and_requeues(shared: Path, slurm_jobs: list) -> None:
    """USR2 is what Slurm sends signal_delay_s before the time limit (and at preemption with a
    grace time): submitit calls CommandJob.checkpoint, which stops the command with SIGTERM,
    then requeues the job."""
    state = shared / "usr2.json"
    spec = JobSpec(
        name="usr2",
        command=[sys.executable, "-m", "posttrain.cluster.smoke", "--steps", "30", "--sleep", "0.25",
                 "--state", str(state)],  # fmt: skip
    )
    handle = SlurmBackend(_config(shared, signal_delay_s=10)).submit(spec)
    slurm_jobs.append(handle)
    _wait_for_step(state, 3)
    subprocess.run(["scancel", "--signal=USR2", handle.job_id], check=True)
    deadline = time.monotonic() + 60
    while "Reason=BeginTime" not in _scontrol_show(handle.job_id):
        assert time.monotonic() < deadline, _scontrol_show(handle.job_id)
        time.sleep(0.2)
    time.sleep(1.1)
    subprocess.run(["scontrol", "update", f"jobid={handle.job_id}", "StartTime=now+3"], check=True)
    assert handle.wait(timeout_s=120) == JobState.COMPLETED
    first, second = _starts(state)
    assert 3 <= second["resumed_from"] < 30
    log = handle.tail_log(400)
    assert "Calling checkpoint method" in log and "Requeued job" in log


def test_through_ssh(shared: Path, slurm_jobs: list, fake_ssh) -> None:
    ssh, ssh_log = fake_ssh
    config = _config(shared, ssh_host="sunk-login")
    backend = SlurmBackend(config, shell=SshShell("sunk-login", ssh=ssh))
    state = shared / "ssh.json"
    handle = backend.submit(JobSpec(name="via-ssh", function=CountingJob(), args=(2, str(state), 0.1)))
    slurm_jobs.append(handle)
    assert handle.result(timeout_s=90)["step"] == 2
    assert "step 2" in handle.tail_log(10)
    calls = ssh_log.read_text().splitlines()
    assert all(line.startswith("sunk-login ") for line in calls)
    for expected in ("sh -c 'umask 077", "sbatch --parsable ", "mv -- ", "sacct -o JobID,State", "cat ", "tail -n 10"):
        assert any(expected in line for line in calls), expected
