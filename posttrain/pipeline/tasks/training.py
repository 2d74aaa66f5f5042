"""Tasks that run the trainer on the cluster: the nightly GRPO run, and the GRPO step of a round.

A marker file in the run folder records the submission (``posttrain.runs.once``), so a
retried flow run finds its job instead of submitting another.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task

from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.report import log_links
from posttrain.runs.job import TrainingRunConfig
from posttrain.runs.once import SubmittedJob, completed_result, job_name, submit_once, submitted_run
from posttrain.trainer.config import TrainerConfig


def training_run_config(cluster_ref: str, name: str, trainer: TrainerConfig) -> TrainingRunConfig:
    cluster = load_block(cluster_ref, "cluster").settings
    return TrainingRunConfig(name=job_name(name), cluster=cluster, trainer=trainer)


@task(name="submit-training", task_run_name="submit-{name}")
def submit(cluster_ref: str, name: str, trainer: TrainerConfig, marker: str) -> SubmittedJob:
    """Submit the trainer once: a marker left by an earlier attempt returns that job instead."""
    logger = get_run_logger()
    job, new = submit_once(training_run_config(cluster_ref, name, trainer), Path(marker))
    if not new:
        logger.info("training job %s was submitted before (%s); not submitting again", job.job_id, marker)
        return job
    logger.info("submitted training job %s on %s; log %s", job.job_id, job.backend, job.log_path)
    log_links(name, job.job_id, job.log_path, job.backend)
    return job


def job_ended(job: SubmittedJob, cluster_ref: str) -> bool:
    from posttrain.runs.once import job_ended as ended

    return ended(job, load_block(cluster_ref, "cluster").backend())


@task(name="train-step", task_run_name="train-step-round-{round}")
def train_step(cluster_ref: str, run_name: str, round: int, trainer: TrainerConfig, marker: str) -> str:
    """One GRPO step on the round's rollouts, on the cluster; returns the new checkpoint folder."""
    job = submit.fn(cluster_ref, f"{run_name}-step", trainer, marker)
    run = submitted_run(job)
    if run is not None:
        for _ in run.checkpoints(cursor_path=Path(marker).with_suffix(".cursor.json")):
            pass
    else:  # a retried flow run: the job of an earlier attempt may still be running
        while not job_ended(job, cluster_ref):
            time.sleep(2.0)
    result = completed_result(job)
    if result.checkpoint is None:
        raise RuntimeError(f"training step of round {round} saved no checkpoint ({job.output_dir})")
    get_run_logger().info("round %d: policy version %s at %s", round, result.policy_version, result.checkpoint)
    return str(result.checkpoint)
