"""posttrain's overrides of submitit's private methods, gathered in one place.

They depend on submitit internals, so pyproject.toml pins submitit's exact version; on an
upgrade, check each of these against the new release (and run the Slurm tests):

- ``SlurmInfoWatcher._make_command``: the sacct command line, run here through our shell (ssh).
- ``SlurmExecutor._internal_process_submissions``: submission; we stage the job folder through
  the shell and call sbatch ourselves, using ``DelayedSubmission.set_timeout``/``dump``,
  ``_make_submission_file_text``, ``_submitit_command_str`` and ``_num_tasks``.
- ``SlurmJob.watcher``: the class attribute through which every job polls its state.
- ``submitit.core.utils.JobPaths``: where a job's logs and result pickle are.
- ``LocalExecutor._submit_command`` (``SessionLocalExecutor``): a copy of
  ``submitit.local.local.start_controller`` that starts the controller in a session of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmInfoWatcher

from posttrain.cluster.errors import SubmissionError
from posttrain.cluster.shell import LocalShell

# (sbatch script, pickled job, the job's --comment) -> Slurm job id
SubmitJob = Callable[[str, bytes, str], str]


class ShellWatcher(SlurmInfoWatcher):
    """submitit's sacct poller, through the backend's shell (ssh when ssh_host is set)."""

    def __init__(self, shell: LocalShell, delay_s: float) -> None:
        super().__init__(delay_s=int(max(1, delay_s)))
        self.shell = shell

    def _make_command(self) -> list[str] | None:
        command = super()._make_command()
        return None if command is None else self.shell.argv(command)


def job_class(watcher: ShellWatcher) -> type[submitit.SlurmJob]:
    """A ``SlurmJob`` class whose jobs poll through ``watcher``."""
    return type("PosttrainSlurmJob", (submitit.SlurmJob,), {"watcher": watcher})


def job_paths(job_dir: str, job_id: str, rank: int) -> submitit_utils.JobPaths:
    """Where submitit puts task ``rank``'s log (``.stdout``) and result (``.result_pickle``)."""
    return submitit_utils.JobPaths(job_dir, job_id, rank)


class StagingExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose submission hands the sbatch script and the pickled job to
    ``submit_job`` (which stages them and runs sbatch), instead of writing locally and calling
    sbatch itself."""

    def __init__(
        self, folder: str, *, python: str, max_num_timeout: int, job_class: type[submitit.SlurmJob],
        submit_job: SubmitJob,
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        self.job_class = job_class
        self.submit_job = submit_job

    @classmethod
    def affinity(cls) -> int:
        return 2  # srun is on the cluster, possibly behind ssh; never look for it here

    def sbatch_text(self) -> str:
        """The sbatch script submitit writes for the current parameters."""
        return self._make_submission_file_text(self._submitit_command_str, "")

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        if len(delayed_submissions) != 1:
            raise SubmissionError("the Slurm backend submits one job at a time")
        (delayed,) = delayed_submissions
        delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
        with tempfile.TemporaryDirectory() as tmp:
            pickle_path = Path(tmp) / "job.pkl"
            delayed.dump(pickle_path)
            pickled = pickle_path.read_bytes()
        job_id = self.submit_job(self.sbatch_text(), pickled, self.parameters["comment"])
        return [self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))]


class SessionLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor, with its controller started in a new session (its pid is the
    process group id of the whole job). Copies ``submitit.local.local.start_controller`` (no
    ``setup`` support), adding ``start_new_session`` and ``extra_env`` (variables the job gets in
    its environment, never on a command line: the job's secrets)."""

    def __init__(self, *args: Any, extra_env: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra_env = dict(extra_env or {})

    def _submit_command(self, command: str) -> submitit.local.local.LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        gpus = range(self.parameters.get("gpus_per_node", 0))
        env = {**os.environ, **self.extra_env}
        env.update(
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout", False) else "",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(str(k) for k in gpus),
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        process = subprocess.Popen([sys.executable, "-m", "submitit.local._local", str(self.folder)], env=env,
                                   start_new_session=True)
        return submitit.local.local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                             tasks=list(range(ntasks)))
