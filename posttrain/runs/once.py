"""Submit a training run at most once per marker file, and tell later whether it completed.

A pipeline that is retried (a Prefect flow run, a re-run script) calls ``submit_once`` with the
same marker: the first call submits and records the job; later calls return that record instead
of submitting again. Whether the job ended is read from its handle when this process submitted
it, else from the trainer's results file, else from the scheduler. No Prefect here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from posttrain.cluster import Backend, JobState
from posttrain.cluster.spec import NAME_MAX
from posttrain.runs.follow import TrainingRun, submit_training
from posttrain.runs.job import TrainingRunConfig, results_path
from posttrain.trainer.config import TrainingResult

# Runs submitted by this process, by job id: their handles follow them best.
_RUNS: dict[str, TrainingRun] = {}


class SubmittedJob(BaseModel):
    """What a marker file records about a submitted training job."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="Scheduler job id.")
    run_id: str = Field(description="Run id of the submission (job folder, results file).")
    name: str = Field(description="Job name.")
    backend: str = Field(description="slurm, k8s or local.")
    log_path: str | None = Field(description="Where the job's log is.")
    output_dir: str = Field(description="The trainer's output folder.")


def job_name(name: str) -> str:
    """A job name within the backends' limit: a long name keeps a prefix and gains a short digest."""
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: NAME_MAX - 9].rstrip('-')}-{digest}"


def submit_once(config: TrainingRunConfig, marker: Path) -> tuple[SubmittedJob, bool]:
    """The job recorded in ``marker``, or a new submission recorded there; True when new."""
    if marker.exists():
        return SubmittedJob.model_validate_json(marker.read_text()), False
    run = submit_training(config)
    _RUNS[run.job_id] = run
    job = SubmittedJob(job_id=run.job_id, run_id=run.spec.run_id, name=run.spec.name, backend=config.backend,
                       log_path=run.log_path, output_dir=str(config.trainer.output_dir))
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.tmp")
    tmp.write_text(job.model_dump_json(indent=2))
    tmp.replace(marker)
    return job, True


def submitted_run(job: SubmittedJob) -> TrainingRun | None:
    """The run, when this process submitted it (None after a restart)."""
    return _RUNS.get(job.job_id)


def results(job: SubmittedJob) -> list[TrainingResult]:
    """The trainer's result of every attempt that ended on its own, oldest first."""
    path = Path(results_path(job.output_dir, job.name, job.run_id))
    if not path.exists():
        return []
    return [TrainingResult.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def job_ended(job: SubmittedJob, backend: Backend) -> bool:
    """Whether the job ended. A local job of an earlier process that left no result counts as
    ended: only its checkpoints remain to be drained."""
    run = submitted_run(job)
    if run is not None:
        return run.state().terminal
    if any(r.completed for r in results(job)) or job.backend != "slurm":
        return True
    return backend.attach(job.job_id, str(Path(job.log_path or ".").parent)).state().terminal


def completed_result(job: SubmittedJob) -> TrainingResult:
    """The result of the attempt that completed; raises with the reason when the job did not."""
    run = submitted_run(job)
    if run is not None and run.state() != JobState.COMPLETED:
        raise RuntimeError(f"training job {job.job_id} ended {run.state().value}: {run.failure_reason()}")
    done = [r for r in results(job) if r.completed]
    if not done:
        raise RuntimeError(f"training job {job.job_id} left no completed result in {job.output_dir}")
    return done[-1]
