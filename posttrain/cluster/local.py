"""Local backend: the same ``JobSpec`` run on this machine by submitit's ``LocalExecutor``
(one task; a Checkpointable is restarted after its timeout signal, up to ``max_requeues``).

Each job runs in a session (and process group) of its own, led by submitit's controller: the
job outlives the process that submitted it (a retried pipeline run follows it again), and
whichever process knows the group id can tell whether it still runs or stop all of it
(``group_alive``, ``stop_group``)."""

from __future__ import annotations

import os
import pickle
import shlex
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import submitit

from posttrain.cluster import checks, job_secrets
from posttrain.cluster.command_job import CommandJob
from posttrain.cluster.config import RESERVED_ENV, RESERVED_PREFIXES, LocalConfig
from posttrain.cluster.errors import ConfigError
from posttrain.cluster.handle import DryRunHandle, HandleBase, log_excerpt
from posttrain.cluster.launch import Topology, launch_line
from posttrain.cluster.spec import JobSpec, JobState
from posttrain.cluster.submitit_compat import SessionLocalExecutor


class LocalBackend:
    def __init__(self, config: LocalConfig | None = None) -> None:
        self.config = config or LocalConfig()

    def job_dir(self, spec: JobSpec) -> str:
        return os.path.join(os.path.expanduser(self.config.folder), f"{spec.name}-{spec.run_id}")

    def check(self, spec: JobSpec) -> JobSpec:
        spec = spec.with_job_dir(self.job_dir(spec))
        try:
            checks.env_names(spec.env, RESERVED_ENV, RESERVED_PREFIXES)
            checks.no_plain_secrets(spec.env, "the cluster's secrets")
        except ValueError as e:
            raise ConfigError("job.env", str(e)) from None
        clash = sorted(set(spec.env) & set(self.config.secrets))
        if clash:
            raise ConfigError("job.env", f"{', '.join(clash)} also listed in cluster.secrets")
        if spec.function is not None and spec.workdir is not None:
            raise ConfigError("job.workdir", "a local callable runs in the submitter's working directory")
        if spec.command is not None:
            try:
                self.node_command(spec)
            except ValueError as e:
                raise ConfigError("job.command", str(e)) from None
        return spec

    def node_command(self, spec: JobSpec) -> str:
        assert spec.command is not None
        cfg = self.config
        line = launch_line(cfg.launcher, cfg.launcher_args, spec.command, Topology(1, cfg.gpus, node_rank="0"))
        prefix = [f"cd {shlex.quote(spec.workdir or self.job_dir(spec))}", *cfg.setup_commands]
        return " && ".join([*prefix, line])

    def environment(self, spec: JobSpec) -> dict[str, str]:
        cfg = self.config
        # python, torchrun and accelerate resolve to the submitter's environment first
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
        return {
            "PATH": path,
            **cfg.env,
            **spec.env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "POSTTRAIN_JOB_DIR": self.job_dir(spec),
        }

    def render(self, spec: JobSpec) -> str:
        spec = self.check(spec)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.environment(spec).items()))
        what = self.node_command(spec) if spec.command is not None else f"python callable {spec.function!r}"
        lines = [
            f"# posttrain dry run: local job {spec.name} (run {spec.run_id}); nothing was started.",
            f"# job folder: {self.job_dir(spec)}",
            f"# environment: {env}",
            *([f"# secrets: {job_secrets.describe(self.config.secrets)}"] if self.config.secrets else []),
            what,
        ]
        for name, text in sorted(spec.files.items()):
            lines += [f"# ---- {self.job_dir(spec)}/{name}", text.rstrip("\n")]
        return "\n".join(lines) + "\n"

    def submit(self, spec: JobSpec) -> LocalHandle | DryRunHandle:
        if self.config.dry_run:
            text = self.render(spec)
            print(text, end="")
            return DryRunHandle(text)
        spec = self.check(spec)
        cfg = self.config
        secret_values = job_secrets.read(cfg.secrets)  # before anything is written
        job_dir = Path(self.job_dir(spec))
        job_dir.mkdir(parents=True, exist_ok=False)
        for name, text in spec.files.items():
            (job_dir / name).write_text(text)
        # `env` execs python, so submitit's signals reach it directly (a shell would be in between)
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(self.environment(spec).items()))
        python = f"env {env} {shlex.quote(sys.executable)}"
        # the secrets go in the controller's environment, never on a command line
        ex = SessionLocalExecutor(folder=job_dir, max_num_timeout=cfg.max_requeues, python=python,
                                  extra_env=secret_values)
        ex.update_parameters(
            timeout_min=(cfg.time_limit_s or 365 * 86400) / 60,
            gpus_per_node=cfg.gpus,
            tasks_per_node=1,
            signal_delay_s=cfg.signal_delay_s,
            stderr_to_stdout=True,
        )
        if spec.command is not None:
            job = ex.submit(CommandJob(self.node_command(spec), grace_s=max(1, cfg.signal_delay_s // 2)))
        else:
            job = ex.submit(spec.function, *spec.args, **spec.kwargs)
        return LocalHandle(job, poll_s=cfg.poll_interval_s)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # after the command name: state, ppid, pgrp
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` (a local job) still has a live process."""
    return bool(group_members(pgid))


def stop_group(pgid: int, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process of group ``pgid``, then SIGKILL what is left after ``grace_s``;
    returns the processes it found. Refuses the caller's own group."""
    if pgid == os.getpgrp():
        raise ValueError(f"process group {pgid} is this process's own; a local job has a group of its own")
    found = group_members(pgid)
    if not found:
        return []
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return found
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # the command name (field 2) may hold spaces; the parent pid follows its ")"
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


class LocalHandle(HandleBase):
    def __init__(self, job: submitit.local.local.LocalJob, poll_s: float) -> None:
        self._job = job
        self.poll_s = poll_s
        self.job_id = job.job_id
        self.log_path = str(job.paths.stdout)
        self.pgid = int(job.job_id)  # the controller leads the job's own process group
        self._cancelled = False

    def _outcome(self) -> tuple[str, Any] | None:
        try:
            return pickle.loads(Path(self._job.paths.result_pickle).read_bytes())
        except FileNotFoundError:
            return None

    def raw_state(self) -> str:
        return self._job.state

    def state(self) -> JobState:
        raw = self._job.state
        if raw == "RUNNING":
            return JobState.RUNNING
        outcome = self._outcome()
        if outcome is not None and outcome[0] == "success":
            return JobState.COMPLETED
        if self._cancelled:
            return JobState.CANCELLED
        if outcome is not None:
            return JobState.FAILED
        return JobState.FAILED if raw in ("FINISHED", "INTERRUPTED") else JobState.UNKNOWN

    def done(self) -> bool:
        return self._job.state != "RUNNING"

    def tail_log(self, n: int = 40, rank: int | None = None) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except FileNotFoundError:
            return ""

    def cancel(self) -> None:
        """Stop every process of the job (its process group): TERM, then KILL after the grace."""
        self._cancelled = True
        stop_group(self.pgid)
        self._job.get_info()  # reaps the controller

    def interrupt(self) -> None:
        """Send the timeout/preemption signal (USR2) to the job's task, as Slurm would: a
        Checkpointable checkpoints and submitit's local controller restarts it."""
        # submitit's LocalJob._interrupt signals the controller, which has no USR2 handler and dies
        for pid in _children(int(self.job_id)):
            os.kill(pid, signal.SIGUSR2)

    def failure_reason(self) -> str | None:
        outcome = self._outcome()
        if outcome is not None and outcome[0] == "success":
            return None
        if self._cancelled:
            return "cancelled"
        head = f"ended {self._job.state}"
        if outcome is not None:
            trace = str(outcome[1]).strip().splitlines()
            head += f": {trace[-1] if trace else ''}"
        return f"{head}\nlast lines of {self.log_path}:\n{log_excerpt(self.tail_log(200))}"

    def _result(self) -> Any:
        outcome = self._outcome()
        return None if outcome is None else outcome[1]


