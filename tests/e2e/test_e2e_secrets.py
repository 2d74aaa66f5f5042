"""Acceptance: a planted API token and a planted S3 secret key never show in logs, errors or output.

Runs ``posttrain publish`` (S3 secret from AWS_SECRET_ACCESS_KEY) against the real S3 server
and against a closed port, ``posttrain serve`` (token from --token-env) with its log captured,
hot-loads through the client (a good one, a missing snapshot, a wrong token), completions with
a wrong token and an in-process publisher that fails; everything said is grepped for both.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import pytest
import requests

from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher, PublishError
from posttrain.rollouts.client import CompletionsClient, CompletionsConfig, CompletionsError
from posttrain.storage import S3Store, S3StoreConfig, StorageError
from tests.e2e.conftest import (
    DEPLOYMENT,
    MODEL_NAME,
    S3_KEY_ID,
    S3_SECRET,
    TOKEN,
    TrainedRun,
    free_port,
    s3_options,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PUBLISHED = re.compile(r"published (full|delta) (\S+) \(step (\d+)\)")


def posttrain(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def error_text(info: pytest.ExceptionInfo) -> str:
    return "".join(traceback.format_exception(info.value))


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if requests.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "posttrain serve did not start:\n" + log.read_text()
        time.sleep(0.2)


def test_planted_token_and_s3_secret_never_show(trained_run: TrainedRun, seaweedfs_bucket, tmp_path, caplog):
    from posttrain.inference.contract import HotLoadAPIError, HotLoadFailed
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    caplog.set_level(logging.DEBUG, logger="posttrain")
    endpoint, bucket = seaweedfs_bucket
    prefix = f"secrets/{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
           "E2E_API_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    said: list[str] = []  # everything any command, log or error said

    # posttrain publish: the secret key from the environment, to the real server...
    ckpts = [str(c) for c in trained_run.checkpoints[:2]]
    done = posttrain("publish", *ckpts, "--store", f"s3://{bucket}/{prefix}", "--run", "sec", "--work-dir",
                     str(tmp_path / "pub"), "--endpoint-url", endpoint, "--region", "us-east-1", env=env)
    said += [done.stdout, done.stderr]
    assert done.returncode == 0, done.stderr
    published = PUBLISHED.findall(done.stdout)
    assert [(kind, int(step)) for kind, _, step in published] == [("full", 1), ("delta", 2)], done.stdout
    full, delta = (identity for _, identity, _ in published)
    # ... and to a closed port, so that every request fails
    closed = f"http://127.0.0.1:{free_port()}"
    failed = posttrain("publish", ckpts[0], "--store", f"s3://{bucket}/{prefix}-closed", "--run", "sec",
                       "--work-dir", str(tmp_path / "pub-closed"), "--endpoint-url", closed, "--region", "us-east-1",
                       "--outage-retry", "0", env=env)
    said += [failed.stdout, failed.stderr]
    assert failed.returncode != 0 and closed in failed.stderr, failed.stderr

    # the same failure in process: the exception and its whole chain
    store = S3Store(S3StoreConfig(bucket=bucket, prefix="p", **{**s3_options(closed), "max_attempts": 2, "outage_retry_s": 0}))
    publisher = Publisher(store, PublishConfig(run="sec", work_dir=tmp_path / "pub-inproc", async_publish=False,
                                               policy=ChainPolicy()))
    with pytest.raises((PublishError, StorageError), match=re.escape(closed)) as info:
        publisher.submit(trained_run.checkpoints[0])
    said.append(error_text(info))
    publisher.close()
    store.close()

    # posttrain serve: the token from --token-env, the S3 secret key from the environment
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "posttrain", "serve", "--model", str(trained_run.base), "--port", str(port),
             "--served-model-name", MODEL_NAME, "--deployment-id", DEPLOYMENT, "--store", f"s3://{bucket}",
             "--prefix", prefix, "--s3-endpoint-url", endpoint, "--s3-region", "us-east-1",
             "--token-env", "E2E_API_TOKEN", "--work-dir", str(tmp_path / "serve"), "--device", "cpu",
             "--log-level", "info"],  # debug would add botocore's own DEBUG records
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        fields = dict(api_url=url, deployment_id=DEPLOYMENT, poll_interval=0.05, timeout=60, backoff_base=0.01)
        with CoreWeaveHotLoader(HotLoadConfig(token=TOKEN, **fields)) as client:
            said.append(repr(client) + repr(client.config) + str(client.config))
            client.hot_load(full)
            assert client.hot_load(delta, base_identity=full).identity == delta
            with pytest.raises(HotLoadFailed, match="not in the store") as info:
                client.hot_load("step-99999999-missing")
            said.append(error_text(info))
        with CoreWeaveHotLoader(HotLoadConfig(token="tok-WRONG-0000", **fields)) as wrong:
            with pytest.raises(HotLoadAPIError, match="HTTP 401") as info:
                wrong.hot_load(delta, base_identity=full)
            assert info.value.status == 401
            said.append(error_text(info))
        rollouts = CompletionsClient(CompletionsConfig(gateway_url=url, model=MODEL_NAME, token="tok-WRONG-0000"))
        with pytest.raises(CompletionsError, match="HTTP 401") as info:
            rollouts.complete(trained_run.prompts[0], n=1, max_tokens=4, temperature=0.0, top_p=1.0)
        rollouts.close()
        said.append(error_text(info))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    served_log = log.read_text()
    said.append(served_log)
    assert rc == 0, served_log
    assert "COMPLETED" in served_log and "FAILED" in served_log and " 401 " in served_log  # it did log all that

    said.append(caplog.text)
    said += [f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records]
    assert any("hot-load" in r.getMessage() for r in caplog.records)
    everything = "\n".join(said)
    assert TOKEN not in everything
    assert "tok-WRONG-0000" not in everything  # the token a failing call sent is a secret too
    assert S3_SECRET not in everything
