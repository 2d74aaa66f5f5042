"""The grpo flow with its rollouts sampled from REAL vLLM (CPU build) through the hot-load gateway
(``posttrain serve --engine vllm``, started here in a thread): every rollout carries the policy
version of its round and the snapshot identity the flow hot-loaded for it, the gateway served
exactly the identities the flow published, in order, and no rollout comes from any other.

The flow runs in this process against the test Prefect server; its blocks (local cluster, folder
store, the gateway as inference deployment) are saved under their own name, so the default blocks
of the other flow tests are left alone."""

from __future__ import annotations

import secrets

import pytest
from pydantic import SecretStr

from tests.support.vllm import require_vllm, vllm_model

# its blocks are its own (BLOCKS): it runs in the vllm group, beside the orchestration group (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.prefect_own_blocks]
require_vllm()

BLOCKS = "grpo-vllm"
DEPLOYMENT = "dep-grpo-vllm"
MODEL = "tiny"
ROUNDS = 2


def _setup(root, blocks: str, **vllm):
    """The untied vLLM-sized tiny model, toy prompts, a folder store, the vLLM gateway booted from
    the model, and the blocks (named ``blocks``) pointing at them."""
    from posttrain.cluster import LocalConfig
    from posttrain.datasets.toy import write_toy_jsonl
    from posttrain.pipeline.blocks import InferenceDeployment, LocalCluster, ObjectStore
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer
    from posttrain.serve.vllm.process import VLLMProcessConfig

    base = vllm_model(root / "models" / "base", tied=False)  # untied: hot-loads reload in place
    dataset = write_toy_jsonl(root / "data" / "prompts.jsonl", n=8, seed=0, task="mixed")
    store = root / "store"
    store.mkdir()
    token = secrets.token_urlsafe(16)
    gateway = InferenceServer(ServeConfig(
        model_dir=base, served_model_name=MODEL, port=0, deployment_id=DEPLOYMENT, store=str(store),
        token=SecretStr(token), work_dir=root / "gateway", engine="vllm",
        vllm=VLLMProcessConfig(log_file=root / "vllm.log", **vllm))).start()
    try:
        LocalCluster(settings=LocalConfig(folder=str(root / "jobs"))).save(blocks, overwrite=True)
        ObjectStore(uri=str(store)).save(blocks, overwrite=True)
        InferenceDeployment(api_url=gateway.url, gateway_url=gateway.url, deployment_id=DEPLOYMENT, model=MODEL,
                            token=token, timeout_s=300, poll_interval_s=0.2).save(blocks, overwrite=True)
        yield {"root": root, "base": base, "dataset": dataset, "store": store, "gateway": gateway, "token": token,
               "blocks": blocks}
    finally:
        gateway.shutdown()


@pytest.fixture(scope="module")
def vllm_setup(prefect_api, tmp_path_factory):
    """One gateway for both tests (one vLLM start), with LoRA on (adapters loaded at run time, rank up
    to 16): whole-model hot-loads still reload in place."""
    yield from _setup(tmp_path_factory.mktemp("grpo-vllm"), BLOCKS, max_lora_rank=16)


def _settings(s: dict, run_name: str, **more):
    from posttrain.pipeline.settings import GrpoSettings

    blocks = s["blocks"]
    return GrpoSettings(
        run_name=run_name, base_model=str(s["base"]), dataset=str(s["dataset"]),
        shared_dir=str(s["root"] / "shared"), cluster=f"posttrain-local-cluster/{blocks}",
        store=f"posttrain-object-store/{blocks}", inference=f"posttrain-inference-deployment/{blocks}",
        rounds=ROUNDS, prompts_per_round=2, shards=2,
        rollout={"num_generations": 2, "max_completion_length": 4},
        trainer={"learning_rate": 1e-3, "use_cpu": True}, **more,
    )


