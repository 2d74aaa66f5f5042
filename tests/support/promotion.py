"""Fixtures of the eval gate's tests: an eval set whose references are one model's greedy answers
(the reference chain's m2 by default, so m2 scores 1.0, m1 and m0 far less under
``posttrain.testing.rewards:reference_match``), promotion settings that evaluate greedily, and
what a deployment's replicas report serving. Any chain of model folders will do (the reference
servers' ``chain`` fixture, or the vLLM tests' models)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.serving import local_greedy

REWARD = "posttrain.testing.rewards:reference_match"
EVAL_PROMPTS = 10
MAX_TOKENS = 6
QUESTIONS = ["What is {a} plus {b}?", "Name the color of item {a}.", "Count to {b}.", "Say hello to {a} and {b}."]


def eval_rows(models: Sequence[Path], *, reference: int = 2, prompts: int = EVAL_PROMPTS,
              max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Eval prompts (chat messages; the chat template of ``models[0]``'s tokenizer) whose
    ``reference_ids`` are the greedy continuation of ``models[reference]`` under transformers."""
    from transformers import AutoTokenizer

    from posttrain.rollouts.shard import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    rows = []
    for i in range(prompts):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(a=i + 2, b=2 * i + 3)}]
        ids = chat_prompt_ids(tokenizer, messages)
        rows.append({"prompt": messages, "id": f"q{i:02d}",
                     "reference_ids": local_greedy(models[reference], ids, max_tokens=max_tokens)})
    return rows


def write_eval_set(models: Sequence[Path], path: Path, **kw) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in eval_rows(models, **kw)))
    return path


def greedy_eval(**overrides) -> dict:
    """EvalSettings values: greedy (a temperature under 1e-5 samples greedily, here and in vLLM)."""
    return {"samples_per_prompt": 2, "max_tokens": MAX_TOKENS, "temperature": 1e-6, "reward_funcs": [REWARD],
            **overrides}


def served_identities(api, deployment: str) -> set[str]:
    """The snapshot identities the replicas of ``deployment`` report serving (``api``: a
    ``tests.support.serving.Api`` on its server), per its latest hot-load."""
    r = api.get("/v1alpha1/inference/hotLoads", params={"parentDeploymentId": deployment, "maxPageSize": 1})
    assert r.status_code == 200, r.text
    if not r.json()["hotLoads"]:
        return set()  # never hot-loaded: the boot weights
    op_id = r.json()["hotLoads"][0]["spec"]["id"]
    replicas = api.get(f"/v1alpha1/inference/hotLoads/{op_id}/replicas").json()["replicas"]
    return {x["currentSnapshotIdentity"] for x in replicas}


@contextmanager
def staging_and_production(chain, store_folder: Path, tmp_path: Path) -> Iterator[tuple]:
    """Staging and production reference servers on one store: yields (store, staging, production,
    [staging api, production api]), the ``Deployment``s promotion takes (both with completions: a first
    candidate is compared with what production serves, evaluated there)."""
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.promote.promoter import Deployment
    from posttrain.rollouts.client import CompletionsClient, CompletionsConfig
    from posttrain.storage import open_store
    from tests.support.serving import PREFIX, TOKEN, Api, start_server

    servers = [start_server(chain, tmp_path / name, store_folder, deployment_id=name) for name in ("staging", "prod")]
    store = open_store(str(store_folder / PREFIX))
    loaders = [CoreWeaveHotLoader(HotLoadConfig(api_url=s.url, deployment_id=name, token=TOKEN, poll_interval=0.05,
                                                timeout=60)) for s, name in zip(servers, ("staging", "prod"), strict=True)]

    def completions(url=servers[0].url):
        return CompletionsClient(CompletionsConfig(gateway_url=url, model="tiny", token=TOKEN))

    try:
        yield (store, Deployment("staging", loaders[0], completions),
               Deployment("prod", loaders[1], lambda: completions(servers[1].url)),
               [Api(s.url) for s in servers])
    finally:
        for x in (*loaders, store):
            x.close()
        for s in servers:
            s.shutdown()
