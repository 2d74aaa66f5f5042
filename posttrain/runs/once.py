"""Submit a training run at most once per marker file, and follow it again after a restart.

A pipeline that is retried (a Prefect flow run, a re-run script) calls ``submit_once`` with the
same marker: the first call submits and records the job (a ``JobRecord``); later calls return
that record instead of submitting again. From the record, whichever process holds it can:

- ``handled_before``: the checkpoints an earlier attempt already handled (at or before the cursor);
- ``checkpoints_to_handle``: the complete checkpoints still to handle, in step order, until the job ended;
- ``wait_for_result``: wait for the job to end, then the result of the attempt that completed;
- ``cancel_job``: stop the job (scancel, the local process group, the Kubernetes Job deleted).

Whether the job ended is read from its handle when this process submitted it, else from the
trainer's results file, else from the scheduler (Slurm, Kubernetes) or the job's process
group (local). No Prefect here.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from posttrain.cluster import ClusterConfig, JobHandle, JobState, open_backend
from posttrain.cluster.spec import NAME_MAX
from posttrain.fsutil import atomic_write
from posttrain.runs.follow import TrainingRun, submit_training
from posttrain.runs.job import TrainingSettings, read_results, timeline_path
from posttrain.runs.watch import load_cursor, watch_checkpoints
from posttrain.trainer.checkpoints import CheckpointInfo, complete_checkpoints
from posttrain.trainer.config import TrainingResult
from posttrain.trainer.timeline import Attempt, read_timeline
from posttrain.words import plural

# Runs submitted by this process, by job id: their handles follow them best.
_RUNS: dict[str, TrainingRun] = {}


class JobRecord(BaseModel):
    """What a marker file records about a submitted training job, enough to find it again."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="Scheduler job id.")
    run_id: str = Field(description="Run id of the submission (job folder, results file).")
    name: str = Field(description="Job name.")
    backend: str = Field(description="slurm, k8s or local.")
    log_path: str | None = Field(description="Where the job's log is.")
    output_dir: str = Field(description="The trainer's output folder, as the cluster sees it.")
    watch_dir: str | None = Field(
        None, description="Where this machine reads that folder (checkpoints, results); None when it cannot."
    )
    pgid: int | None = Field(
        None, description="Local jobs: the process group of the whole job (None on other backends)."
    )
    submitted_at: float | None = Field(
        None, description="When it was submitted (seconds since the epoch, just before the submission): "
        "queue wait is its first attempt's start minus this."
    )

    def local_dir(self) -> Path:
        """The output folder as this machine sees it; a ValueError when it cannot see it."""
        if self.watch_dir is None:
            raise ValueError(f"job {self.job_id}: its output folder {self.output_dir} is not visible here; "
                             "set watch_dir to where this machine mounts it")
        return Path(self.watch_dir)


def job_name(name: str) -> str:
    """A job name within the backends' limit: a long name keeps a prefix and gains a short digest."""
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: NAME_MAX - 9].rstrip('-')}-{digest}"


def submit_once(config: TrainingSettings, marker: Path) -> tuple[JobRecord, bool]:
    """The job recorded in ``marker``, or a new submission recorded there (durably); True when new."""
    if marker.exists():
        return JobRecord.model_validate_json(marker.read_text()), False
    submitted_at = time.time()
    run = submit_training(config)
    _RUNS[run.job_id] = run
    record = JobRecord(job_id=run.job_id, run_id=run.spec.run_id, name=run.spec.name, backend=config.backend,
                       log_path=run.log_path, output_dir=str(config.trainer.output_dir),
                       watch_dir=None if run.watch_dir is None else str(run.watch_dir),
                       pgid=getattr(run, "pgid", None), submitted_at=submitted_at)
    atomic_write(marker, record.model_dump_json(indent=2))
    return record, True


def job_timeline(record: JobRecord) -> list[Attempt]:
    """The trainer's attempts as its timeline records them (``posttrain.trainer.timeline``); empty when
    the output folder is not visible here or nothing was recorded (yet)."""
    if record.watch_dir is None:
        return []
    return read_timeline(timeline_path(record.local_dir(), record.name, record.run_id))


def live_run(record: JobRecord) -> TrainingRun | None:
    """The run, when this process submitted it (None after a restart)."""
    return _RUNS.get(record.job_id)


def results(record: JobRecord) -> list[TrainingResult]:
    """The trainer's result of every attempt that ended on its own, oldest first."""
    return read_results(record.local_dir(), record.name, record.run_id)


def ended_check(record: JobRecord, cluster: ClusterConfig | None) -> Callable[[], bool]:
    """A callable telling whether the job ended. A job of an earlier process counts as ended once
    it left a completed result; before that, a local one while its process group lives, a Slurm
    or Kubernetes one by the scheduler's word (``cluster`` opens the backend that attaches to it;
    a Kubernetes Job that is gone has ended). A local job recorded without its process group
    counts as ended at once (only its checkpoints remain to be drained)."""
    run = live_run(record)
    if run is not None:
        return lambda: run.state().terminal
    handle: list[JobHandle] = []

    def ended() -> bool:
        if any(r.completed for r in results(record)):
            return True
        if record.backend == "local":
            return record.pgid is None or not _local().group_alive(record.pgid)
        if record.backend not in ("slurm", "k8s"):
            return True
        if not handle:
            handle.append(attach(record, cluster))
        state = handle[0].state()
        return state.terminal or (record.backend == "k8s" and state == JobState.UNKNOWN)  # the Job is gone

    return ended


