"""A gateway over REAL vLLM on a chain of the tiny untied (or tied) model: shared by tests/serve/vllm/test_vllm_gateway.py
and test_vllm_at_url.py (a module of its own: no gateway's engine is alive while its engines start; one whose
gateway probes it keeps vLLM's worker busy on the core a second engine's worker is pinned to)."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.process import VLLMProcessConfig
from tests.support.serving import DEPLOYMENT, PREFIX, TOKEN, Api
from tests.support.vllm import MAX_TOKENS, PROMPTS, assert_matches, perturbed, transformers_greedy, vllm_model


def gateway_chain(root: Path, tied: bool) -> dict:
    m0 = vllm_model(root / "m0", tied=tied)
    m1 = perturbed(m0, root / "m1", 1)
    m2 = perturbed(m1, root / "m2", 2)
    # every weight moves, so deltas are as big as full snapshots: allow them anyway
    writer = ChainWriter(root / "store" / PREFIX, run="r1", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1), writer.add(m2, base=m1, step=2)]
    assert [s.kind for s in snaps] == ["full", "delta", "delta"]
    return {"models": [m0, m1, m2], "ids": [s.identity for s in snaps], "store": root / "store", "writer": writer}


def vllm_gateway(chain: dict, work: Path, **fields) -> InferenceServer:
    """A started gateway over one vLLM it supervises, booted from the chain's first model (``fields``:
    more ServeConfig fields, ``vllm`` among them)."""
    fields.setdefault("vllm", VLLMProcessConfig(log_file=work.parent / f"{work.name}-vllm.log"))
    config = ServeConfig(
        model_dir=chain["models"][0],
        served_model_name="tiny",
        port=0,
        deployment_id=DEPLOYMENT,
        store=str(chain["store"]),
        prefix=PREFIX,
        token=SecretStr(TOKEN),
        work_dir=work,
        engine="vllm",
        **fields,
    )
    return InferenceServer(config).start()


def assert_stamped_right(api: Api, identity: str, refs) -> bool:
    """Ask for every prompt's greedy answer: each is refused (503) or comes from ``identity``'s weights and is
    stamped so; True when all were answered."""
    replies = [
        api.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1},
        )
        for p in PROMPTS
    ]
    assert all(r.status_code in (200, 503) for r in replies), [r.text for r in replies]
    if not all(r.status_code == 200 for r in replies):
        return False
    assert {r.json()["snapshot_identity"] for r in replies} == {identity}
    assert_matches(
        [(r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["logprobs"]["token_logprobs"]) for r in replies],
        refs,
    )
    return True


def gateway_loader(server: InferenceServer, make_client):
    return make_client(server, timeout=300, fallback_to_full=False)


def untied_chain(root: Path) -> dict:
    chain = gateway_chain(root, tied=False)
    chain["refs"] = [transformers_greedy(m) for m in chain["models"]]
    assert chain["refs"][0] != chain["refs"][1] != chain["refs"][2]
    return chain
