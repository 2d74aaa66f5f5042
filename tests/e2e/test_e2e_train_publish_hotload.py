"""Acceptance: real GRPO checkpoints -> Publisher -> real S3 (SeaweedFS) -> reference server hot-loads.

Each checkpoint of a real training run of the tiny model is published as a chain (full, then
deltas) to the bucket and prefix the deployment is configured with, then hot-loaded through
``CoreWeaveHotLoader``. After every load the replicas report the identity, the served weights
are the checkpoint's bit for bit, and greedy completions are those of the checkpoint.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from posttrain.chain.policy import ChainPolicy
from posttrain.publish import PublishConfig, Publisher
from posttrain.rollouts.client import CompletionsClient, CompletionsConfig
from posttrain.storage import S3Store, S3StoreConfig
from tests.e2e.conftest import DEPLOYMENT, MODEL_NAME, TOKEN, TrainedRun, raw_client, s3_options
from tests.support.tensors import load_bytes, tensor_bytes

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def local_greedy(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """What the checkpoint itself answers, sampled in this process (no server, no store)."""
    from transformers import AutoModelForCausalLM

    from posttrain.serve.sampler import sample

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    out = []
    for prompt in prompts:
        (c,) = sample(model, [prompt], n=1, max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0,
                      eos_token_ids={eos}, pad_token_id=model.generation_config.pad_token_id)
        out.append((c.token_ids, c.logprobs))
    return out


def served_greedy(client: CompletionsClient, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in prompts:
        (c,) = client.complete(prompt, n=1, max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0)
        out.append((c.token_ids, c.logprobs))
    return out


def assert_same_answers(served, expected) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(served, expected, strict=True):
        assert ids == want_ids
        assert lps == pytest.approx(want_lps, abs=1e-4)


def test_training_checkpoints_are_published_hot_loaded_and_served(trained_run: TrainedRun, seaweedfs_bucket,
                                                                  tmp_path):
    from pydantic import SecretStr

    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    endpoint, bucket = seaweedfs_bucket
    prefix = f"e2e/{uuid.uuid4().hex[:8]}"  # the deployment's hot-load prefix: the publisher writes exactly there
    store = S3Store(S3StoreConfig(bucket=bucket, prefix=prefix, **s3_options(endpoint)))
    publisher = Publisher(store, PublishConfig(run="e2e", work_dir=tmp_path / "publish", async_publish=True,
                                               policy=ChainPolicy(delta_budget=100.0)))
    server = InferenceServer(ServeConfig(
        model_dir=trained_run.base, served_model_name=MODEL_NAME, port=0, deployment_id=DEPLOYMENT,
        store=f"s3://{bucket}", prefix=prefix, store_options=s3_options(endpoint), token=SecretStr(TOKEN),
        work_dir=tmp_path / "serve", replicas=2, device="cpu",
    )).start()
    loader = CoreWeaveHotLoader(
        HotLoadConfig(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN, poll_interval=0.05, timeout=60),
        publish_full=lambda: publisher.publish_full().identity,
    )
    client = CompletionsClient(CompletionsConfig(gateway_url=server.url, model=MODEL_NAME, token=TOKEN))
    try:
        boot = served_greedy(client, trained_run.prompts)
        assert_same_answers(boot, local_greedy(trained_run.base, trained_run.prompts))
        answers = [boot]
        for step, ckpt in enumerate(trained_run.checkpoints, start=1):
            publisher.submit(ckpt)  # the background thread encodes and uploads it
            published = publisher.drain()[-1]
            assert published.step == step

            result = loader.hot_load(published.identity,
                                     base_identity=published.base if published.kind == "delta" else None)
            assert (result.identity, result.state, result.fell_back) == (published.identity,
                                                                         "HOT_LOAD_STATE_COMPLETED", False)
            replicas = loader.replicas(result.operation_id)
            assert len(replicas) == 2
            assert {(r.state, r.current_snapshot_identity) for r in replicas} == {("READY", published.identity)}
            chain = loader.get_operation(result.operation_id)["status"]["snapshotChain"]
            assert [s["identity"] for s in chain] == [published.identity]  # a delta applies to the held version

            # the served weights are the checkpoint's, bit for bit: on disk and in memory
            served = server.engine.slot.current()
            assert served.identity == published.identity
            want = load_bytes(ckpt)
            assert load_bytes(served.path) == want
            state = served.model.state_dict()
            assert all(tensor_bytes(state[name]) == raw for name, (_, _, raw) in want.items())

            answers.append(served_greedy(client, trained_run.prompts))
            assert_same_answers(answers[-1], local_greedy(ckpt, trained_run.prompts))

        snapshots = publisher.published
        assert [s.kind for s in snapshots] == ["full", "delta", "delta"]
        assert [s.base for s in snapshots] == [None, snapshots[0].identity, snapshots[1].identity]
        assert all(s.stored_bytes < s.raw_bytes for s in snapshots[1:])
        # every snapshot is at <bucket>/<prefix>/<identity>/, its index committed
        keys = {o["Key"] for page in raw_client(endpoint).get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix + "/") for o in page.get("Contents", [])}
        assert {f"{prefix}/{s.identity}/model.safetensors.index.json" for s in snapshots} <= keys

        # the training changed what is served: greedy tokens and their log-probs
        first, last = answers[0], answers[-1]
        for (ids0, lps0), (ids3, lps3) in zip(first, last, strict=True):
            assert ids0 != ids3
            assert lps0[0] != pytest.approx(lps3[0], abs=1e-3)
    finally:
        client.close()
        loader.close()
        server.shutdown()
        publisher.close()
        store.close()
