"""Checks before anything is submitted: the blocks a run names (looked up inside tasks, never
passed around), its reward functions, the paths its job reads, the cluster's launcher and the Dask
scheduler its shards go to."""

from __future__ import annotations

import time

import httpx
from prefect import get_run_logger, task
from prefect.blocks.core import Block
from prefect.cache_policies import NO_CACHE

from posttrain.cluster import preflight
from posttrain.cluster.errors import ConfigError
from posttrain.rollouts.scoring import load_reward_funcs

# A Prefect server whose database restarts answers 500 for a few seconds (a soak found a nightly run
# failed by one): such answers, and a server not answering, are tried again for this long.
BLOCK_LOAD_RETRY_S = 60.0


def _transient(e: Exception) -> bool:
    """The Prefect API failed (a 5xx, or no answer): not a word about the block itself."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(e, httpx.TransportError) or (isinstance(status, int) and status >= 500)


def load_block(ref: str, what: str, *, retry_s: float = BLOCK_LOAD_RETRY_S) -> Block:
    """``ref`` is ``<block-type-slug>/<name>``; the error names the run setting at fault. A failing
    Prefect API (5xx, no answer) is asked again, with backoff, for ``retry_s`` seconds."""
    if "/" not in ref:
        raise ValueError(f"{what}: {ref!r} is not <block-type-slug>/<name>")
    import posttrain.pipeline.blocks  # noqa: F401 - registers posttrain's block classes for Block.load

    deadline, pause = time.monotonic() + retry_s, 1.0
    while True:
        try:
            return Block.load(ref)
        except Exception as e:  # noqa: BLE001 - whatever Block.load raises, name the setting
            if _transient(e) and time.monotonic() + pause < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 10.0)
                continue
            raise ValueError(f"{what}: cannot load block {ref!r} ({type(e).__name__}: {e})") from None


@task(name="check-blocks")
def check_blocks(cluster: str, store: str, inference: str | None) -> None:
    """Load every block the run names before anything is submitted: a missing or broken one fails
    the run here, the error naming its setting (cluster, store or inference)."""
    for what, ref in (("cluster", cluster), ("store", store), ("inference", inference)):
        if ref is not None:
            load_block(ref, what)


@task(name="check-reward-funcs")
def check_reward_funcs(paths: list[str]) -> None:
    """Import the run's reward functions before anything is submitted: an unknown one fails the
    run here, named (``reward_funcs[i]``), not later inside the training job or a rollout shard."""
    load_reward_funcs(paths)


@task(name="check-job-inputs")
def check_job_inputs(cluster: str, base_model: str, dataset: str, shared_dir: str,
                     ref_model: str | None = None) -> None:
    """Before anything is submitted, on the flow's machine: the paths the run reads exist (on Slurm
    the flow runs on the login node, which sees the shared storage; on Kubernetes it mounts the
    PVC where the pods do), the job's paths are on the job's storage, links resolved (the PVC's
    ``pvc_mount``; Slurm's ``shared_dir`` or ``mounts``: the run folder and the staged dataset are
    under the run's ``shared_dir``, so it is checked with ``base_model``), the base model and
    the reference model (``ref_model``: ``ref_model_name_or_path`` when ``beta > 0``; a hub id is
    the job's to download) are model folders, and the cluster's launcher is on the nodes' PATH
    (Slurm: a one-task srun probe, once per cluster settings and process; on Kubernetes it is the
    image's business)."""
    settings = load_block(cluster, "cluster").settings
    # the dataset is read here (the flow stages it into shared_dir); the job reads the other two
    preflight.check_paths(settings, {"base_model": (base_model, "model folder"), "dataset": (dataset, "file"),
                                     "shared_dir": (shared_dir, "folder to create")},
                          job_reads={"base_model", "shared_dir"}, block=cluster)
    if ref_model is not None:
        preflight.check_model_ref(settings, "ref_model_name_or_path", ref_model, block=cluster)
    try:
        note = preflight.check_launcher(settings)
    except ConfigError as e:
        raise ValueError(f"cluster {cluster}: {e}") from None
    if note:
        get_run_logger().warning("cluster %s: %s", cluster, note)


@task(name="check-dask-scheduler", cache_policy=NO_CACHE)  # a retry looks at the address again
def check_dask_scheduler(address: str) -> None:
    """Before the training job is submitted: a scheduler answers at ``dask_address`` (a TCP connect,
    a few seconds at most). Found only at the first round's shards, the resident job would idle
    until its round timeout."""
    note = preflight.check_reachable("dask_address", address)
    if note:
        get_run_logger().info("%s", note)
