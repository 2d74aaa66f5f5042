"""Tasks that run the trainer on the cluster: the nightly GRPO run, the GRPO step of a round, and the
resident trainer of a GRPO run (``ResidentJob``: one job, handed a round at a time).

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
    live_run,
    submit_once,
    wait_for_result,
)
from posttrain.trainer.checkpoints import CheckpointInfo, try_inspect
from posttrain.trainer.config import TrainerConfig, TrainingResult
from posttrain.trainer.rounds import ROLLOUTS_FILE, hand_round, read_ready, round_dir, start_position

#: The submit marker of a run's one training job (the nightly run's, a resident GRPO trainer's).
JOB_MARKER = "training-job.json"
#: The watch cursor of that job's checkpoints.
CURSOR_FILE = "watch-cursor.json"
#: Lines of a job's log quoted when it ended without the checkpoint a round waited for.
LOG_TAIL_LINES = 20


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
    """The submit markers a run leaves: the run's one training job (nightly, or a GRPO run's resident
    trainer), each GRPO round's step job (per_round)."""
    return [m for m in (run_dir / JOB_MARKER, *sorted(run_dir.glob("rounds/*/train-job.json"))) if m.exists()]


class ResidentJob:
    """A GRPO run's resident trainer (``mode: resident``), as the flow drives it: submitted once (the
    run's submit marker: a retried flow run finds the job), handed each round's rollouts
    (``posttrain.trainer.rounds``), its checkpoints followed with the run's watch and cursor.

    Round r of a run from ``model_name_or_path`` at global step s writes ``checkpoint-<s + (r + 1) *
    num_iterations>``, as a chain of step jobs would (docs/trainer.md); a round is done once that
    checkpoint is complete, whichever attempt of the flow run handed it."""

    def __init__(self, cluster_ref: str, run_name: str, trainer: TrainerConfig, run_dir: Path, *,
                 poll_interval: float, card: str | None = None) -> None:
        assert trainer.mode == "resident" and trainer.rounds_dir is not None
        self.trainer = trainer
        self.rounds_dir = trainer.rounds_dir
        self.job = submit(cluster_ref, f"{run_name}-resident", trainer, str(run_dir / JOB_MARKER), card=card)
        self._start = start_position(trainer.model_name_or_path)[0]
        self._watch = watch_job(self.job, cluster_ref, run_dir / CURSOR_FILE, poll_interval)

    def checkpoint_path(self, round: int) -> Path:
        """Where the checkpoint of ``round`` is (as this machine sees the output folder)."""
        step = self._start + (round + 1) * self.trainer.num_iterations
        return self.job.local_dir() / f"checkpoint-{step}"

    def trained(self, round: int) -> CheckpointInfo | None:
        """The round's checkpoint when it is complete (an earlier attempt's round), else None."""
        return try_inspect(self.checkpoint_path(round))

    def sampled(self, round: int) -> bool:
        """Whether the round's rollouts file is written (whole: it is written atomically)."""
        return (round_dir(self.rounds_dir, round) / ROLLOUTS_FILE).is_file()

    def hand(self, round: int, policy_version: int) -> None:
        """Hand the round's rollouts (already in its folder) to the trainer; again is a no-op."""
        earlier = read_ready(self.rounds_dir, round)
        hand_round(self.rounds_dir, round, earlier.policy_versions if earlier else policy_version)

    def wait(self, round: int) -> CheckpointInfo:
        """The round's checkpoint, once the trainer wrote it; a RuntimeError with the job's reason
        when the job ended first."""
        want = self.checkpoint_path(round)
        for ckpt in self._watch:
            if ckpt.path.name == want.name:
                return ckpt
            if ckpt.step > int(want.name.split("-")[1]):
                raise RuntimeError(f"round {round}: the trainer wrote {ckpt.path.name} instead of {want.name}")
            # an earlier round's, handled by an earlier attempt of the flow run
        raise RuntimeError(f"round {round}: training job {self.job.job_id} ended before writing {want.name}: "
                           f"{self.end_reason()}")

    def end_reason(self) -> str:
        """Why the job ended: the backend's word for a job this process submitted, else its log's last lines."""
        run = live_run(self.job)
        if run is not None:
            return run.failure_reason()
        try:
            completed_result(self.job)
        except RuntimeError as e:
            reason = str(e)
        else:
            reason = "it completed"
        log = Path(self.job.log_path) if self.job.log_path else None
        if log is not None and log.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            reason += f"\nlast lines of {log}:\n{tail}"
        return reason

    def finish(self) -> TrainingResult:
        """After the last round: the job's end (its event), then its completed result."""
        for ckpt in self._watch:
            get_run_logger().warning("checkpoint %s after the run's last round", ckpt.path)
        return completed_result(self.job)


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
