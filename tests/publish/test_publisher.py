"""Publishing chains: order, back-pressure, rotation, idempotency, crash safety on a real S3 server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.chain.fetch import reconstruct_from_store
from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher
from posttrain.publish.ledger import Ledger
from posttrain.publish.publisher import published_steps
from posttrain.storage import LocalStore, S3Store
from tests.support.tensors import load_bytes


def check_store(store, checkpoints, tmp_path, run: str) -> None:
    """Every step published exactly once, and every version reconstructs bit-exact from the store."""
    steps = published_steps(store, run)
    assert sorted(steps) == list(range(1, len(checkpoints) + 1)), steps
    assert all(len(ids) == 1 for ids in steps.values()), steps
    ledger = Ledger(store, run)
    latest, _ = ledger.latest()
    assert latest is not None and latest.step == len(checkpoints)
    snapshot_dirs = {k.split("/")[0] for k in store.list() if not k.startswith(".")}
    assert snapshot_dirs == {ids[0] for ids in steps.values()}  # nothing half-written left behind
    cache = tmp_path / f"cache-{time.monotonic_ns()}"
    for step, ckpt in enumerate(checkpoints, start=1):
        out = tmp_path / f"check-{time.monotonic_ns()}-{step}"
        reconstruct_from_store(store, steps[step][0], out, cache_dir=cache)
        assert load_bytes(out) == load_bytes(ckpt), f"step {step}"


@pytest.mark.parametrize("async_publish", [False, True])
def test_publish_in_order_to_a_folder_store(run_checkpoints, tmp_path, async_publish):
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=async_publish, queue_size=1,
                           policy=ChainPolicy(max_deltas=3))
    seen = []
    pub = Publisher(store, config, on_published=lambda p: seen.append((p.step, p.kind)))
    for ckpt in run_checkpoints:
        pub.submit(ckpt)
    pub.drain()
    pub.close()
    assert seen == [(1, "full"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "full"), (6, "delta")]
    check_store(store, run_checkpoints, tmp_path, "r1")
    # submitting the same checkpoints again (a retried task) publishes nothing new
    again = Publisher(store, config)
    for ckpt in run_checkpoints:
        again.submit(ckpt)
    assert again.drain() == []


def test_spooled_checkpoints_survive_rotation(run_checkpoints, tmp_path):
    store = LocalStore(tmp_path / "store")
    kept = tmp_path / "kept"
    shutil.copytree(run_checkpoints[0].parent, kept)
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=True, queue_size=6)
    pub = Publisher(store, config)
    for ckpt in run_checkpoints:
        pub.submit(ckpt)
        shutil.rmtree(ckpt)  # save_total_limit rotation deletes it right away
    pub.drain()
    pub.close()
    check_store(store, sorted(kept.iterdir(), key=lambda p: int(p.name.split("-")[1])), tmp_path, "r1")


CRASH_POINTS = [
    "after_spool:1", "after_spool:4", "after_encode:1", "after_encode:3", "after_file:1", "after_file:4",
    "before_index:2", "after_index:1", "after_ledger:3", "after_claim:2", "after_latest:2", "after_cleanup:1",
    "after_promote:5",
]


def publish_cmd(store_uri: str, work: Path, checkpoints, endpoint: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "posttrain", "publish", *map(str, checkpoints), "--store", store_uri,
           "--run", "crash", "--work-dir", str(work), "--max-deltas", "3"]
    if endpoint:
        cmd += ["--endpoint-url", endpoint, "--region", "us-east-1", "--part-size", str(5 << 20)]
    return cmd


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_killed_publisher_finishes_when_run_again(run_checkpoints, tmp_path, point, seaweedfs_bucket):
    endpoint, bucket = seaweedfs_bucket
    prefix = f"crash/{point.replace(':', '-')}-{time.monotonic_ns()}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    cmd = publish_cmd(f"s3://{bucket}/{prefix}", tmp_path / "work", run_checkpoints, endpoint)
    crashed = subprocess.run(cmd, env={**env, "POSTTRAIN_CRASH_AT": point}, capture_output=True, text=True)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    store = S3Store(_config(endpoint, bucket, prefix))
    check_store(store, run_checkpoints, tmp_path, "crash")


def test_killed_at_random_moments(run_checkpoints, tmp_path, seaweedfs_bucket):
    """SIGKILL from outside while encoding and uploading, three times, then a clean run."""
    endpoint, bucket = seaweedfs_bucket
    prefix = f"crash/random-{time.monotonic_ns()}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    cmd = publish_cmd(f"s3://{bucket}/{prefix}", tmp_path / "work", run_checkpoints, endpoint)
    queue = tmp_path / "work" / "queue"
    killed = 0
    for extra in (0.0, 0.05, 0.15):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # once it is publishing (a checkpoint is spooled), kill it a moment later
        while proc.poll() is None and not (queue.is_dir() and any(queue.iterdir())):
            time.sleep(0.005)
        time.sleep(extra)
        proc.send_signal(signal.SIGKILL)
        killed += proc.wait() == -signal.SIGKILL
    assert killed >= 1  # at least one run was cut short (a run that had finished exits 0)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    check_store(S3Store(_config(endpoint, bucket, prefix)), run_checkpoints, tmp_path, "crash")


def _config(endpoint: str, bucket: str, prefix: str):
    from posttrain.storage import S3StoreConfig

    return S3StoreConfig(bucket=bucket, prefix=prefix, endpoint_url=endpoint, region="us-east-1",
                         access_key_id="test", secret_access_key="test", addressing_style="path")


def test_publishing_completes_through_a_faulty_s3_connection(run_checkpoints, tmp_path, seaweedfs_bucket):
    """A proxy fails a fifth of the S3 requests (503 SlowDown and connection resets)."""
    from posttrain.storage import S3StoreConfig
    from posttrain.testing.faultproxy import FaultProxy

    endpoint, bucket = seaweedfs_bucket
    prefix = f"faults/{time.monotonic_ns()}"
    with FaultProxy(endpoint, fault_rate=0.2, seed=7) as proxy:
        store = S3Store(S3StoreConfig(bucket=bucket, prefix=prefix, endpoint_url=proxy.url, region="us-east-1",
                                      access_key_id="test", secret_access_key="test", addressing_style="path",
                                      part_size=5 << 20, max_attempts=8))
        pub = Publisher(store, PublishConfig(run="faulty", work_dir=tmp_path / "work", async_publish=False,
                                             policy=ChainPolicy(max_deltas=3)))
        for ckpt in run_checkpoints:
            pub.submit(ckpt)
        pub.drain()
        stats = dict(proxy.stats)
    assert stats.get("503", 0) > 0 and stats.get("reset", 0) > 0, stats
    check_store(S3Store(_config(endpoint, bucket, prefix)), run_checkpoints, tmp_path, "faulty")


def test_chain_apply_reads_a_store(run_checkpoints, tmp_path):
    """``posttrain chain apply s3://…|file://…`` fetches what the version needs, then rebuilds it."""
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False))
    for ckpt in run_checkpoints[:3]:
        pub.submit(ckpt)
    latest, _ = Ledger(store, "r1").latest()
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "posttrain", "chain", "apply", f"file://{tmp_path / 'store'}",
                           "--version", latest.identity, "--out", str(out), "--cache", str(tmp_path / "cache")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "2 deltas" in proc.stdout
    assert load_bytes(out) == load_bytes(run_checkpoints[2])


