"""The nightly post-training flow: stage → train → watch checkpoints → publish and hot-load each.

With ``use_lora``, each checkpoint is an adapter; it is merged into the base (``lora_publish:
merged``) and the merged model published as a full or delta snapshot, or published alone
(``lora_publish: adapter``) for a deployment that loads adapters at run time.

A retried flow run finds its training job (the submit marker) and its place (the watch cursor):
what an earlier attempt handled is reported again without hot-loading it again."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import update_progress_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from posttrain.pipeline.flows.promote import run_promotion
from posttrain.pipeline.parameters import flat_parameters
from posttrain.pipeline.promotion_settings import PromoteSettings
from posttrain.pipeline.settings import NightlySettings, flow_run_name, trainer_config
from posttrain.pipeline.tasks.blocks import check_blocks, check_job_inputs, check_reward_funcs
from posttrain.pipeline.tasks.goodput import FlowClock, report_goodput
from posttrain.pipeline.tasks.publishing import hot_load, publish_weights
from posttrain.pipeline.tasks.report import progress as progress_artifact
from posttrain.pipeline.tasks.report import size_column, snapshots_table, training_metrics
from posttrain.pipeline.tasks.retention import collect_garbage
from posttrain.pipeline.tasks.staging import stage
from posttrain.pipeline.tasks.training import cancel_submitted, run_job, stops_jobs_when_cancelled
from posttrain.words import plural


def snapshot_row(step: int, snapshot) -> dict:
    return {"step": step, "snapshot": snapshot.identity, "kind": snapshot.kind,
            "stored MB": round(snapshot.stored_bytes / 1e6, 3),
            "% of full": size_column(snapshot),
            "uploaded MB": round(snapshot.uploaded_bytes / 1e6, 3),
            "publish s": round(snapshot.encode_seconds + snapshot.upload_seconds, 2)}


class NightlyReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_name: str
    job_id: str
    checkpoints: int
    snapshots: list[dict]
    final_step: int | None
    run_dir: str
    promotion: dict | None = None
    tensorboard_dir: str | None = None


@flow(name="nightly-post-training", flow_run_name=flow_run_name, log_prints=True,
      on_cancellation=[cancel_submitted(NightlySettings)],
      on_crashed=[cancel_submitted(NightlySettings)])
@stops_jobs_when_cancelled(NightlySettings)  # at once; the hooks come 15-20 s later
@flat_parameters(NightlySettings)
def nightly_post_training(settings: NightlySettings) -> NightlyReport:
    """Stage the dataset, train on the cluster, and publish and hot-load every checkpoint."""
    logger = get_run_logger()
    clock = FlowClock()  # the waits on publishing, hot-loads and the gate, for the goodput report
    card = settings.run_name  # artifact keys: one per run name, a version per night
    settings = settings.for_flow_run(flow_run.id)
    run_dir = settings.run_dir
    check_blocks(settings.cluster, settings.store, settings.inference)  # before anything is submitted
    check_job_inputs(settings.cluster, settings.base_model, settings.dataset, settings.shared_dir)
    check_reward_funcs(settings.trainer.reward_funcs)
    staged = stage(settings.dataset, settings.shared_dir)
    trainer = trainer_config(settings.trainer, settings.lora, mode="grpo", model_name_or_path=settings.base_model,
                             output_dir=run_dir / "output", dataset_manifest=staged.manifest_path,
                             logging_dir=run_dir / "tensorboard", run_name=settings.run_name)
    job = run_job(settings.cluster, settings.run_name, trainer, run_dir, poll_interval=settings.watch_poll_s, card=card)
    training_metrics(card, trainer)  # where the curves are: TensorBoard's folder and command
    total = trainer.max_steps or 1
    progress = progress_artifact(card)  # a retried run goes on with the progress artifact of its first attempt
    rows = []
    # A retried run: what an earlier attempt handled goes into this run's report too. Publishing it
    # again finds it published (uploads nothing); it is not hot-loaded again.
    for ckpt in job.handled_before():
        with clock.wait("publish"):
            snapshot = publish_weights(str(ckpt.path), ckpt.step, settings)
        rows.append(snapshot_row(ckpt.step, snapshot)
                    | ({"hot-load s": None, "served": snapshot.identity} if settings.inference else {}))
    for ckpt in job.checkpoints():
        with clock.wait("publish"):  # counts only where the job is not running (docs/goodput.md)
            snapshot = publish_weights(str(ckpt.path), ckpt.step, settings)
        row = snapshot_row(ckpt.step, snapshot)
        if settings.inference:
            with clock.wait("hot-load"):
                loaded = hot_load(snapshot, settings)
            row["hot-load s"] = round(loaded.seconds, 2)
            row["served"] = loaded.identity
        rows.append(row)
        update_progress_artifact(progress, min(100.0, 100.0 * ckpt.step / total))
    result = job.result()
    update_progress_artifact(progress, 100.0)
    snapshots_table(card, rows, trainer)
    logger.info("nightly run %s: %s published, final step %s", settings.run_name, plural(len(rows), "checkpoint"),
                result.global_step)
    with clock.wait("promotion"):
        promotion = promote_last(settings, rows) if settings.promote_to and rows else None

    # Retention across runs (gc_keep_runs / gc_keep_days): the run's last task. This run is the newest, so kept.
    if settings.gc.enabled:
        served_by = [ref for ref in (settings.inference, settings.promote_to) if ref]  # staging and production
        collect_garbage(settings.store, settings.gc, [], inference=served_by, card=card)

    report_goodput(card, settings.run_name, clock, [job.record])  # last: it measures the run up to here
    return NightlyReport(run_name=settings.run_name, job_id=job.record.job_id, checkpoints=len(rows), snapshots=rows,
                         final_step=result.global_step, run_dir=str(run_dir),
                         promotion=promotion.model_dump() if promotion else None,
                         tensorboard_dir=str(trainer.tensorboard_dir) if "tensorboard" in trainer.report_to else None)


def promote_last(settings: NightlySettings, rows: list[dict]):
    """The run's last snapshot, as its inference deployment (staging) serves it, through the eval gate
    to ``promote_to`` (docs/promotion.md); the eval's reward functions default to the run's."""
    last = rows[-1]
    candidate = last.get("served") or last["snapshot"]  # a delta that fell back is served as a full snapshot
    target = PromoteSettings(production=settings.promote_to, staging=settings.inference, store=settings.store,
                             candidate=candidate, tokenizer=settings.base_model, shared_dir=settings.shared_dir,
                             promotion=settings.promotion)
    return run_promotion(target, run=promotion_run(settings.run_name), run_name=settings.run_name,
                         default_reward_funcs=settings.trainer.reward_funcs)


def promotion_run(run_name: str) -> str:
    """Who promotes, in production's lease and history: ``nightly-<flow run id>``, the whole id. It is
    the same for a retry of this flow run (Prefect keeps its id), which takes its own lease over and
    finds its own record; a second nightly with the same ``run_name`` is another holder and loses
    while this one holds the lease. ``run_name`` outside a flow run."""
    return f"nightly-{flow_run.id}" if flow_run.id else run_name
