"""The real model (SmolLM2-135M-Instruct, bfloat16, 30 layers) through the loop's right-hand column:
a GRPO step trained in float32 is saved in bfloat16, the base is published full and the step as a
delta, and the reference server hot-loads both, reads them back by digest and accepts the probe
(no correct snapshot refused; before the dtype work its first hot-load failed here), then serves the
step's greedy answers exactly as transformers computes them on the checkpoint."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = pytest.mark.slow

PROMPTS = ["What is 12 + 9? Reply with only the number.", "What is 7 × 6? Reply with only the number."]


@pytest.fixture(scope="module")
def stepped(real_model_dir, tmp_path_factory):
    """checkpoint-1: one GRPO step of the real model on 8 rollouts it sampled (lr 5e-6)."""
    from posttrain.rollouts.format import write_rollouts
    from posttrain.tasks.arithmetic import arithmetic_correct
    from posttrain.testing.sampler import sample_rollouts
    from posttrain.trainer import TrainerConfig, run_training

    root = tmp_path_factory.mktemp("real-step")
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a in zip(PROMPTS, ("21", "42"), strict=True)]
    rollouts = sample_rollouts(real_model_dir, rows, group_size=4, max_new_tokens=8, reward_func=arithmetic_correct)
    config = TrainerConfig(mode="step", model_name_or_path=str(real_model_dir), output_dir=str(root / "out"),
                           rollouts=str(write_rollouts(root / "rollouts.jsonl", rollouts)), learning_rate=5e-6,
                           per_device_train_batch_size=8, use_cpu=True, report_to=["none"])
    return root, run_training(config).checkpoint


@pytest.mark.timeout(900)
def test_the_real_model_in_bfloat16_is_published_and_hot_loaded_full_and_delta(real_model_dir, stepped):
    from pydantic import SecretStr
    from transformers import AutoTokenizer

    from posttrain.chain.safetensors_io import read_header
    from posttrain.chain.writer import ChainWriter
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer
    from tests.support.serving import Api, local_greedy

    root, checkpoint = stepped
    assert {t.dtype for t in read_header(checkpoint / "model.safetensors").tensors.values()} == {"BF16"}
    writer = ChainWriter(root / "store" / "runs" / "real", run="real")
    full = writer.add(real_model_dir, step=0)
    delta = writer.add(checkpoint, base=real_model_dir, step=1)
    assert (full.kind, delta.kind) == ("full", "delta")
    assert delta.stored_bytes < 0.6 * full.stored_bytes  # one small step: most bf16 bits unchanged

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    server = InferenceServer(ServeConfig(model_dir=real_model_dir, port=0, deployment_id="real", store=str(root / "store"),
                                         prefix="runs/real", token=SecretStr("tok-real"), work_dir=root / "work",
                                         served_model_name="smollm2", idle_probe_interval_s=None)).start()
    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id="real", token="tok-real",
                                              poll_interval=0.2, timeout=600, request_timeout=120))
    try:
        api = Api(server.url)
        api.headers = {"Authorization": "Bearer tok-real"}
        for identity, base in ((full.identity, None), (delta.identity, full.identity)):
            done = loader.hot_load(identity, base_identity=base)  # FAILED (a probe refusal) raises
            assert done.identity == identity
        reply = api.complete(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        assert reply["snapshot_identity"] == delta.identity
        expected = local_greedy(checkpoint, prompt, max_tokens=8)
        assert reply["choices"][0]["token_ids"] == expected
    finally:
        loader.close()
        server.shutdown()
