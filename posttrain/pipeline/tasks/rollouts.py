"""Rollout shards: each samples from the deployment, scores, and writes rollouts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from prefect import flow, get_run_logger, task, unmapped
from prefect.client.orchestration import PrefectClient
from prefect.context import AsyncClientContext, SyncClientContext
from prefect.futures import PrefectFutureList
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings
from prefect.tasks import exponential_backoff
from prefect.utilities.asyncutils import run_coro_as_sync

from posttrain.pipeline.tasks.api_retry import quick_retry_creates
from posttrain.pipeline.tasks.blocks import load_block
from posttrain.pipeline.tasks.retry import transient_only
from posttrain.pipeline.tasks.turns import TURNS
from posttrain.rollouts.shard import RolloutSettings, ShardResult, ShardSpec, run_shard

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


# transformers resolves its names lazily, and not thread-safely: the first shards of a fresh process,
# importing it at once from their threads, failed with "cannot import name 'AutoTokenizer'".
_TOKENIZER_LOCK = threading.Lock()


def _load_tokenizer(path: str):
    """A tokenizer of its own for a shard (a fast tokenizer is not to be shared between threads)."""
    with _TOKENIZER_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def sample_and_score(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    """The shard's work: sample from the deployment, score, write the rollouts. A plain function
    that the subflow calls, not a task of its own: the subflow's state is the work's, and a task
    run inside it cost the server a task run and three state events per shard."""
    deployment = _round_block(inference, spec)
    tokenizer = _load_tokenizer(tokenizer_dir)
    client = deployment.completions()
    try:
        result = run_shard(spec, settings, client, tokenizer)
    finally:
        client.close()
    get_run_logger().info("shard %d of round %d: %d samples, reward %.3f ± %.3f (policy v%d, snapshot %s; ran in %s)",
                          spec.shard, spec.round, result.samples, result.reward_mean, result.reward_std,
                          result.policy_version, result.snapshot_identity or "unknown", result.worker)
    return result


@flow(name="rollout-shard", flow_run_name="round-{spec.round}-shard-{spec.shard}")
def rollout_shard(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    """One shard of a round: sample num_generations completions per prompt, score them."""
    TURNS.started()
    try:
        return sample_and_score(spec, settings, inference, tokenizer_dir)
    finally:
        TURNS.finishing()


def subflow_settings() -> dict:
    """Prefect settings for the shards' subflows: no flow-run heartbeats
    (``flows.heartbeat_frequency``: None). Prefect's sync engine joins a subflow's heartbeat
    thread when the subflow's body returns, and that thread sleeps in 1 s steps, so every shard
    ended 0-1 s late (the slowest of a round's shards nearly a whole second). The parent flow
    runs in the same process and keeps its heartbeats, so a crashed process is still seen."""
    return {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


# Prefect creates a subflow's parent task run (the run that tracks the subflow in the parent flow)
# on its shared event-loop thread, with the async client of the context, else a new one: a new
# client per shard costs a TLS context (Prefect loads the CA certificates even for an http://
# API: ~20 ms of CPU), a new connection, and a CSRF-token request (Prefect's client asks before
# its first write, even where the server checks none). The shards of a process share one client
# on that loop instead, opened once per API (URL, key, CSRF setting) and left open for the
# process's life.
_CLIENTS: dict[tuple, PrefectClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _secret(value) -> str | None:
    return value.get_secret_value() if value else None


def _parent_task_client() -> PrefectClient | None:
    """This process's client for the subflows' parent task runs; None with Prefect's ephemeral
    API (no PREFECT_API_URL), which Prefect serves with clients of its own."""
    api = get_current_settings().api
    if not api.url:
        return None
    key = (str(api.url), _secret(api.key), _secret(api.auth_string),
           get_current_settings().client.csrf_support_enabled)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None or client._closed:  # noqa: SLF001 - closed by someone else: open another

            async def open_on_loop() -> PrefectClient:  # on Prefect's loop, where create_run asks
                client = PrefectClient(str(api.url), api_key=_secret(api.key), auth_string=_secret(api.auth_string))
                quick_retry_creates(client)
                await client.__aenter__()
                return client

            client = _CLIENTS[key] = run_coro_as_sync(open_on_loop())
        return client


def _rollout_shard(spec: ShardSpec, settings: RolloutSettings, inference: str, tokenizer_dir: str) -> ShardResult:
    with TURNS.shard_task(), temporary_settings(updates=subflow_settings()):
        if (flow_client := SyncClientContext.get()) is not None:  # the subflow's engine creates its run with it
            quick_retry_creates(flow_client.client)
        client = _parent_task_client()
        with AsyncClientContext.model_construct(client=client) if client else nullcontext():
            return rollout_shard(spec, settings, inference, tokenizer_dir)


# A task around the subflow: .map() runs the round's shards concurrently, and a failing shard is
# retried alone (its task re-runs only its own subflow).
rollout_shard_task = task(
    _rollout_shard, name="rollout-shard", retries=2, retry_delay_seconds=exponential_backoff(1),
    retry_condition_fn=transient_only, task_run_name="shard-{spec.shard}",
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
    run's context (the API's settings, the parent flow run): it loads the inference block by name,
    opens its own API client, and takes the subflow-start turns of its own process (``TURNS``).
    Prefect retries a failing shard inside its Dask task, on the same worker, alone."""
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
