"""Slurm backend (CoreWeave SUNK or any Slurm with pyxis/enroot), through submitit.

Layout of a job folder ``<jobs_dir>/<name>-<run_id>/`` on shared storage:

- ``sbatch.sh``: submitit's sbatch script; its setup section exports ``MASTER_ADDR`` (see
  ``posttrain.cluster.rendezvous``), ``MASTER_PORT`` and ``POSTTRAIN_JOB_DIR``; srun starts one task per
  node, in the container when ``image`` is set.
- ``node.sh``: run by each task (inside the container): sources ``env_file`` and ``secrets.env``,
  then exports ``env`` (so ``env`` wins), runs ``setup_commands`` and execs submitit's Python entry point.
- ``secrets.env`` (with ``secrets:``): the listed variables' values, read from the submitting
  environment at submit time and written with mode 0600 before sbatch; no rendered text shows them.
- ``<job id>_submitted.pkl``: the pickled callable; a command job is a ``CommandJob`` running the
  launcher line (torchrun/accelerate/python) on each node.
- ``<job id>_<rank>_log.out``: each node's log (stdout and stderr).

With ``ssh_host`` every Slurm command and file transfer goes through ``ssh <host>``.
"""

from __future__ import annotations

import math
import pickle
import shlex
import subprocess
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import submitit

from posttrain import redact
from posttrain.cluster import checks, job_secrets, rendezvous
from posttrain.cluster.command_job import CommandJob
from posttrain.cluster.config import RESERVED_ENV, SLURM_RESERVED_PREFIXES, SlurmConfig
from posttrain.cluster.errors import ConfigError, SubmissionError
from posttrain.cluster.handle import DryRunHandle, HandleBase, log_excerpt
from posttrain.cluster.launch import Topology, launch_line
from posttrain.cluster.shell import LocalShell, SshShell
from posttrain.cluster.spec import JobSpec, JobState
from posttrain.cluster.submitit_compat import ShellWatcher, StagingExecutor, job_class, job_paths

SBATCH_FILE = "sbatch.sh"
NODE_FILE = "node.sh"
PENDING_PICKLE = "pending_submitted.pkl"
CONTAINER_ENV = ("MASTER_ADDR", "MASTER_PORT", "POSTTRAIN_JOB_DIR", "SUBMITIT_EXECUTOR")
SUBMIT_RETRIES = 3
# sbatch errors after which trying again is safe (the job is first looked up by its comment).
TRANSIENT_SBATCH_ERRORS = (
    "socket timed out",
    "unable to contact slurm controller",
    "temporarily unavailable",
    "temporarily unable",
    "connection refused",
    "connection timed out",
    "transport endpoint",
)

_STATES = {
    "PENDING": JobState.PENDING, "REQUEUED": JobState.PENDING, "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING, "CONFIGURING": JobState.PENDING, "RESV_DEL_HOLD": JobState.PENDING,
    "SUSPENDED": JobState.PENDING, "PREEMPTED": JobState.PENDING, "UNKNOWN": JobState.PENDING,
    "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING, "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING, "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "FAILED": JobState.FAILED, "NODE_FAIL": JobState.FAILED, "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED, "DEADLINE": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED, "REVOKED": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
}  # fmt: skip


def slurm_state(raw: str) -> JobState:
    """``CANCELLED by 0`` -> CANCELLED, ``OUT_OF_MEMORY`` -> FAILED, ..."""
    word = raw.split()[0].rstrip("+") if raw.strip() else "UNKNOWN"
    return _STATES.get(word, JobState.UNKNOWN)


