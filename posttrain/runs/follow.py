"""Submit a training run and follow it: job state, then each complete checkpoint, in step order.

    from posttrain.runs.job import load_training_settings
    from posttrain.runs.follow import run_and_watch

    config = load_training_settings("nightly.yaml", backend="slurm")
    for checkpoint in run_and_watch(config, on_submit=lambda run: print(run.job_id, run.log_path)):
        print(checkpoint.step, checkpoint.path)   # ends when the job is done and every checkpoint was seen

``run_and_watch`` owns the job: leaving the loop early (an exception, Ctrl-C, ``break``) cancels it.
``submit_training`` returns a ``TrainingRun`` for callers that want to keep the job running
after they stop watching. No Prefect, no torch: the trainer runs on the backend.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from posttrain.cluster import Backend, JobFailed, JobHandle, JobSpec, JobState, open_backend
from posttrain.runs.job import TrainingSettings, read_results, training_job_spec
from posttrain.runs.watch import SkippedCheckpoint, watch_checkpoints
from posttrain.trainer.checkpoints import CheckpointInfo
from posttrain.trainer.config import TrainingResult

log = logging.getLogger(__name__)

CURSOR_DIR = "~/.cache/posttrain/watch"
LOG_TAIL_LINES = 40


class TrainingFailed(JobFailed):
    """The training job ended other than COMPLETED; ``reason`` holds the scheduler's reason and
    the last lines of the job's log."""


class TrainingRun:
    """A training run this process submitted: its settings, the cluster's ``JobSpec`` and ``JobHandle``,
    where this machine sees its checkpoints, and the results of its attempts."""

    def __init__(self, config: TrainingSettings, spec: JobSpec, handle: JobHandle) -> None:
        self.config = config
        self.spec = spec
        self.handle = handle

    @property
    def job_id(self) -> str:
        return self.handle.job_id

    @property
    def log_path(self) -> str:
        return self.handle.log_path

    @property
    def watch_dir(self) -> Path | None:
        """trainer.output_dir as this machine sees it; None when checkpoints cannot be watched."""
        return self.config.local_output_dir

    @property
    def pgid(self) -> int | None:
        """The process group of the whole job, on the local backend (None elsewhere)."""
        return getattr(self.handle, "pgid", None)

    def state(self) -> JobState:
        return self.handle.state()

    def cancel(self) -> None:
        self.handle.cancel()

    def results(self) -> list[TrainingResult]:
        """The TrainingResult of every attempt that ended on its own (completed or stopped to be
        requeued), oldest first; a killed attempt leaves none. Empty when not watchable."""
        if self.watch_dir is None:
            return []
        return read_results(self.watch_dir, self.spec.name, self.spec.run_id)

    def checkpoints(
        self,
        *,
        cursor_path: str | os.PathLike[str] | None = None,
        poll_interval: float | None = None,
        on_state: Callable[[JobState], None] | None = None,
        on_skip: Callable[[SkippedCheckpoint], None] | None = None,
    ) -> Iterator[CheckpointInfo]:
        """Yield each complete checkpoint once, in step order, until the job is done and every
        checkpoint it left was yielded (or skipped, see ``watch_checkpoints``). ``on_state`` hears
        every change of the job's state. Raises ``TrainingFailed`` when the job did not complete.
        Without a watch folder, only the job's state is followed."""
        if self.handle.state() == JobState.DRY_RUN:
            return
        poll = poll_interval or self.config.cluster.poll_interval_s
        last: list[JobState | None] = [None]

        def is_done() -> bool:
            state = self.handle.state()
            if state != last[0]:
                last[0] = state
                if on_state is not None:
                    on_state(state)
            return state.terminal

        if self.watch_dir is None:
            log.warning("checkpoints of %s are not watched: set watch_dir to where this machine sees "
                        "trainer.output_dir", self.job_id)  # fmt: skip
            watch: Iterator[CheckpointInfo] = _wait(is_done, poll)
        else:
            cursor = cursor_path or Path(CURSOR_DIR).expanduser() / f"{self.spec.name}-{self.spec.run_id}.json"
            watch = watch_checkpoints(
                self.watch_dir, cursor_path=cursor, is_job_done=is_done, poll_interval=poll, on_skip=on_skip
            )
        yield from watch
        state = self.handle.state()
        if state != JobState.COMPLETED:
            raise TrainingFailed(self.job_id, state.value, self.failure_reason())

    def failure_reason(self) -> str:
        """The backend's reason, with the log's last lines when the backend did not add them."""
        reason = self.handle.failure_reason() or "no reason reported"
        if "last lines of" not in reason:
            tail = self.handle.tail_log(LOG_TAIL_LINES)
            if tail.strip():
                reason += f"\nlast lines of {self.log_path}:\n{tail}"
        return reason


def _wait(is_done: Callable[[], bool], poll: float) -> Iterator[CheckpointInfo]:
    """Follow the job's state only: a watch that never finds a checkpoint."""
    while not is_done():
        time.sleep(poll)
    yield from ()


def submit_training(config: TrainingSettings, *, backend: Backend | None = None) -> TrainingRun:
    """Submit the trainer job (``training_job_spec``); with ``cluster.dry_run`` the backend prints
    what it would submit and the run's state is DRY_RUN. Raises the backend's ``ConfigError`` or
    ``SubmissionError``."""
    spec = training_job_spec(config)
    backend = backend or open_backend(config.cluster)
    return TrainingRun(config, spec, backend.submit(spec))


def run_and_watch(
    config: TrainingSettings,
    *,
    backend: Backend | None = None,
    on_submit: Callable[[TrainingRun], None] | None = None,
    cursor_path: str | os.PathLike[str] | None = None,
    poll_interval: float | None = None,
    on_state: Callable[[JobState], None] | None = None,
    on_skip: Callable[[SkippedCheckpoint], None] | None = None,
) -> Iterator[CheckpointInfo]:
    """Submit, call ``on_submit(run)``, then yield complete checkpoints in step order until the job
    is done and all were yielded; raise ``TrainingFailed`` (reason and log tail) when it failed.
    Leaving the iteration early, by an exception or by closing it, cancels the job."""
    run = submit_training(config, backend=backend)
    with run.handle:  # cancels on any exception, GeneratorExit (close, break) included
        if on_submit is not None:
            on_submit(run)
        yield from run.checkpoints(
            cursor_path=cursor_path, poll_interval=poll_interval, on_state=on_state, on_skip=on_skip
        )