def test_retention_removes_only_chains_superseded_twice(run_checkpoints, tmp_path):
    """Opt-in retention keeps the newest chain and the one before it (a consumer may still read it)."""
    store = LocalStore(tmp_path / "store")
    config = PublishConfig(run="r1", work_dir=tmp_path / "work", async_publish=False, retention=True,
                           policy=ChainPolicy(max_deltas=1))
    pub = Publisher(store, config)
    for ckpt in run_checkpoints:
        pub.submit(ckpt)
    kinds = [(p.step, p.kind) for p in pub.published]
    assert kinds == [(1, "full"), (2, "delta"), (3, "full"), (4, "delta"), (5, "full"), (6, "delta")]
    steps = published_steps(store, "r1")
    assert sorted(steps) == [3, 4, 5, 6]
    kept = {k.split("/")[0] for k in store.list() if not k.startswith(".")}
    assert kept == {ids[0] for ids in steps.values()}
    for step in (3, 4, 5, 6):
        out = tmp_path / f"out-{step}"
        reconstruct_from_store(store, steps[step][0], out, cache_dir=tmp_path / "cache")
        assert load_bytes(out) == load_bytes(run_checkpoints[step - 1])
    # without retention nothing is ever deleted
    other = LocalStore(tmp_path / "store2")
    keep_all = Publisher(other, config.model_copy(update={"retention": False, "work_dir": tmp_path / "work2"}))
    for ckpt in run_checkpoints:
        keep_all.submit(ckpt)
    assert sorted(published_steps(other, "r1")) == [1, 2, 3, 4, 5, 6]
