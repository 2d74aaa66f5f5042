"""``CommandJob``: a shell line run by submitit on every node, requeued like any Checkpointable.

The command (a trainer) resumes from its own checkpoints, so a requeue restarts the same line.
Slurm sends its timeout/preemption signal (USR2) to every process of the job; the command starts
with USR2 ignored (unless it installs a handler), and on rank 0 submitit's handler calls
``checkpoint``, which sends the command SIGTERM and gives it ``grace_s`` to save before the job
is requeued. Other ranks' commands end when Slurm requeues the job.
"""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import submitit


class CommandFailed(RuntimeError):
    """The command exited with a non-zero status."""


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: The shell that runs a job's line (its setup_commands, then the launcher), by its path: the job's
#: PATH need not name it.
JOB_SHELL = "/bin/bash"


class CommandJob(submitit.helpers.Checkpointable):
    def __init__(self, line: str, grace_s: float = 60.0) -> None:
        self.line = line
        self.grace_s = grace_s
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> int:
        # Same process group as this task: Slurm's process tracking then ends it with the step.
        self._proc = subprocess.Popen([JOB_SHELL, "-c", f"trap '' USR2\n{self.line}"])
        try:
            # Poll rather than wait(): submitit's signal handler calls checkpoint(), which must
            # reap the process, and Popen.wait() holds a lock a nested wait would deadlock on.
            while (code := self._proc.poll()) is None:
                time.sleep(0.2)
        finally:
            _stop(self._proc, self.grace_s)  # on SystemExit from submitit's requeue handler
        if code != 0:
            raise CommandFailed(f"command exited with status {code}: {self.line}")
        return 0

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        if self._proc is not None:
            _stop(self._proc, self.grace_s)
        return submitit.helpers.DelayedSubmission(CommandJob(self.line, self.grace_s))

    def __getstate__(self) -> dict[str, Any]:
        return {"line": self.line, "grace_s": self.grace_s, "_proc": None}

    def __repr__(self) -> str:
        return f"CommandJob({self.line!r})"
