"""Fixtures: three versions of a tiny model, their snapshot chain in a store folder, and real
servers (``InferenceServer`` in a thread, one per test) with a client pointed at them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TOKEN = "tok-PLANTED-123"
DEPLOYMENT = "dep-test"
PREFIX = "runs/r1"
PROMPT = [5, 6, 7, 8, 9]


@dataclass
class Chain:
    models: list[Path]  # checkpoint folders m0, m1, m2 (m1, m2: layer 0 perturbed)
    store: Path  # the store folder; snapshots at <store>/<PREFIX>/<identity>
    full: str  # full snapshot of m0
    d1: str  # delta m0 -> m1
    d2: str  # delta m1 -> m2
    greedy: list[list[int]]  # greedy completion of PROMPT under m0, m1, m2 (8 tokens)


def _perturb(src: Path, dst: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers.0." in name:  # the other tensors stay bit-identical: left out of the delta
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(dst)
    return dst


def local_greedy(model_dir: Path, prompt: list[int], max_tokens: int = 8) -> list[int]:
    from transformers import AutoModelForCausalLM

    from posttrain.serve.sampler import sample

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    (choice,) = sample(model, [prompt], n=1, max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                       eos_token_ids={eos} if isinstance(eos, int) else set(eos or []), pad_token_id=0)
    return choice.token_ids


@pytest.fixture(scope="session")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    from posttrain.chain.writer import ChainWriter
    from posttrain.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("chain")
    m0 = build_tiny_model(root / "m0", seed=0)
    m1 = _perturb(m0, root / "m1", 1)
    m2 = _perturb(m1, root / "m2", 2)
    store = root / "store"
    writer = ChainWriter(store / PREFIX, run="r1")
    r0 = writer.add(m0, step=0)
    r1 = writer.add(m1, base=m0, step=1)
    r2 = writer.add(m2, base=m1, step=2)
    assert (r0.kind, r1.kind, r2.kind) == ("full", "delta", "delta")
    greedy = [local_greedy(m, PROMPT) for m in (m0, m1, m2)]
    assert greedy[0] != greedy[1] != greedy[2]
    return Chain([m0, m1, m2], store, r0.identity, r1.identity, r2.identity, greedy)


@pytest.fixture
def store_copy(chain: Chain, tmp_path: Path) -> Path:
    """A private copy of the store, for tests that break or extend it."""
    dest = tmp_path / "store"
    shutil.copytree(chain.store, dest, symlinks=True)
    return dest


def start_server(chain: Chain, work_dir: Path, store: Path | None = None, **overrides):
    """A started InferenceServer (in a thread) on a free port, booted from m0."""
    from pydantic import SecretStr

    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    fields = dict(model_dir=chain.models[0], port=0, deployment_id=DEPLOYMENT, store=str(store or chain.store),
                  prefix=PREFIX, token=SecretStr(TOKEN), work_dir=work_dir, test_hooks=True,
                  served_model_name="tiny",
                  # the fakes cost nothing idle: every probe reads back, as the monitor's tests expect
                  idle_probe_interval_s=None)
    fields.update(overrides)
    return InferenceServer(ServeConfig(**fields)).start()


@pytest.fixture
def make_server(chain: Chain, tmp_path: Path) -> Iterator[Callable]:
    """make_server(store=..., **ServeConfig fields) -> a started InferenceServer; stopped at teardown."""
    servers = []

    def make(store: Path | None = None, **overrides):
        server = start_server(chain, tmp_path / f"work{len(servers)}", store, **overrides)
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.shutdown()


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def make_client() -> Iterator[Callable]:
    """make_client(server, **HotLoadConfig fields) -> a CoreWeaveHotLoader with short waits."""
    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig

    clients = []

    def make(server, **overrides):
        fields = dict(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN, poll_interval=0.05, timeout=30,
                      request_timeout=10, backoff_base=0.01, backoff_max=0.05)
        fields.update(overrides)
        client = CoreWeaveHotLoader(HotLoadConfig(**fields))
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


class Api:
    """Raw calls to a server, with the token."""

    def __init__(self, url: str):
        import requests

        self.url = url
        self.session = requests.Session()
        self.headers = {"Authorization": f"Bearer {TOKEN}"}

    def get(self, path: str, **kw):
        return self.session.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path: str, json=None, **kw):
        return self.session.post(self.url + path, json=json, headers=self.headers, timeout=60, **kw)

    def complete(self, **body) -> dict:
        body.setdefault("model", "tiny")
        r = self.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def greedy(self, prompt: list[int] = PROMPT, max_tokens: int = 8) -> list[int]:
        return self.complete(prompt=prompt, max_tokens=max_tokens, temperature=0)["choices"][0]["token_ids"]

    def faults(self, *faults: dict) -> None:
        r = self.post("/_test/faults", json={"faults": list(faults)})
        assert r.status_code == 200, r.text

    def stats(self) -> dict:
        return self.get("/_test/stats").json()

    def ops(self) -> list[dict]:
        r = self.get("/v1alpha1/inference/hotLoads", params={"parentDeploymentId": DEPLOYMENT, "maxPageSize": 1000})
        return r.json()["hotLoads"]


@pytest.fixture
def api(server) -> Api:
    return Api(server.url)


# The data-plane contract (docs/hotload-api.md): what the reference server refuses, every gateway refuses,
# before the engine sees it.
FORBIDDEN = [
    ({"prompt": "a text prompt"}, "prompt"),
    ({"top_k": 5}, "top_k"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"echo": True}, "echo"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"stop": ["x"]}, "stop"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
]


def wait_op(api: Api, op_id: str, timeout: float = 30) -> dict:
    """The hot-load operation ``op_id`` once it is COMPLETED or FAILED."""
    import time

    from posttrain.inference.protocol import API_PREFIX, STATE_COMPLETED, STATE_FAILED

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        op = api.get(f"{API_PREFIX}/{op_id}").json()["hotLoad"]
        if op["status"]["state"] in (STATE_COMPLETED, STATE_FAILED):
            return op
        time.sleep(0.05)
    raise AssertionError(f"hot-load {op_id} did not finish in {timeout} s")
