"""Tasks that publish checkpoints (``Publisher.publish_step``) and hot-load them (the deployment block's loader)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from posttrain.chain.policy import ChainPolicy
from posttrain.inference.contract import HotLoadResult
from posttrain.pipeline.settings import RunSettings
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.retry import transient_only
from posttrain.publish import PublishConfig, PublishedSnapshot, Publisher


def open_publisher(run: RunSettings) -> Publisher:
    """A synchronous publisher of the run's chain into the run's store block; closing it closes the store."""
    store = load_block(run.store, "store").open()
    p = run.publish
    config = PublishConfig(run=run.run_name, work_dir=run.run_dir / "publish", flavor=p.flavor,
                           policy=ChainPolicy(max_deltas=p.max_deltas, delta_budget=p.delta_budget),
                           max_shard_size=p.max_shard_size, retention=p.retention, async_publish=False)
    try:
        return Publisher(store, config, owns_store=True)
    except BaseException:
        store.close()
        raise


@task(name="publish-checkpoint", retries=3, retry_delay_seconds=exponential_backoff(2),
      retry_condition_fn=transient_only, task_run_name="publish-step-{step}")
def publish_checkpoint(checkpoint: str, step: int, run: RunSettings) -> PublishedSnapshot:
    """Encode and upload one checkpoint; a retry finds what was published and uploads nothing."""
    with open_publisher(run) as publisher:
        done = publisher.publish_step(Path(checkpoint), step)
    get_run_logger().info("published %s %s (step %d): %d bytes, uploaded %d", done.kind, done.identity, step,
                          done.stored_bytes, done.uploaded_bytes)
    return done


@task(name="hot-load", retries=2, retry_delay_seconds=exponential_backoff(5), retry_condition_fn=transient_only,
      task_run_name="hot-load-{snapshot.identity}")
def hot_load(snapshot: PublishedSnapshot, run: RunSettings) -> HotLoadResult:
    """Make the deployment serve ``snapshot``; a failed delta falls back to a full snapshot."""
    deployment = load_block(run.inference, "inference")

    def publish_full() -> str:
        with open_publisher(run) as publisher:
            return publisher.publish_full().identity

    base = snapshot.base if snapshot.kind == "delta" else None
    with deployment.hot_loader(publish_full=publish_full) as loader:
        result = loader.hot_load(snapshot.identity, base_identity=base)
    get_run_logger().info("hot-loaded %s in %.1fs%s", result.identity, result.seconds,
                          " (fell back to a full snapshot)" if result.fell_back else "")
    return result
