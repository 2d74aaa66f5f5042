"""Promotion and rollback against REAL vLLM (CPU build): the same steps as tests/promote/test_promoter.py,
with production and staging each a ``posttrain serve --engine vllm`` gateway (one vLLM replica each)
on one store folder holding a chain of three tiny vLLM-runnable models (m0 full, m1 and m2 deltas).

Staging is a vLLM gateway too, not the reference server: the two vLLM CPU engines of this tiny model
peak at about 2.5 GiB of memory together (measured on a 2-CPU, 24 GiB machine), so the eval samples
the engine production runs; they start at once, and once per module (about a minute in all).

The eval set's references are m2's greedy answers under transformers
(``posttrain.testing.rewards:reference_match``): m1 is promoted first (no champion yet), m2 beats it
and production serves m2 exactly as transformers does, m0 is refused with production untouched, and
``rollback --to previous`` brings back m1's identity and answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from pydantic import SecretStr

from posttrain.chain.policy import ChainPolicy
from posttrain.chain.writer import ChainWriter
from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
from posttrain.promote.decision import GateConfig
from posttrain.promote.evaluate import EvalSettings, EvalStore
from posttrain.promote.history import History
from posttrain.promote.promoter import Deployment, promote, rollback
from posttrain.rollouts.client import CompletionsClient, CompletionsConfig
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.process import VLLMProcessConfig
from posttrain.storage import open_store
from tests.support.promotion import eval_rows, greedy_eval, served_identities
from tests.support.serving import PREFIX, TOKEN, Api
from tests.support.vllm import assert_matches, perturbed, require_vllm, served_greedy, transformers_greedy, vllm_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()

PROMPTS = 6  # eval prompts, and the gate's min_prompts (the fewest with which the gate can accept at 95%)
MAX_TOKENS = 5  # per eval completion
SCALE = 0.2  # noise per weight between versions: every greedy answer differs from its first token


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict:
    """m0, m1, m2 (every weight moved), their chain in a store folder, transformers' greedy answers."""
    root = tmp_path_factory.mktemp("promotion")
    m0 = vllm_model(root / "m0")
    m1 = perturbed(m0, root / "m1", 1, scale=SCALE)
    m2 = perturbed(m1, root / "m2", 2, scale=SCALE)
    # every weight moves, so deltas are as big as full snapshots: allow them anyway
    writer = ChainWriter(root / "store" / PREFIX, run="r1", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1), writer.add(m2, base=m1, step=2)]
    assert [s.kind for s in snaps] == ["full", "delta", "delta"]
    refs = [transformers_greedy(m) for m in (m0, m1, m2)]
    assert [t for t, _ in refs[0]] != [t for t, _ in refs[1]] != [t for t, _ in refs[2]]
    return {"models": [m0, m1, m2], "ids": [s.identity for s in snaps], "store": root / "store", "refs": refs}


@pytest.fixture(scope="module")
def rows(versions) -> list[dict]:
    rows = eval_rows(versions["models"], prompts=PROMPTS, max_tokens=MAX_TOKENS)
    others = [eval_rows(versions["models"], reference=i, prompts=PROMPTS, max_tokens=MAX_TOKENS) for i in (0, 1)]
    for other in others:  # m0 and m1 differ from m2's references on every prompt's first token: the gate can tell
        assert all(a["reference_ids"][0] != b["reference_ids"][0] for a, b in zip(rows, other, strict=True))
    return rows


def _gateway(versions: dict, work: Path, deployment: str) -> InferenceServer:
    """A ``posttrain serve --engine vllm`` gateway (one replica) booted from m0, on the versions' store."""
    config = ServeConfig(model_dir=versions["models"][0], served_model_name="tiny", port=0, deployment_id=deployment,
                         store=str(versions["store"]), prefix=PREFIX, token=SecretStr(TOKEN), work_dir=work,
                         engine="vllm", replicas=1,
                         vllm=VLLMProcessConfig(log_file=work.parent / f"{work.name}-vllm.log"))
    return InferenceServer(config).start()


