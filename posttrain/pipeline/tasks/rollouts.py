"""Rollout shards: each samples from the deployment, scores, and writes rollouts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task, unmapped
from prefect.futures import PrefectFutureList
from prefect.tasks import exponential_backoff

from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.retry import transient_only
from posttrain.rollouts.shard import RolloutSettings, ShardResult, ShardSpec, run_shard
from posttrain.rollouts.tokenizers import shard_tokenizer
from posttrain.words import plural

# The shards of a round load the inference block once per process (one API call instead of one
# per shard): keyed by the block and the round's folder, which names the run and the round.
_BLOCKS: dict[tuple[str, str], object] = {}
_BLOCKS_LOCK = threading.Lock()


def _round_block(inference: str, spec: ShardSpec):
    key = (inference, str(spec.out_path.parent))
    with _BLOCKS_LOCK:
        if key not in _BLOCKS:
            if len(_BLOCKS) >= 8:
                _BLOCKS.clear()
            _BLOCKS[key] = load_block(inference, "inference")
        return _BLOCKS[key]


def sample_and_score(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    """One shard of a round: sample ``num_generations`` completions per prompt from the deployment,
    score them, write the rollouts (the ``rollout-shard`` task's body)."""
    deployment = _round_block(inference, spec)
    tokenizer = shard_tokenizer(tokenizer_dir)
    client = deployment.completions()
    try:
        result = run_shard(spec, settings, client, tokenizer)
    finally:
        client.close()
    get_run_logger().info("shard %d of round %d: %s, reward %.3f ± %.3f (policy v%d, snapshot %s; ran in %s)",
                          spec.shard, spec.round, plural(result.samples, "sample"), result.reward_mean,
                          result.reward_std,
                          result.policy_version, result.snapshot_identity or "unknown", result.worker)
    return result


# One task per shard, mapped: the round's shards run concurrently and a failing shard is retried
# alone. A task, not a subflow: Prefect 3 records a task run's states as events, with no API
# request of its own, while a subflow cost about nine requests to start and end (a parent task
# run, the flow run, its states: 73 per round of 8 shards, 527 of 64) and, on SQLite, 503s that
# the shards had to take turns to avoid. Measured by bench/prefect_overhead.py against the same
# rounds without Prefect: 64 shards on PostgreSQL took 1.93x that floor as subflows, 1.14x as
# tasks (docs/prefect.md).
rollout_shard_task = task(
    sample_and_score, name="rollout-shard", retries=2, retry_delay_seconds=exponential_backoff(1),
    retry_condition_fn=transient_only, task_run_name="round-{spec.round}-shard-{spec.shard}",
)


@contextmanager
def shard_runner(task_runner: str, dask_address: str | None = None, dask_workers: int | None = None,
                 ) -> Iterator[object | None]:
    """Where a run's shards go, open for the run's rounds: None for ``threads`` (the flow's own task
    runner, threads in the flow's process), else a started ``DaskTaskRunner`` of prefect-dask, on
    the scheduler at ``dask_address`` or on a temporary local cluster of ``dask_workers`` worker
    processes (started at the first round's shards, stopped on leaving).

    A flow's task runner is fixed by its ``@flow`` decorator; the GRPO flow keeps the default and
    maps the shards on this one instead. Each shard task is pickled to a Dask worker with the flow
    run's context (the API's settings, the parent flow run): it loads the inference block by name
    and opens its own API client. Prefect retries a failing shard inside its Dask task, on the same
    worker, alone."""
    if task_runner == "threads":
        yield None
        return
    from prefect_dask import DaskTaskRunner

    if dask_address:
        runner = DaskTaskRunner(address=dask_address)
    else:
        # Worker processes (Dask's default), so that a CPU-bound reward function of one shard does
        # not hold the GIL of another; no dashboard on a fixed port (":0": a free one, logged).
        cluster = {"processes": True, "dashboard_address": ":0"}
        if dask_workers:
            cluster["n_workers"] = dask_workers
        runner = DaskTaskRunner(cluster_kwargs=cluster)
    with runner:
        yield runner


def map_shards(runner, specs: list[ShardSpec], settings: RolloutSettings, inference: str | None,
               tokenizer_dir: str) -> PrefectFutureList:
    """The round's shard tasks, one per spec, submitted at once: on the flow's task runner (``runner``
    None) or on ``runner`` (``shard_runner``'s)."""
    if runner is None:
        return rollout_shard_task.map(specs, unmapped(settings), unmapped(inference), unmapped(tokenizer_dir))
    return runner.map(rollout_shard_task, {"spec": specs, "settings": unmapped(settings),
                                           "inference": unmapped(inference), "tokenizer_dir": unmapped(tokenizer_dir)})
