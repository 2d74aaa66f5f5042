"""Tasks that run the trainer on the cluster: the nightly GRPO run (``run_job``), the GRPO step of a
round (``train_step``), and the resident trainer of a GRPO run (``resident_run``: one job, handed a
round at a time).

A marker file in the run folder records the submission (``posttrain.runs.once``), so a
retried flow run finds its job instead of submitting another. Following the job, before or
after a restart, is the engine's (``posttrain.runs.resident``: ``RunJob``, ``ResidentRun``); here
the cluster block is loaded and the job's submission and end become events.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.logging.loggers import flow_run_logger

from posttrain.cluster import ClusterConfig
from posttrain.fsutil import atomic_write
from posttrain.pipeline.parameters import from_parameters
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.report import log_links
from posttrain.runs.job import TrainingSettings
from posttrain.runs.once import JobRecord, cancel_job, job_ended, job_name, submit_once, wait_for_result
from posttrain.runs.resident import OnEnd, ResidentRun, RunJob, retire_if_ended, retired_markers
from posttrain.trainer.config import TrainerConfig

#: The submit marker of a run's one training job (the nightly run's, a resident GRPO trainer's).
JOB_MARKER = "training-job.json"
#: The watch cursor of that job's checkpoints.
CURSOR_FILE = "watch-cursor.json"


def cluster_settings(cluster_ref: str) -> ClusterConfig:
    """The settings of the cluster block ``cluster_ref``."""
    return load_block(cluster_ref, "cluster").settings


# Never a cached result (NO_CACHE), here or in any task with an effect outside the flow run: with
# result persistence on (PREFECT_RESULTS_PERSIST_BY_DEFAULT), Prefect's default policy keys a result
# by the task's inputs, source and flow run id, so a retried flow run's second ``submit`` after
# ``retire_if_ended`` got the dead job's record back instead of submitting again, on every retry.
@task(name="submit-training", task_run_name="submit-{name}", cache_policy=NO_CACHE)
def submit(cluster_ref: str, name: str, trainer: TrainerConfig, marker: str, card: str | None = None) -> JobRecord:
    """Submit the trainer once: a marker left by an earlier attempt returns that job instead.
    ``card``: the run name keying the flow run's training-job artifact (default ``name``)."""
    logger = get_run_logger()
    settings = TrainingSettings.for_pipeline(job_name(name), cluster_settings(cluster_ref), trainer)
    job, new = submit_once(settings, Path(marker))
    if not new:
        logger.info("training job %s was submitted before (%s); not submitting again", job.job_id, marker)
        return job
    logger.info("submitted training job %s on %s; log %s", job.job_id, job.backend, job.log_path)
    events.job_event("submitted", job)
    log_links(card or name, job.job_id, job.log_path, job.backend)
    return job


@task(name="train-step", task_run_name="train-step-round-{round}", cache_policy=NO_CACHE)
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


def resident_markers(run_dir: Path) -> list[Path]:
    """The markers of a GRPO run's resident jobs: the earlier ones a retry submitted again, then the current."""
    return retired_markers(run_dir / JOB_MARKER)


def end_events(job: JobRecord) -> OnEnd:
    """The ``on_end`` of a run's job: its end as an event, ``posttrain.job.completed`` or ``posttrain.job.failed``."""
    return lambda outcome, reason: events.job_event(outcome, job, reason=reason)


def run_job(cluster_ref: str, name: str, trainer: TrainerConfig, run_dir: Path, *, poll_interval: float,
            card: str | None = None) -> RunJob:
    """The run's one training job (the nightly's): submitted once (``submit``), followed with the
    run's cursor; its end is an event."""
    job = submit(cluster_ref, name, trainer, str(run_dir / JOB_MARKER), card=card)
    return RunJob(job, cluster_settings(cluster_ref), cursor_path=run_dir / CURSOR_FILE, poll_interval=poll_interval,
                  on_end=end_events(job))


def resident_run(cluster_ref: str, run_name: str, trainer: TrainerConfig, run_dir: Path, *, poll_interval: float,
                 card: str | None = None) -> ResidentRun:
    """A GRPO run's resident trainer (``posttrain.runs.resident``), submitted once (a retried flow
    run finds it by the run's submit marker); its end is an event."""
    marker = run_dir / JOB_MARKER
    job = submit(cluster_ref, f"{run_name}-resident", trainer, str(marker), card=card)
    retired = retire_if_ended(job, cluster_settings(cluster_ref), marker)
    if retired is not None:  # a retried flow run whose job gave up meanwhile: a new job resumes its rounds
        get_run_logger().warning("resident training job %s ended before the run's last round (%s); submitting it "
                                 "again: it resumes from its last checkpoint (the earlier job's record: %s)",
                                 job.job_id, retired[1].splitlines()[0], retired[0].name)
        job = submit(cluster_ref, f"{run_name}-resident", trainer, str(marker), card=card)
    return ResidentRun(job, cluster_settings(cluster_ref), trainer, cursor_path=run_dir / CURSOR_FILE,
                       poll_interval=poll_interval, on_end=end_events(job))


