"""Tasks that run the trainer on the cluster: the nightly GRPO run, and the GRPO step of a round.

Submission is recorded in a marker file in the run folder, so a retried flow run finds its job
instead of submitting another; checkpoints come from the shared output folder either way.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from pydantic import BaseModel, ConfigDict

from posttrain.cluster import JobState
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.training_job import TrainingRunConfig, results_path
from posttrain.training_run import TrainingRun, submit_training
from posttrain.tasks.blocks import load_block
from posttrain.tasks.report import log_links

# Runs submitted by this process, by job id: the flow follows them through their handles.
_RUNS: dict[str, TrainingRun] = {}


def submitted_run(job_id: str) -> TrainingRun | None:
    """The run this process submitted under ``job_id``; None when an earlier attempt submitted it."""
    return _RUNS.get(job_id)


class TrainingJobRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str
    run_id: str
    name: str
    backend: str
    log_path: str | None
    output_dir: str


def job_name(name: str) -> str:
    """A job name within the backends' limit: long names keep a prefix and gain a short digest."""
    from posttrain.cluster.spec import NAME_MAX

    if len(name) <= NAME_MAX:
        return name
    import hashlib

    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: NAME_MAX - 9].rstrip('-')}-{digest}"


def training_run_config(cluster_ref: str, name: str, run_id: str | None, trainer: TrainerConfig) -> TrainingRunConfig:
    cluster = load_block(cluster_ref, "cluster").settings
    return TrainingRunConfig(name=job_name(name), run_id=run_id, cluster=cluster, trainer=trainer)


@task(name="submit-training", task_run_name="submit-{name}")
def submit(cluster_ref: str, name: str, trainer: TrainerConfig, marker: str) -> TrainingJobRef:
    """Submit the trainer once: a marker left by an earlier attempt returns that job instead."""
    logger = get_run_logger()
    path = Path(marker)
    if path.exists():
        ref = TrainingJobRef.model_validate_json(path.read_text())
        logger.info("training job %s was submitted before (%s); not submitting again", ref.job_id, path)
        return ref
    config = training_run_config(cluster_ref, name, None, trainer)  # a fresh job folder per submission
    run = submit_training(config)
    _RUNS[run.job_id] = run
    ref = TrainingJobRef(job_id=run.job_id, run_id=run.spec.run_id, name=run.spec.name, backend=config.backend,
                         log_path=run.log_path, output_dir=str(trainer.output_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(ref.model_dump_json(indent=2))
    tmp.replace(path)
    logger.info("submitted training job %s on %s; log %s", ref.job_id, ref.backend, ref.log_path)
    log_links(name, ref.job_id, ref.log_path, ref.backend)
    return ref


def results(ref: TrainingJobRef) -> list[TrainingResult]:
    path = Path(results_path(ref.output_dir, ref.name, ref.run_id))
    if not path.exists():
        return []
    return [TrainingResult.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def job_done(ref: TrainingJobRef, cluster_ref: str) -> bool:
    """Whether the job ended: its handle when this process submitted it, else the trainer's results
    file (a completed run leaves one), else the scheduler (Slurm). A local job of an earlier process
    that left no result counts as ended: only its checkpoints remain to be drained."""
    run = _RUNS.get(ref.job_id)
    if run is not None:
        return run.state().terminal
    if any(r.completed for r in results(ref)) or ref.backend != "slurm":
        return True
    backend = load_block(cluster_ref, "cluster").backend()
    return backend.attach(ref.job_id, str(Path(ref.log_path or ".").parent)).state().terminal


def check_completed(ref: TrainingJobRef) -> TrainingResult:
    run = _RUNS.get(ref.job_id)
    if run is not None and run.state() != JobState.COMPLETED:
        raise RuntimeError(f"training job {ref.job_id} ended {run.state().value}: {run.failure_reason()}")
    done = [r for r in results(ref) if r.completed]
    if not done:
        raise RuntimeError(f"training job {ref.job_id} left no completed result in {ref.output_dir}")
    return done[-1]


@task(name="train-step", task_run_name="train-step-round-{round}")
def train_step(cluster_ref: str, run_name: str, round: int, trainer: TrainerConfig, marker: str) -> str:
    """One GRPO step on the round's rollouts, on the cluster; returns the new checkpoint folder."""
    ref = submit.fn(cluster_ref, f"{run_name}-step", trainer, marker)
    run = _RUNS.get(ref.job_id)
    if run is not None:
        for _ in run.checkpoints(cursor_path=Path(marker).with_suffix(".cursor.json")):
            pass
    result = check_completed(ref)
    if result.checkpoint is None:
        raise RuntimeError(f"training step of round {round} saved no checkpoint ({ref.output_dir})")
    get_run_logger().info("round %d: policy version %s at %s", round, result.policy_version, result.checkpoint)
    return str(result.checkpoint)