def _local():
    from posttrain.cluster import local

    return local


def attach(record: JobRecord, cluster: ClusterConfig | None) -> JobHandle:
    """A handle on a Slurm or Kubernetes job of an earlier process; ``cluster`` opens its backend."""
    if cluster is None:
        raise ValueError(f"job {record.job_id}: the cluster settings are needed to follow a {record.backend} job")
    backend = open_backend(cluster)
    if record.backend == "slurm":
        return backend.attach(record.job_id, str(Path(record.log_path or ".").parent))  # type: ignore[attr-defined]
    if record.backend == "k8s":
        return backend.attach(record.job_id.split("/", 1)[-1])  # type: ignore[attr-defined]
    raise ValueError(f"job {record.job_id}: cannot attach to a {record.backend} job")


def cancel_job(record: JobRecord, cluster: ClusterConfig | None) -> str:
    """Stop the job, whichever process submitted it: scancel on Slurm, the Job deleted (its pods
    with it) on Kubernetes, the whole process group stopped (TERM, then KILL) locally. A job that
    already ended, or a Kubernetes Job already gone, is left alone. Returns what was done, in
    words, for the log."""
    run = live_run(record)
    if record.backend == "local":
        if run is not None:
            run.cancel()
        if record.pgid is None:
            return (f"local job {record.job_id}: its process group was not recorded"
                    + ("; its controller was stopped" if run is not None else "; nothing stopped"))
        found = _local().stop_group(record.pgid)
        if not found and run is None:
            return f"local job {record.job_id} (process group {record.pgid}) had already ended"
        stopped = plural(len(found), "process", "processes")
        return f"local job {record.job_id}: stopped process group {record.pgid} ({stopped})"
    handle = run.handle if run is not None else attach(record, cluster)
    state = handle.state()
    if state.terminal:
        return f"{record.backend} job {record.job_id} had already ended ({state.value})"
    if record.backend == "k8s" and state == JobState.UNKNOWN:  # the API answered 404: nothing to delete
        return f"k8s job {record.job_id} was already gone (deleted, or removed after it ended)"
    handle.cancel()
    how = "scancel" if record.backend == "slurm" else "Job deleted with its pods"
    return f"{record.backend} job {record.job_id} cancelled ({how}; was {state.value})"


def job_ended(record: JobRecord, cluster: ClusterConfig | None = None) -> bool:
    """Whether the job ended (see ``ended_check``)."""
    return ended_check(record, cluster)()


def handled_before(record: JobRecord, cursor_path: str | Path) -> list[CheckpointInfo]:
    """Checkpoints an earlier attempt handled: the complete ones at or before the watch cursor
    (the cursor moves past a checkpoint only once it was handled), less those it skipped."""
    if not Path(cursor_path).exists():
        return []
    output_dir = record.local_dir()
    cursor = load_cursor(cursor_path, output_dir)
    if cursor.last_step is None:
        return []
    return [c for c in complete_checkpoints(output_dir) if c.step <= cursor.last_step and c.step not in cursor.skipped]


def checkpoints_to_handle(
    record: JobRecord, cluster: ClusterConfig | None, *, cursor_path: str | Path, poll_interval: float
) -> Iterator[CheckpointInfo]:
    """Each complete checkpoint after the cursor, once, in step order, until the job ended and all
    were handed out: through the job's handle when this process submitted it (raising
    ``TrainingFailed`` when the job did not complete), else by watching the output folder."""
    run = live_run(record)
    if run is not None:
        yield from run.checkpoints(cursor_path=cursor_path, poll_interval=poll_interval)
        return
    yield from watch_checkpoints(record.local_dir(), cursor_path=cursor_path,
                                 is_job_done=ended_check(record, cluster), poll_interval=poll_interval)


def completed_result(record: JobRecord) -> TrainingResult:
    """The result of the attempt that completed; raises with the reason when the job did not."""
    run = live_run(record)
    if run is not None and run.state() != JobState.COMPLETED:
        raise RuntimeError(f"training job {record.job_id} ended {run.state().value}: {run.failure_reason()}")
    done = [r for r in results(record) if r.completed]
    if not done:
        raise RuntimeError(f"training job {record.job_id} left no completed result in {record.output_dir}")
    return done[-1]


def wait_for_result(
    record: JobRecord, cluster: ClusterConfig, *, sleep: Callable[[float], None] = time.sleep
) -> TrainingResult:
    """Wait for the job to end, whether this process submitted it or an earlier one did, checking
    every ``cluster.poll_interval_s``; then the result of the attempt that completed (raises
    ``RuntimeError`` with the reason when none did)."""
    ended = ended_check(record, cluster)
    while not ended():
        sleep(cluster.poll_interval_s)
    return completed_result(record)
