"""The real model (SmolLM2-135M-Instruct, bfloat16, 30 layers) through the loop's right-hand column:
a GRPO step trained in float32 is saved in bfloat16, the base is published full and the step as a
delta, and each engine hot-loads both, reads them back by digest and accepts the probe (no correct
snapshot refused; before the dtype work the reference server's first hot-load failed here): the
reference server then serves the step's greedy answers exactly as transformers computes them on the
checkpoint, and vLLM (CPU build, bfloat16; the model's LM head is tied to its embeddings, so each
hot-load restarts it on the rebuilt folder) serves the step, its answer to the arithmetic prompt
transformers'."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = pytest.mark.slow
TOKEN = "tok-real"

PROMPTS = ["What is 12 + 9? Reply with only the number.", "What is 7 × 6? Reply with only the number."]


@pytest.fixture(scope="module")
def chain(real_model_dir, stepped):
    """The base published full, the step as a delta against it (a folder store)."""
    from posttrain.chain.writer import ChainWriter

    root, checkpoint = stepped
    writer = ChainWriter(root / "store" / "runs" / "real", run="real")
    full = writer.add(real_model_dir, step=0)
    delta = writer.add(checkpoint, base=real_model_dir, step=1)
    return {"store": root / "store", "full": full, "delta": delta, "checkpoint": checkpoint}


def serve_config(model_dir, root, **fields):
    from pydantic import SecretStr

    from posttrain.serve.serve_config import ServeConfig

    return ServeConfig(model_dir=model_dir, port=0, deployment_id="real", store=str(root / "store"), prefix="runs/real",
                       token=SecretStr(TOKEN), served_model_name="smollm2", idle_probe_interval_s=None, **fields)


def hot_load_chain(server, chain) -> None:
    """Hot-load the full snapshot, then the delta; a FAILED one (a probe or readback refusal) raises."""
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id="real", token=TOKEN,
                                              poll_interval=0.2, timeout=600, request_timeout=120))
    try:
        for identity, base in ((chain["full"].identity, None), (chain["delta"].identity, chain["full"].identity)):
            assert loader.hot_load(identity, base_identity=base).identity == identity
    finally:
        loader.close()


def chat_ids(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


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
def test_the_real_model_in_bfloat16_is_published_and_hot_loaded_full_and_delta(real_model_dir, stepped, chain):
    from posttrain.chain.safetensors_io import read_header
    from posttrain.serve.server import InferenceServer
    from tests.support.serving import Api, local_greedy

    root, checkpoint = stepped
    assert {t.dtype for t in read_header(checkpoint / "model.safetensors").tensors.values()} == {"BF16"}
    full, delta = chain["full"], chain["delta"]
    assert (full.kind, delta.kind) == ("full", "delta")
    assert delta.stored_bytes < 0.6 * full.stored_bytes  # one small step: most bf16 bits unchanged

    prompt = chat_ids(real_model_dir, PROMPTS[0])
    server = InferenceServer(serve_config(real_model_dir, root, work_dir=root / "work")).start()
    try:
        hot_load_chain(server, chain)
        api = Api(server.url)
        api.headers = {"Authorization": f"Bearer {TOKEN}"}
        reply = api.complete(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        assert reply["snapshot_identity"] == delta.identity
        assert reply["choices"][0]["token_ids"] == local_greedy(checkpoint, prompt, max_tokens=8)
    finally:
        server.shutdown()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_hot_loads_the_real_model_full_and_delta_and_answers_as_transformers(real_model_dir, stepped, chain, tmp_path):
    from posttrain.serve.server import InferenceServer
    from posttrain.serve.vllm.process import VLLMProcessConfig
    from tests.support.serving import Api, local_greedy
    from tests.support.vllm import require_vllm

    require_vllm()
    root, checkpoint = stepped
    config = serve_config(real_model_dir, root, work_dir=tmp_path / "work", engine="vllm",
                          vllm=VLLMProcessConfig(log_file=tmp_path / "vllm.log", dtype="auto"))
    prompt = chat_ids(real_model_dir, PROMPTS[0])
    server = InferenceServer(config).start()
    try:
        assert server.engine.engine_dtype == "bfloat16"  # asked of vLLM: the model's own dtype
        hot_load_chain(server, chain)  # each verified by digest and probe in bfloat16, none refused
        api = Api(server.url)
        api.headers = {"Authorization": f"Bearer {TOKEN}"}
        reply = api.complete(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        assert reply["snapshot_identity"] == chain["delta"].identity
        # vLLM's bfloat16 kernels are not transformers' bit for bit; the answer to the sum is the same
        answer = reply["choices"][0]["token_ids"]
        assert answer[:4] == local_greedy(checkpoint, prompt, max_tokens=8)[:4], (answer, reply["choices"][0]["text"])
    finally:
        server.shutdown()