class SlurmBackend:
    """Submits ``JobSpec``s to Slurm; see the module docstring for what lands where."""

    def __init__(self, config: SlurmConfig, shell: LocalShell | None = None) -> None:
        self.config = config
        self.shell = shell or (SshShell(config.ssh_host) if config.ssh_host else LocalShell())
        self.job_class = job_class(ShellWatcher(self.shell, config.poll_interval_s))

    # ------------------------------------------------------------------ rendering
    def job_dir(self, spec: JobSpec) -> str:
        return f"{self.config.jobs_dir}/{spec.name}-{spec.run_id}"

    def check(self, spec: JobSpec) -> JobSpec:
        """The spec with ``{job_dir}`` resolved, checked against this cluster; ``ConfigError``."""
        spec = spec.with_job_dir(self.job_dir(spec))
        cfg = self.config
        for field in ("workdir", "output_dir"):
            value = getattr(spec, field)
            if value is None:
                continue
            try:
                value = checks.absolute_path(value)
            except ValueError as e:
                raise ConfigError(f"job.{field}", str(e)) from None
            if not checks.is_under(value, cfg.shared_roots):
                raise ConfigError(
                    f"job.{field}",
                    f"{value} is not on shared storage (under shared_dir {cfg.shared_dir} or mounts); "
                    "the nodes would not see it",
                )
        try:
            checks.env_names(spec.env, RESERVED_ENV, SLURM_RESERVED_PREFIXES)
            checks.no_plain_secrets(spec.env, "the cluster's secrets (or its env_file)")
        except ValueError as e:
            raise ConfigError("job.env", str(e)) from None
        clash = sorted(k for k in set(spec.env) & set(cfg.env) if spec.env[k] != cfg.env[k])
        if clash:
            raise ConfigError("job.env", f"{', '.join(clash)} also set, differently, in cluster.env")
        clash = sorted(set(spec.env) & set(cfg.secrets))
        if clash:
            raise ConfigError("job.env", f"{', '.join(clash)} also listed in cluster.secrets")
        if cfg.secrets and job_secrets.SECRETS_FILE in spec.files:
            raise ConfigError("job.files", f"{job_secrets.SECRETS_FILE} is the job's secrets file; rename it")
        if spec.command is not None:
            try:
                self.node_command(spec)
            except ValueError as e:
                raise ConfigError("job.command", str(e)) from None
        return spec

    def node_command(self, spec: JobSpec) -> str:
        cfg = self.config
        assert spec.command is not None
        topo = Topology(cfg.nodes, cfg.gpus_per_node, node_rank="$SLURM_NODEID")
        return launch_line(cfg.launcher, cfg.launcher_args, spec.command, topo)

    def node_script(self, spec: JobSpec) -> str:
        cfg = self.config
        lines = [
            "#!/bin/bash",
            f"# posttrain job {spec.name} (run {spec.run_id}): srun runs this once per node,",
            "# inside the container when an image is set, before submitit's entry point.",
            "set -euo pipefail",
            f"readonly {' '.join(CONTAINER_ENV[:3])}",
        ]
        if cfg.env_file:
            lines += ["set -a", f"source {shlex.quote(cfg.env_file)}", "set +a"]
        if cfg.secrets:
            secrets_file = f"{self.job_dir(spec)}/{job_secrets.SECRETS_FILE}"
            lines += [f"# {', '.join(sorted(cfg.secrets))}: written at submit time (mode 0600), values never rendered"]
            lines += ["set -a", f"source {shlex.quote(secrets_file)}", "set +a"]
        env = {**cfg.env, **spec.env}
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
        lines += list(cfg.setup_commands)
        lines += ['exec "$@"', ""]
        return "\n".join(lines)

    def executor(self, spec: JobSpec, files: Mapping[str, bytes] | None = None) -> StagingExecutor:
        """submitit's executor for ``spec``; submitting stages ``files`` with the sbatch script."""
        cfg = self.config
        job_dir = self.job_dir(spec)
        workdir = spec.workdir or job_dir
        python = f"/bin/bash {shlex.quote(f'{job_dir}/{NODE_FILE}')} {shlex.quote(cfg.python)}"
        ex = StagingExecutor(
            job_dir, python=python, max_num_timeout=cfg.max_requeues, job_class=self.job_class,
            submit_job=partial(self.stage_and_sbatch, job_dir, dict(files or {})),
        )
        setup = ["set -euo pipefail", *rendezvous.slurm_setup(cfg), f"export MASTER_PORT={cfg.master_port}",
            f"export POSTTRAIN_JOB_DIR={shlex.quote(job_dir)}",
        ]
        srun_args = ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
        if cfg.image:
            mounts = ",".join(f"{p}:{p}" for p in cfg.shared_roots)
            srun_args += [
                f"--container-image={cfg.image}",
                f"--container-mounts={mounts}",
                f"--container-env={','.join(CONTAINER_ENV)}",
                f"--container-workdir={workdir}",
                "--no-container-mount-home",
            ]
        ex.update_parameters(
            job_name=spec.name,
            partition=cfg.partition,
            account=cfg.account,
            qos=cfg.qos,
            nodes=cfg.nodes,
            ntasks_per_node=1,
            gpus_per_node=cfg.gpus_per_node or None,
            cpus_per_task=cfg.cpus_per_task,
            mem=cfg.memory,
            time=math.ceil((cfg.time_limit_s or 0) / 60),
            exclusive=True if cfg.exclusive else None,
            signal_delay_s=cfg.signal_delay_s,
            stderr_to_stdout=True,
            comment=f"posttrain:{spec.name}-{spec.run_id}",
            wckey=None,
            setup=setup,
            srun_args=srun_args,
            additional_parameters={"chdir": workdir, "requeue": True},
        )
        return ex

    def render(self, spec: JobSpec) -> str:
        spec = self.check(spec)
        ex = self.executor(spec)
        job_dir = str(ex.folder)
        sbatch = ex.sbatch_text()
        srun = next(line for line in sbatch.splitlines() if line.startswith("srun "))
        if spec.command is not None:
            node_command = self.node_command(spec)
        else:
            node_command = f"# python callable, once per node: {_describe_callable(spec)}"
        submit = shlex.join(self.shell.argv(["sbatch", "--parsable", f"{job_dir}/{SBATCH_FILE}"]))
        parts = [
            f"# posttrain dry run: Slurm job {spec.name} (run {spec.run_id}); nothing was submitted.",
            f"# job folder: {job_dir}",
            f"# submit: {submit}",
            rendezvous.slurm_note(self.config),
            "",
            f"# ---- {job_dir}/{SBATCH_FILE}",
            sbatch.rstrip("\n"),
            "",
            f"# ---- {job_dir}/{NODE_FILE}",
            self.node_script(spec).rstrip("\n"),
            "",
            "# ---- srun line (in sbatch.sh)",
            srun,
            "",
            "# ---- node command (each task runs it under submitit)",
            node_command,
        ]
        if self.config.secrets:
            parts += ["", f"# ---- {job_dir}/{job_secrets.SECRETS_FILE} (mode 0600, written at submit time)",
                      f"# secrets: {job_secrets.describe(self.config.secrets)}"]
        for name, text in sorted(spec.files.items()):
            parts += ["", f"# ---- {job_dir}/{name}", text.rstrip("\n")]
        return "\n".join(parts) + "\n"

    # ------------------------------------------------------------------ submission
    def submit(self, spec: JobSpec) -> SlurmHandle | DryRunHandle:
        if self.config.dry_run:
            text = self.render(spec)
            print(text, end="")
            return DryRunHandle(text)
        spec = self.check(spec)
        secret_values = job_secrets.read(self.config.secrets)  # before anything is written
        files = {NODE_FILE: self.node_script(spec).encode()}
        if self.config.secrets:
            # staged with mode 0600 in a 0700 job folder (shell.stage), before sbatch runs
            files[job_secrets.SECRETS_FILE] = job_secrets.shell_file(secret_values).encode()
        files.update({name: text.encode() for name, text in spec.files.items()})
        ex = self.executor(spec, files)
        if spec.command is not None:
            job = ex.submit(CommandJob(self.node_command(spec), grace_s=max(5, self.config.signal_delay_s - 30)))
        else:
            job = ex.submit(spec.function, *spec.args, **spec.kwargs)
        return SlurmHandle(job, self.shell, nodes=self.config.nodes, poll_s=self.config.poll_interval_s)

    def attach(self, job_id: str, job_dir: str) -> SlurmHandle:
        """A handle on a job submitted earlier (by id and job folder), e.g. after a restart."""
        job = self.job_class(folder=job_dir, job_id=job_id, tasks=list(range(self.config.nodes)))
        return SlurmHandle(job, self.shell, nodes=self.config.nodes, poll_s=self.config.poll_interval_s)

    def stage_and_sbatch(self, job_dir: str, files: dict[str, bytes], script: str, pickled: bytes, comment: str) -> str:
        """Write the job folder (sbatch script, ``files``, pickled job), submit it, and name the
        pickle after the job id."""
        files = {SBATCH_FILE: script.encode(), **files, PENDING_PICKLE: pickled}
        try:
            self.shell.stage(job_dir, files)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SubmissionError(redact.scrub(f"could not write the job folder {job_dir}: {_stderr(e)}")) from None
        job_id = self._sbatch(f"{job_dir}/{SBATCH_FILE}", comment)
        # submitit's entry point waits up to 60 s for this name to appear
        self.shell.rename(f"{job_dir}/{PENDING_PICKLE}", f"{job_dir}/{job_id}_submitted.pkl")
        return job_id

    def _sbatch(self, script: str, comment: str) -> str:
        for attempt in range(SUBMIT_RETRIES + 1):
            result = self.shell.run(["sbatch", "--parsable", script], check=False)
            out = result.stdout.decode().strip()
            if result.returncode == 0:
                job_id = out.split(";")[0]
                if job_id.isdigit():
                    return job_id
                raise SubmissionError(f"sbatch answered {out!r}, not a job id; check squeue before resubmitting")
            error = result.stderr.decode().strip() or out
            # the controller may have accepted the job before the error: never submit it twice
            found = self._find_by_comment(comment)
            if found:
                return found
            transient = result.returncode == 255 or any(t in error.lower() for t in TRANSIENT_SBATCH_ERRORS)
            if not transient or attempt == SUBMIT_RETRIES:
                raise SubmissionError(redact.scrub(f"sbatch failed (exit {result.returncode}): {error}"))
            time.sleep(2.0 * 2**attempt)
        raise AssertionError("unreachable")

    def _find_by_comment(self, comment: str) -> str | None:
        result = self.shell.run(["squeue", "-h", "-o", "%i|%k"], check=False)
        if result.returncode != 0:
            return None
        for line in result.stdout.decode().splitlines():
            job_id, _, job_comment = line.partition("|")
            if job_comment.strip() == comment:
                return job_id.strip()
        return None