def flow_run_resource(flow_run) -> dict[str, str]:
    return {"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name,
            "prefect.resource.role": "flow-run"}


def cancel_submitted(settings_model: type) -> Callable:
    """A flow hook (``on_cancellation``, ``on_crashed``) cancelling every training job the flow
    run submitted, found by the submit markers in its run folder. Not on failure: a retry
    continues a failed run's job. After a Cancel, ``stops_jobs_when_cancelled`` has stopped them
    already (this hook comes 15-20 s later) and the hook finds them ended."""

    def cancel_training_jobs(flow, flow_run, state) -> None:
        cancel_jobs(settings_model, flow_run.parameters, flow, flow_run, f"flow run {state.name}")

    return cancel_training_jobs


def cancel_jobs(settings_model: type, parameters: dict, flow, flow_run, why: str, *, at_cancel: bool = False) -> None:
    """Cancel every training job the flow run (of these parameters) submitted; each is logged
    (``why``: what is stopping them) and, unless it had ended, is a ``cancelled`` event.
    ``at_cancel``: the flow run's own process, at the cancel; it notes each job it stopped
    (``<marker>.cancelled``, the job's id) and the hook after it leaves those alone: one event a job."""
    logger = flow_run_logger(flow_run, flow)
    settings = from_parameters(settings_model, parameters).for_flow_run(str(flow_run.id))
    markers = submitted_markers(settings.run_dir)
    if not markers:
        logger.info("%s: no training job was submitted; nothing to cancel", why)
        return
    cluster = cluster_settings(settings.cluster)
    for marker in markers:
        record = JobRecord.model_validate_json(marker.read_text())
        noted = marker.with_name(f"{marker.name}.cancelled")
        if not at_cancel and noted.exists() and noted.read_text() == record.job_id:
            logger.info("%s: training job %s was stopped at the cancel, by the flow run's process", why,
                        record.job_id)
            continue
        try:
            ended = job_ended(record, cluster)
        except Exception:  # noqa: BLE001 - cancel it anyway
            ended = False
        try:
            done = cancel_job(record, cluster)
            if at_cancel:
                atomic_write(noted, record.job_id)
            logger.warning("%s: %s", why, done)
            if not ended:
                events.job_event("cancelled", record, reason=done, related=[flow_run_resource(flow_run)])
        except Exception as e:  # noqa: BLE001 - try every job; say which one could not be stopped
            logger.error("%s: could not cancel training job %s (%s): %s: %s", why, record.job_id, marker,
                         type(e).__name__, e)


def stops_jobs_when_cancelled(settings_model: type) -> Callable[[Callable], Callable]:
    """Decorate a flow's function (of ``settings_model``'s flat parameters) so that a Cancel stops the
    run's training jobs from the flow run's own process, as soon as the cancel's SIGTERM reaches it.

    The ``on_cancellation`` hook (``cancel_submitted``) would too, but Prefect's process worker runs
    it only after the flow run's process ended, in a new Python process that imports the flow first:
    15-20 s on a loaded 2-CPU machine (measured: a Slurm job's scancel 16 s after the flow process
    said "Flow run was cancelled."), while the job trained on. A SIGTERM that is no cancel (the
    flow run is not Cancelling: its worker was stopped) leaves the jobs running, for a retry to find."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def stopping_jobs(**params):
            try:
                return fn(**params)
            except TerminationSignal:
                context = FlowRunContext.get()
                if context is not None and context.flow_run is not None and _cancelling(context.flow_run.id):
                    try:
                        cancel_jobs(settings_model, params, context.flow, context.flow_run,
                                    "cancelled, stopping the training job now", at_cancel=True)
                    except Exception as e:  # noqa: BLE001 - the hook tries again
                        flow_run_logger(context.flow_run, context.flow).error(
                            "cancelled: could not stop the training jobs (%s: %s); the on_cancellation hook "
                            "tries again", type(e).__name__, e)
                raise

        return stopping_jobs

    return decorate


def _cancelling(flow_run_id) -> bool:
    """Whether the server has the flow run Cancelling (or Cancelled): a Cancel, not a stopped worker."""
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:  # noqa: BLE001 - unknown: leave the jobs to the hooks
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())