def _completed_hot_loads(url: str, token: str) -> list[str]:
    """Identities of the gateway's completed hot-load operations, oldest first."""
    import requests

    r = requests.get(f"{url}/v1alpha1/inference/hotLoads", params={"parentDeploymentId": DEPLOYMENT,
                                                                    "maxPageSize": 1000},
                     headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    ops = sorted(r.json()["hotLoads"], key=lambda o: o["status"]["createdAt"])
    return [o["spec"]["identity"] for o in ops if o["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"]


@pytest.mark.timeout(300)
def test_grpo_rounds_sample_from_vllm_and_every_rollout_names_its_version(vllm_setup):
    from pathlib import Path

    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.rollouts.format import load_rollouts

    s = vllm_setup
    before = len(_completed_hot_loads(s["gateway"].url, s["token"]))
    state = grpo(**to_parameters(_settings(s, "flows-grpo-vllm")), return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert [row["round"] for row in report.rounds] == list(range(ROUNDS))

    published = [row["snapshot"] for row in report.rounds]  # what each round published and hot-loaded
    assert len(set(published)) == ROUNDS
    run_dir = Path(report.run_dir)
    seen: set[str | None] = set()
    for r, identity in enumerate(published):
        round_dir = run_dir / "rounds" / f"{r:04d}"
        shards = sorted(round_dir.glob("shard-*.jsonl"))
        assert [p.name for p in shards] == ["shard-000.jsonl", "shard-001.jsonl"]
        rollouts, _ = load_rollouts(round_dir / "rollouts.jsonl")
        assert len(rollouts) == 2 * 2 == report.rounds[r]["samples"]
        assert {(x.policy_version, x.snapshot_identity) for x in rollouts} == {(r, identity)}, f"round {r}"
        seen |= {x.snapshot_identity for x in rollouts}

    # The gateway served exactly the flow's versions, in order: each round's, then the final one.
    assert _completed_hot_loads(s["gateway"].url, s["token"])[before:] == [*published, report.final_snapshot]
    assert seen <= set(published)  # no rollout from a version the flow did not publish
    assert all((s["store"] / identity).is_dir() for identity in [*published, report.final_snapshot])


@pytest.mark.timeout(300)
def test_grpo_lora_adapter_publishing_samples_from_the_adapter_vllm_loaded(vllm_setup):
    """lora_publish: adapter: round 0 publishes the base (a model snapshot, reloaded in place with
    LoRA on), later rounds the adapter alone (its own full snapshot, then a delta), which the gateway
    loads into vLLM at run time; every rollout names the adapter version that sampled it."""
    from pathlib import Path

    from posttrain.pipeline.flows.grpo import grpo
    from posttrain.pipeline.parameters import to_parameters
    from posttrain.rollouts.format import load_rollouts

    s = vllm_setup
    before = len(_completed_hot_loads(s["gateway"].url, s["token"]))
    settings = _settings(s, "flows-grpo-vllm-lora", lora={"use_lora": True, "r": 8, "lora_alpha": 16,
                                                          "target_modules": ["q_proj", "v_proj"],
                                                          "lora_publish": "adapter"})
    state = grpo(**to_parameters(settings), return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    kinds = [row["kind"] for row in report.rounds]
    assert kinds == ["full", "full"]  # the base, then the adapter (another layout: a full snapshot of its own)
    run_dir = Path(report.run_dir)
    for r, identity in enumerate(row["snapshot"] for row in report.rounds):
        rollouts, _ = load_rollouts(run_dir / "rounds" / f"{r:04d}" / "rollouts.jsonl")
        assert {(x.policy_version, x.snapshot_identity) for x in rollouts} == {(r, identity)}, f"round {r}"
    published = [row["snapshot"] for row in report.rounds]
    assert _completed_hot_loads(s["gateway"].url, s["token"])[before:] == [*published, report.final_snapshot]
    served = s["gateway"].engine.current()
    assert served.identity == report.final_snapshot and (served.path / "peft" / "adapter_config.json").is_file()
    assert not (run_dir / "packed").exists() or not any((run_dir / "packed").iterdir())  # removed once published