def _describe_callable(spec: JobSpec) -> str:
    fn = spec.function
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}(*{len(spec.args)} args, **{sorted(spec.kwargs)})"


def _stderr(e: Exception) -> str:
    stderr = getattr(e, "stderr", None)
    return stderr.decode(errors="replace").strip() if isinstance(stderr, bytes) and stderr else str(e)


class SlurmHandle(HandleBase):
    """A submitted Slurm job: sacct state through submitit's watcher, logs and results from the
    job folder (over ssh when the backend uses it)."""

    def __init__(self, job: submitit.SlurmJob, shell: LocalShell, nodes: int, poll_s: float) -> None:
        self._job = job
        self.shell = shell
        self.nodes = nodes
        self.poll_s = poll_s
        self.job_id = job.job_id
        self.job_dir = str(job.paths.folder)
        self.log_path = self.log_path_of(0)

    def log_path_of(self, rank: int) -> str:
        return str(job_paths(self.job_dir, self.job_id, rank).stdout)

    def _result_path(self, rank: int = 0) -> str:
        return str(job_paths(self.job_dir, self.job_id, rank).result_pickle)

    def _outcome(self) -> tuple[str, Any] | None:
        data = self.shell.read_bytes(self._result_path(0))
        return None if data is None else pickle.loads(data)

    def raw_state(self, force: bool = False) -> str:
        return self._job.watcher.get_state(self.job_id, mode="force" if force else "standard")

    def state(self) -> JobState:
        """sacct's state. The result file alone proves nothing: a requeued job keeps the one its
        interrupted run wrote; it counts only when sacct has nothing on the job (no accounting)."""
        raw = self.raw_state()
        if raw == "UNKNOWN":
            if self._outcome() is not None:  # the result file: sacct lags it by about a second
                raw = self.raw_state(force=True)
            if raw == "UNKNOWN" and (outcome := self._outcome()) is not None:
                return JobState.COMPLETED if outcome[0] == "success" else JobState.FAILED
        elif slurm_state(raw) == JobState.RUNNING and self._outcome() is not None:
            raw = self.raw_state(force=True)
        return slurm_state(raw)

    def done(self) -> bool:
        return self.state().terminal

    def tail_log(self, n: int = 40, rank: int | None = None) -> str:
        ranks = range(self.nodes) if rank is None else [rank]
        parts = []
        for r in ranks:
            result = self.shell.run(["tail", "-n", str(n), self.log_path_of(r)], check=False)
            text = result.stdout.decode(errors="replace")
            parts.append(text if rank is not None or self.nodes == 1 else f"==> rank {r} <==\n{text}")
        return "\n".join(parts)

    def cancel(self) -> None:
        self.shell.run(["scancel", self.job_id], check=False)
        self._job.watcher.update()

    def failure_reason(self) -> str | None:
        outcome = self._outcome()
        if outcome is not None and outcome[0] == "success":
            return None
        result = self.shell.run(
            ["sacct", "-X", "-n", "-P", "-o", "State,ExitCode,Reason", "-j", self.job_id], check=False
        )
        rows = [r for r in result.stdout.decode().splitlines() if r.strip()]
        state, exit_code, reason = (rows[-1].split("|") + ["", "", ""])[:3] if rows else ("UNKNOWN", "", "")
        text = f"Slurm state {state}, exit code {exit_code}"
        if reason not in ("", "None"):
            text += f", reason {reason}"
        if outcome is not None:  # the exception raised in the job, last line of its traceback
            trace = str(outcome[1]).strip().splitlines()
            text += "\n" + (trace[-1] if trace else "")
        text += f"\nlast lines of {self.log_path}:\n" + log_excerpt(self.tail_log(200, rank=0))
        return text

    def _result(self) -> Any:
        outcome = self._outcome()
        return None if outcome is None else outcome[1]
