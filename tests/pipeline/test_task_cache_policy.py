"""Every Prefect task of the pipeline is classified: a task with an effect outside its flow run
(submitting a job, publishing, hot-loading, promoting, deleting) never returns a cached result
(``cache_policy=NO_CACHE``); only tasks whose result may be reused on a retry keep Prefect's
default. A new task fails here until it is put in one of the two lists. No Prefect server.

Why: with result persistence on (``PREFECT_RESULTS_PERSIST_BY_DEFAULT``) the default policy
(inputs, task source, flow run id) returned the dead job's record to a retried resident run's
second ``submit``; test_flows_grpo_resident.py runs that retry with persistence on."""

from __future__ import annotations

import importlib
import pkgutil

from prefect import Task
from prefect.cache_policies import NO_CACHE

import posttrain.pipeline.tasks

SIDE_EFFECTING = {
    "submit-training",  # submits a cluster job
    "train-step",  # submits a GRPO round's step job
    "stage-dataset",  # writes the staged dataset on shared storage (a cached manifest may be gone)
    "publish-checkpoint",  # uploads into the store's chain and ledger
    "merge-lora",  # writes a merged folder that publish_weights removes once published
    "pack-lora",  # the same for a packed adapter
    "hot-load",  # switches what a deployment serves
    "evaluate-and-promote",  # switches production and records it
    "roll-back",  # the same
    "collect-garbage",  # deletes from the store
    "check-dask-scheduler",  # no effect, but it looks at a live address: a retry must look again
}
# Reads only, or results valid for the inputs they are keyed by (a shard's reply names its snapshot):
# a retry may reuse them (commit 2afe621 kept the shards' default on purpose).
REUSABLE = {"rollout-shard", "check-blocks", "check-reward-funcs", "check-job-inputs", "latest-snapshot"}


def pipeline_tasks() -> dict[str, Task]:
    found: dict[str, Task] = {}
    for info in pkgutil.iter_modules(posttrain.pipeline.tasks.__path__):
        module = importlib.import_module(f"posttrain.pipeline.tasks.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Task):
                found[value.name] = value
    return found


def test_every_task_is_classified():
    tasks = pipeline_tasks()
    assert set(tasks) == SIDE_EFFECTING | REUSABLE, sorted(set(tasks) ^ (SIDE_EFFECTING | REUSABLE))
    assert not SIDE_EFFECTING & REUSABLE


def test_side_effecting_tasks_never_return_a_cached_result():
    tasks = pipeline_tasks()
    cached = {name: type(tasks[name].cache_policy).__name__ for name in SIDE_EFFECTING
              if tasks[name].cache_policy is not NO_CACHE}
    assert not cached, f"side-effecting tasks with a cache policy: {cached}"


def test_reusable_tasks_keep_prefects_default():
    tasks = pipeline_tasks()
    assert all(tasks[name].cache_policy is not NO_CACHE for name in REUSABLE)
