"""Stage the run's dataset onto shared storage."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from posttrain.datasets.staging import StagedDataset, stage_dataset


@task(name="stage-dataset", cache_policy=NO_CACHE)
def stage(source: str, shared_dir: str) -> StagedDataset:
    """Content-addressed: staging the same data again copies nothing."""
    staged = stage_dataset(source, shared_dir)
    get_run_logger().info("dataset %s: %d rows at %s%s", staged.manifest.digest[:16], staged.manifest.rows,
                          staged.manifest_path, " (already staged)" if staged.already_staged else "")
    return staged
