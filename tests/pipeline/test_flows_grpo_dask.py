"""GRPO rollout shards on Dask (``task_runner: dask``): the grpo flow runs in this process and maps
a round's shards on a local Dask cluster of two worker processes started here (``dask_address``).

Each shard task is pickled to a worker with the flow run's context; there it starts its
``rollout-shard`` task against the Prefect server, samples from the reference inference server
and scores with the toy rewards of tests/pipeline/flaky.py. What ran where is read from the Dask
scheduler's task stream; what ran when, from the Prefect server (the task runs and their states)."""

from __future__ import annotations

import os
import time

import pytest

from tests.pipeline.flaky import FLAKY_MARKER_ENV, SLOW_SECONDS_ENV
from tests.pipeline.runs import assert_one_shard_retried, flow_run_logs, overlapping, shard_runs
from tests.pipeline.test_flows_grpo_shards import grpo_settings, run_grpo

pytestmark = pytest.mark.slow

SLOW_S = 2.0
WORKERS = 2


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """Two Dask worker processes of one thread each, on 127.0.0.1, and a client of the cluster (not
    the default one: the flow's DaskTaskRunner would take a default client's cluster, not the address).
    The toy rewards read their settings from the workers' environment: a shard of slow_reward lasts
    2 s a prompt, and flaky_reward fails once per cluster (the first call creates the marker)."""
    from distributed import Client, LocalCluster

    marker = tmp_path_factory.mktemp("dask") / "flaky-fired"
    env = {SLOW_SECONDS_ENV: str(SLOW_S), FLAKY_MARKER_ENV: str(marker)}
    with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None, env=env) as cluster, Client(cluster, set_as_default=False) as client:
        # What every shard imports, once per worker before the runs (not part of what is measured).
        client.run(lambda: __import__("posttrain.pipeline.tasks.rollouts") and __import__("transformers"))
        yield cluster, client, marker


def dask_settings(setup, run_name: str, cluster, *, shards: int, reward_funcs: list[str]):
    return grpo_settings(setup, run_name, shards=shards, reward_funcs=reward_funcs).model_copy(
        update={"task_runner": "dask", "dask_address": cluster.scheduler_address})


def shard_tasks_by_worker(stream: list[dict]) -> dict[str, int]:
    """The Dask tasks of the shards in a task stream (keys ``sample_and_score-<token>``, after the
    task's function), counted per worker address."""
    counts: dict[str, int] = {}
    for t in stream:
        if str(t["key"]).startswith("sample_and_score-"):
            counts[t["worker"]] = counts.get(t["worker"], 0) + 1
    return counts


@pytest.mark.timeout(240)
def test_the_shards_of_a_round_run_on_both_dask_workers(tiny_setup, dask_cluster):
    from distributed import get_task_stream

    cluster, client, _ = dask_cluster
    settings = dask_settings(tiny_setup, "flows-grpo-dask", cluster, shards=4,
                             reward_funcs=["tests.pipeline.flaky:slow_reward"])
    with get_task_stream(client) as stream:
        state, flow_run_id = run_grpo(settings)
    assert state.is_completed(), state.message
    assert state.result().rounds[0]["samples"] > 0

    # Four shard tasks, on both workers (and nowhere else).
    by_worker = shard_tasks_by_worker(stream.data)
    assert sum(by_worker.values()) == 4, stream.data
    assert set(by_worker) == set(cluster.scheduler_info["workers"]), by_worker

    # They ran on the workers, two at a time: 4 shards of 2 s in about 2 x 2 s. On the flow's
    # threads all four would overlap; one after the other, none would.
    shards = shard_runs(flow_run_id)
    assert sorted(shards) == [f"round-0-shard-{s}" for s in range(4)]
    assert all(r.state.is_completed() and r.run_count == 1 for r in shards.values())
    intervals = [(r.start_time.timestamp(), r.end_time.timestamp()) for r in shards.values()]
    spans = {name: f"{r.start_time:%H:%M:%S.%f} .. {r.end_time:%H:%M:%S.%f}" for name, r in shards.items()}
    assert overlapping(intervals) == WORKERS, f"not two shards at a time: {spans}"
    busy = sum(e - s for s, e in intervals)
    wall = max(e for _, e in intervals) - min(s for s, _ in intervals)
    assert busy >= 4 * SLOW_S and wall < busy, spans

    # Each shard's log line (its task run's, in the flow run), sent to the API from its worker,
    # names the process that ran it (ShardResult.worker).
    pids = {str(pid) for pid in client.run(os.getpid).values()}
    ran_in: dict[str, str] = {}
    deadline = time.monotonic() + 60  # the workers send their logs in the background
    while len(ran_in) < 4 and time.monotonic() < deadline:
        found = [m for m in flow_run_logs(flow_run_id) if "; ran in " in m]
        ran_in = {m.split(" of ")[0]: m.rsplit(":", 1)[1].rstrip(")") for m in found}
        time.sleep(0.5)
    assert len(ran_in) == 4 and set(ran_in.values()) == pids, (ran_in, pids)


@pytest.mark.timeout(240)
def test_a_failing_shard_on_dask_is_retried_alone(tiny_setup, dask_cluster):
    from distributed import get_task_stream

    cluster, client, marker = dask_cluster
    settings = dask_settings(tiny_setup, "flows-grpo-dask-flaky", cluster, shards=3,
                             reward_funcs=["tests.pipeline.flaky:flaky_reward"])
    with get_task_stream(client) as stream:
        state, flow_run_id = run_grpo(settings)
    assert state.is_completed(), state.message
    # The failure happened in a worker process, not in this one, and Prefect retried the shard
    # inside its Dask task: three Dask tasks for three shards.
    pid = int(marker.read_text())
    worker_pids = set(client.run(os.getpid).values())
    assert pid in worker_pids, (pid, worker_pids)
    assert sum(shard_tasks_by_worker(stream.data).values()) == 3, stream.data

    assert_one_shard_retried(flow_run_id, shards=3)

    # The round merged all three shards.
    name = f"flows-grpo-dask-flaky-{str(flow_run_id).replace('-', '')[:8]}"
    round_dir = tiny_setup.shared_dir / "runs" / name / "rounds" / "0000"
    assert sorted(p.name for p in round_dir.glob("shard-*.jsonl")) == [f"shard-{s:03d}.jsonl" for s in range(3)]
    assert state.result().rounds[0]["samples"] > 0


@pytest.mark.timeout(240)
def test_an_unreachable_dask_address_fails_the_run_before_its_job_is_submitted(tiny_setup):
    """It was found at the first round's shards, after the resident job was submitted: the job then
    idled until its round timeout."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = grpo_settings(tiny_setup, "flows-grpo-dask-down", shards=1,
                             reward_funcs=["posttrain.rewards:format_reward"]).model_copy(
        update={"task_runner": "dask", "dask_address": f"tcp://127.0.0.1:{port}"})
    state, flow_run_id = run_grpo(settings)
    assert state.is_failed(), state.message
    assert f"dask_address: nothing answers at tcp://127.0.0.1:{port}" in state.message, state.message
    name = f"flows-grpo-dask-down-{str(flow_run_id).replace('-', '')[:8]}"
    assert not list((tiny_setup.shared_dir / "runs" / name).glob("*submit*"))
    assert not (tiny_setup.jobs_dir.exists() and list(tiny_setup.jobs_dir.glob(f"{name}*")))
