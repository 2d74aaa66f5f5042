"""Acceptance: real TRL GRPO checkpoints -> Publisher -> real S3 (SeaweedFS) -> the gateway
hot-loads the last into REAL vLLM (CPU build), rebuilding it from the chain (full, delta, delta)
it fetches; vLLM's greedy tokens are then transformers' on that checkpoint and its logprobs within
1e-5. The model has tied embeddings, so the gateway switches it by restarting vLLM. (A model with
untied embeddings, reloaded in place, through full, delta and delta:
tests/serve/vllm/test_vllm_gateway.py; it was a second case here, the same path at 70 s of suite.)"""

from __future__ import annotations

import uuid

import pytest
import requests
from pydantic import SecretStr

from posttrain.chain.policy import ChainPolicy
from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
from posttrain.publish import PublishConfig, Publisher
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.process import VLLMProcessConfig
from posttrain.storage import S3Store, S3StoreConfig
from tests.e2e.conftest import DEPLOYMENT, LEARNING_RATE, MODEL_NAME, TOKEN, s3_options
from tests.support.vllm import Greedy, assert_matches, require_vllm, transformers_greedy, vllm_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()
PROMPTS = [[10, 20, 30, 40], [5, 6, 7, 8, 9, 100, 200]]


def _train(root, tied: bool):
    from posttrain.datasets.staging import stage_dataset
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.trainer import TrainerConfig, run_training

    base = vllm_model(root / "base", tied=tied)
    staged = stage_dataset(write_toy_jsonl(root / "toy.jsonl", n=8, seed=0), root / "datasets")
    result = run_training(TrainerConfig(
        mode="grpo", model_name_or_path=str(base), output_dir=root / "output", dataset_manifest=staged.manifest_path,
        reward_funcs=["posttrain.rewards:correctness_reward", "posttrain.rewards:length_reward"],
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, max_steps=3, save_steps=1, use_cpu=True,
    ))
    assert result.completed and result.global_step == 3
    return base, [root / "output" / f"checkpoint-{step}" for step in (1, 2, 3)]


def _served(url: str) -> tuple[Greedy, str | None]:
    out, identity = [], None
    for prompt in PROMPTS:
        reply = requests.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                              json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                    "logprobs": 1})  # the gateway refuses ignore_eos: assert_matches takes early stops
        assert reply.status_code == 200, reply.text
        body = reply.json()
        out.append((body["choices"][0]["token_ids"], body["choices"][0]["logprobs"]["token_logprobs"]))
        identity = body["snapshot_identity"]
    return out, identity


@pytest.mark.parametrize("tied", [True], ids=["tied"])
def test_trained_checkpoints_are_served_by_vllm_exactly(tied, seaweedfs_bucket, tmp_path):
    base, checkpoints = _train(tmp_path / "run", tied)
    endpoint, bucket = seaweedfs_bucket
    prefix = f"e2e-vllm/{uuid.uuid4().hex[:8]}"
    store = S3Store(S3StoreConfig(bucket=bucket, prefix=prefix, **s3_options(endpoint)))
    publisher = Publisher(store, PublishConfig(run="e2e-vllm", work_dir=tmp_path / "publish", async_publish=False,
                                               policy=ChainPolicy(delta_budget=100.0)), owns_store=True)
    server = InferenceServer(ServeConfig(
        model_dir=base, served_model_name=MODEL_NAME, port=0, deployment_id=DEPLOYMENT, store=f"s3://{bucket}",
        prefix=prefix, store_options=s3_options(endpoint), token=SecretStr(TOKEN), work_dir=tmp_path / "serve",
        engine="vllm", vllm=VLLMProcessConfig(log_file=tmp_path / "vllm.log"),
    )).start()
    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN,
                                              poll_interval=0.1, timeout=300, fallback_to_full=False))
    try:
        booted = _served(server.url)[0]
        assert_matches(booted, transformers_greedy(base, PROMPTS))
        answers = []
        # Tied: each hot-load restarts vLLM (~25 s here); one, of the last delta, whose chain (the full
        # and both deltas) the gateway fetches and rebuilds, shows the restart path.
        loaded = checkpoints[-1:] if tied else checkpoints
        for step, ckpt in enumerate(checkpoints, start=1):
            published = publisher.publish_step(ckpt, step)
            if ckpt not in loaded:
                continue
            pids = set(server.engine.replicas[0].process.pids())
            result = loader.hot_load(published.identity,
                                     base_identity=published.base if published.kind == "delta" else None)
            assert result.identity == published.identity
            got, stamped = _served(server.url)
            assert stamped == published.identity
            assert_matches(got, transformers_greedy(ckpt, PROMPTS))
            restarted = not pids & set(server.engine.replicas[0].process.pids())
            assert restarted == tied, "tied embeddings: a restart on the new weights; untied: a reload in place"
            answers.append(got)
        assert [s.kind for s in publisher.published] == ["full", "delta", "delta"]
        assert booted != answers[-1], "training must change what vLLM serves"
    finally:
        loader.close()
        server.shutdown()
        publisher.close()
