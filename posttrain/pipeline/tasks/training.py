"""Tasks that run the trainer on the cluster: the nightly GRPO run, and the GRPO step of a round.

A marker file in the run folder records the submission (``posttrain.runs.once``), so a
retried flow run finds its job instead of submitting another. Following the job, before or
after a restart, is the engine's (``posttrain.runs.once``); here the cluster block is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prefect import get_run_logger, task
from prefect.logging.loggers import flow_run_logger

from posttrain.cluster import ClusterConfig
from posttrain.pipeline.parameters import from_parameters
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.report import log_links
from posttrain.runs.job import TrainingSettings
from posttrain.runs.once import (
    JobRecord,
    cancel_job,
    checkpoints_to_handle,
    completed_result,
    job_ended,
    job_name,
    submit_once,
    wait_for_result,
)
from posttrain.trainer.checkpoints import CheckpointInfo
from posttrain.trainer.config import TrainerConfig


def cluster_settings(cluster_ref: str) -> ClusterConfig:
    """The settings of the cluster block ``cluster_ref``."""
    return load_block(cluster_ref, "cluster").settings


@task(name="submit-training", task_run_name="submit-{name}")
def submit(cluster_ref: str, name: str, trainer: TrainerConfig, marker: str, card: str | None = None) -> JobRecord:
    """Submit the trainer once: a marker left by an earlier attempt returns that job instead.
    ``card``: the run name keying the flow run's training-job artifact (default ``name``)."""
    logger = get_run_logger()
    settings = TrainingSettings(name=job_name(name), cluster=cluster_settings(cluster_ref), trainer=trainer)
    job, new = submit_once(settings, Path(marker))
    if not new:
        logger.info("training job %s was submitted before (%s); not submitting again", job.job_id, marker)
        return job
    logger.info("submitted training job %s on %s; log %s", job.job_id, job.backend, job.log_path)
    events.job_event("submitted", job)
    log_links(card or name, job.job_id, job.log_path, job.backend)
    return job


def watch_job(job: JobRecord, cluster_ref: str, cursor_path: Path, poll_interval: float) -> Iterator[CheckpointInfo]:
    """The checkpoints of ``job`` still to handle, in step order (not a task: the flow iterates it).
    Once the job ended, its end is an event: ``posttrain.job.completed`` or ``posttrain.job.failed``."""
    try:
        yield from checkpoints_to_handle(job, cluster_settings(cluster_ref), cursor_path=cursor_path,
                                         poll_interval=poll_interval)
    except Exception as e:
        events.job_event("failed", job, reason=f"{type(e).__name__}: {e}")
        raise
    try:
        completed_result(job)
    except Exception as e:  # noqa: BLE001 - the flow asks again and fails with this error
        events.job_event("failed", job, reason=str(e))
    else:
        events.job_event("completed", job)


@task(name="train-step", task_run_name="train-step-round-{round}")
def train_step(cluster_ref: str, run_name: str, round: int, trainer: TrainerConfig, marker: str,
               card: str | None = None) -> str:
    """One GRPO step on the round's rollouts, on the cluster; returns the new checkpoint folder."""
    job = submit.fn(cluster_ref, f"{run_name}-step", trainer, marker, card=card)
    try:
        result = wait_for_result(job, cluster_settings(cluster_ref))
    except Exception as e:
        events.job_event("failed", job, reason=str(e))
        raise
    events.job_event("completed", job)
    if result.checkpoint is None:
        raise RuntimeError(f"training step of round {round} saved no checkpoint ({job.output_dir})")
    get_run_logger().info("round %d: policy version %s at %s", round, result.policy_version, result.checkpoint)
    return str(result.checkpoint)


def submitted_markers(run_dir: Path) -> list[Path]:
    """The submit markers a run leaves: the nightly run's training job, each GRPO round's step."""
    return [m for m in (run_dir / "training-job.json", *sorted(run_dir.glob("rounds/*/train-job.json"))) if m.exists()]


def flow_run_resource(flow_run) -> dict[str, str]:
    return {"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name,
            "prefect.resource.role": "flow-run"}


def cancel_submitted(settings_model: type) -> Callable:
    """A flow hook (``on_cancellation``, ``on_crashed``) cancelling every training job the flow
    run submitted, found by the submit markers in its run folder. Not on failure: a retry
    continues a failed run's job."""

    def cancel_training_jobs(flow, flow_run, state) -> None:
        logger = flow_run_logger(flow_run, flow)
        settings = from_parameters(settings_model, flow_run.parameters).for_flow_run(str(flow_run.id))
        markers = submitted_markers(settings.run_dir)
        if not markers:
            logger.info("flow run %s: no training job was submitted; nothing to cancel", state.name)
            return
        cluster = cluster_settings(settings.cluster)
        for marker in markers:
            record = JobRecord.model_validate_json(marker.read_text())
            try:
                ended = job_ended(record, cluster)
            except Exception:  # noqa: BLE001 - cancel it anyway
                ended = False
            try:
                done = cancel_job(record, cluster)
                logger.warning("flow run %s: %s", state.name, done)
                if not ended:
                    events.job_event("cancelled", record, reason=done, related=[flow_run_resource(flow_run)])
            except Exception as e:  # noqa: BLE001 - try every job; say which one could not be stopped
                logger.error("flow run %s: could not cancel training job %s (%s): %s: %s", state.name,
                             record.job_id, marker, type(e).__name__, e)

    return cancel_training_jobs