@pytest.fixture(scope="module")
def site(versions, tmp_path_factory):
    """Staging and production vLLM gateways; yields (store, staging, production, staging server, production server)."""
    work = tmp_path_factory.mktemp("gateways")
    names = ("staging", "prod")
    servers: list[InferenceServer] = []
    loaders: list[CoreWeaveHotLoader] = []
    store = open_store(str(versions["store"] / PREFIX))
    try:
        with ThreadPoolExecutor(len(names)) as pool:  # both engines start at once: their start waits overlap
            starts = [pool.submit(_gateway, versions, work / name, name) for name in names]
            wait(starts)
        servers = [f.result() for f in starts if f.exception() is None]
        for f in starts:
            f.result()  # a gateway that did not start fails the fixture (the started one is shut down below)
        for server, name in zip(servers, names, strict=True):
            loaders.append(CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id=name, token=TOKEN,
                                                            poll_interval=0.1, timeout=300)))

        def completions(url=servers[0].url):
            return CompletionsClient(CompletionsConfig(gateway_url=url, model="tiny", token=TOKEN))

        yield (store, Deployment("staging", loaders[0], completions), Deployment("prod", loaders[1]), *servers)
    finally:
        for x in (*loaders, store):
            x.close()
        for s in servers:
            s.shutdown()
        left = {pid for s in servers for r in s.engine.replicas for pid in r.process.pids()}
        assert not left, f"shutdown left vLLM processes behind: {sorted(left)}"


@pytest.fixture(scope="module")
def tokenizer(versions):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(versions["models"][0])


def gate_run(site, rows, tokenizer, candidate):
    store, staging, production, *_ = site
    settings = EvalSettings(**greedy_eval(max_tokens=MAX_TOKENS))
    # own_eval: the first promotion sets a champion up (tests/promote/test_promoter.py: the boot weights' rule)
    gate = GateConfig(samples_per_prompt=settings.samples_per_prompt, min_prompts=PROMPTS, first_promotion="own_eval")
    return promote(store=store, candidate=candidate, run="nightly-test", gate=gate, settings=settings, rows=rows,
                   dataset_digest="d" * 64, tokenizer=tokenizer, staging=staging, production=production)


def serves(api: Api, identity: str, refs) -> None:
    """Production's replicas report ``identity``, and its greedy answers (stamped so) are transformers'."""
    assert served_identities(api, "prod") == {identity}
    got, stamped = served_greedy(api)
    assert stamped == identity
    assert_matches(got, refs)


def test_promotion_refusal_and_rollback_through_vllm_gateways(versions, site, rows, tokenizer):
    store, _, production, _, prod_server = site
    ids, refs = versions["ids"], versions["refs"]
    prod = Api(prod_server.url)
    history = History(store, "", "prod")

    first = gate_run(site, rows, tokenizer, ids[1])  # no champion yet: its own eval decides
    assert first.promoted and first.record.kind == "promotion" and first.record.previous is None
    assert "first promotion" in first.decision.reason
    serves(prod, ids[1], refs[1])

    better = gate_run(site, rows, tokenizer, ids[2])  # the eval's references are m2's answers
    assert better.promoted, better.decision.reason
    assert better.decision.candidate_mean == pytest.approx(1.0)  # vLLM answers as transformers does
    assert better.decision.champion_mean < 0.8 and better.decision.lower_bound > 0
    assert better.champion_eval.digest == first.candidate_eval.digest  # the champion's stored eval, reused
    assert EvalStore(store).get(better.candidate_eval.digest, ids[2]) is not None
    serves(prod, ids[2], refs[2])

    worse = gate_run(site, rows, tokenizer, ids[0])  # m0: further from the references than the champion
    assert not worse.promoted and worse.served is None
    assert worse.record.kind == "refusal" and worse.record.previous == ids[2]
    assert worse.record.reason.startswith("refused") and "lower bound" in worse.record.reason
    serves(prod, ids[2], refs[2])  # production untouched
    assert history.champion() == ids[2]

    back = rollback(store=store, production=production, to="previous")
    assert back.record.kind == "rollback" and back.record.identity == ids[1] and back.record.previous == ids[2]
    serves(prod, ids[1], refs[1])
    assert [r.kind for r in history.records()] == ["promotion", "promotion", "refusal", "rollback"]
    assert history.champion() == ids[1] and history.previous_champion() is None
