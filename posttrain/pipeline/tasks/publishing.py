"""Tasks that publish checkpoints (``Publisher.publish_step``), merge LoRA checkpoints into their
base first (``lora.merge``) or pack them to travel alone (``lora.packed``), and hot-load them (the
deployment block's loader)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from posttrain.chain.policy import ChainPolicy
from posttrain.inference.contract import HotLoadResult
from posttrain.lora import is_adapter_dir
from posttrain.lora.merge import merge_adapter
from posttrain.lora.packed import pack_adapter
from posttrain.pipeline.settings import RunSettings
from posttrain.pipeline.tasks import events
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.retry import is_transient, transient_only
from posttrain.publish import PublishConfig, PublishedSnapshot, Publisher
from posttrain.publish.content import saved_at


def publish_config(run: RunSettings) -> PublishConfig:
    """The publisher's settings for a run's chain: synchronous, its work folder in the run's folder."""
    p = run.publish
    return PublishConfig(run=run.run_name, work_dir=run.run_dir / "publish", flavor=p.flavor,
                         policy=ChainPolicy(max_deltas=p.max_deltas, delta_budget=p.delta_budget),
                         max_shard_size=p.max_shard_size, retention=p.retention, async_publish=False)


def open_publisher(run: RunSettings) -> Publisher:
    """A synchronous publisher of the run's chain into the run's store block; closing it closes the store."""
    config = publish_config(run)
    store = load_block(run.store, "store").open()
    try:
        return Publisher(store, config, owns_store=True)
    except BaseException:
        store.close()
        raise


@task(name="publish-checkpoint", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(2),
      retry_condition_fn=transient_only, task_run_name="publish-step-{step}")
def publish_checkpoint(checkpoint: str, step: int, run: RunSettings) -> PublishedSnapshot:
    """Encode and upload one checkpoint; a retry finds what was published and uploads nothing."""
    with open_publisher(run) as publisher:
        done = publisher.publish_step(Path(checkpoint), step)
    saved = saved_at(Path(checkpoint))
    lag = time.time() - saved if saved is not None else None  # saved -> published (docs/metrics.md)
    get_run_logger().info("published %s %s (step %d): %d bytes, uploaded %d%s", done.kind, done.identity, step,
                          done.stored_bytes, done.uploaded_bytes, f"; {lag:.1f}s after it was saved" if lag else "")
    events.snapshot_published(run.run_name, run.store, done, publish_lag_seconds=lag)
    return done


@task(name="merge-lora", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(2),
      retry_condition_fn=transient_only, task_run_name="merge-step-{step}")
def merge_lora(adapter: str, step: int, run: RunSettings) -> str:
    """Merge a LoRA checkpoint into the run's base: ``<run dir>/merged/checkpoint-<step>``, a model
    folder the publisher encodes like any other. A merge left by an earlier attempt is complete (it
    is moved into place only when finished) and is used as it is."""
    out = run.run_dir / "merged" / f"checkpoint-{step}"
    if not out.exists():
        result = merge_adapter(adapter, run.base_model, out)
        get_run_logger().info("merged %s into %s: %d of %d tensors changed", adapter, run.base_model,
                              result.merged_tensors, result.total_tensors)
    return str(out)


@task(name="pack-lora", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(2),
      retry_condition_fn=transient_only, task_run_name="pack-step-{step}")
def pack_lora(adapter: str, step: int, run: RunSettings) -> str:
    """Pack a LoRA checkpoint to be published alone: ``<run dir>/packed/checkpoint-<step>``. It must
    have been trained on the run's base (by fingerprint), else nothing is packed or published."""
    out = run.run_dir / "packed" / f"checkpoint-{step}"
    if not out.exists():
        pack_adapter(adapter, out, base_dir=run.base_model)
    return str(out)


def publish_weights(checkpoint: str, step: int, run: RunSettings) -> PublishedSnapshot:
    """Publish a checkpoint. A LoRA checkpoint is merged into the base first (``lora_publish: merged``)
    or packed to travel alone (``adapter``), through the same publisher, ledger and chain, and the
    merged or packed folder is removed once published (the publisher keeps its own copy as the next base)."""
    if not (run.lora.use_lora and is_adapter_dir(checkpoint)):
        return publish_checkpoint(checkpoint, step, run)
    prepared = (merge_lora if run.lora.lora_publish == "merged" else pack_lora)(checkpoint, step, run)
    snapshot = publish_checkpoint(prepared, step, run)
    shutil.rmtree(prepared, ignore_errors=True)
    return snapshot


def retried(exc: BaseException) -> bool:
    """Whether the running task will be retried after raising ``exc`` (its retry condition, and
    retries left)."""
    context = TaskRunContext.get()
    if context is None or not is_transient(exc):
        return False
    return context.task_run.run_count <= (context.task.retries or 0)


@task(name="hot-load", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(5), retry_condition_fn=transient_only,
      task_run_name="hot-load-{snapshot.identity}")
def hot_load(snapshot: PublishedSnapshot, run: RunSettings) -> HotLoadResult:
    """Make the deployment serve ``snapshot``; a failed delta falls back to a full snapshot."""
    deployment = load_block(run.inference, "inference")

    def publish_full() -> str:
        with open_publisher(run) as publisher:
            full = publisher.publish_full()
        events.snapshot_published(run.run_name, run.store, full)
        return full.identity

    base = snapshot.base if snapshot.kind == "delta" else None
    where = {"deployment_id": getattr(deployment, "deployment_id", None)}
    try:
        with deployment.hot_loader(publish_full=publish_full) as loader:
            result = loader.hot_load(snapshot.identity, base_identity=base)
    except Exception as e:
        token = getattr(deployment, "token", None)
        secrets = (token.get_secret_value(),) if token is not None else ()
        events.hotload_failed(run.run_name, run.inference, snapshot.identity, e, will_retry=retried(e),
                              secrets=secrets, **where)
        raise
    events.hotload_succeeded(run.run_name, run.inference, snapshot.identity, result, **where)
    get_run_logger().info("hot-loaded %s in %.1fs%s", result.identity, result.seconds,
                          " (fell back to a full snapshot)" if result.fell_back else "")
    return result
