"""The reference server proves which weights it serves (issue 34): after every load its parameters
are read back (a digest of each as held) and compared exactly with the snapshot's, and a monitor
keeps comparing them while they are served. Versions here are ONE AdamW step at lr 1e-6 apart
(``tests.support.updates``), closer than any tolerance on answers, in float32 and in bfloat16:

- an engine left on N-1, one that dropped a tensor, and one that re-served cached weights fail the
  hot-load, naming the tensors, and N-1 is still served; a snapshot holding NaN is refused;
- weights changed under the served model after the switch put every replica in ERROR within a few
  monitor intervals, completions answer 503 (never stamped N meanwhile), and a hot-load of the
  served version fails; once the weights are N's again the server serves N again."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from posttrain.inference.contract import HotLoadFailed
from posttrain.inference.protocol import API_PREFIX
from tests.support.serving import DEPLOYMENT, PREFIX, PROMPT, TOKEN, Api

DROPPED = "model.layers.1.mlp.down_proj.weight"  # a tensor one step changes in both dtypes
POISONED = "model.layers.0.self_attn.o_proj.weight"
INTERVAL = 0.1  # the monitor's, in the monitor test


@dataclass
class Versions:
    dtype: str
    folders: list[Path]  # v0 (boot), v1 = v0 + one AdamW step, v1 with NaN in POISONED
    store: Path
    ids: list[str]  # the full snapshot of v0, the delta to v1, the delta to the NaN copy
    changed: list[str]  # the parameters v1 holds other values in than v0 (bf16: rounding hides some)


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def versions(request, tiny_model_dir, tmp_path_factory) -> Versions:
    import torch

    from posttrain.chain.writer import ChainWriter
    from tests.support.updates import nan_weights, one_update, saved_as

    dtype = request.param
    root = tmp_path_factory.mktemp(f"readback-{dtype}")
    # the float32 master weights step; bf16 versions are what a trainer saves of them
    v0 = tiny_model_dir if dtype == "float32" else saved_as(tiny_model_dir, root / "v0", dtype)
    v1 = one_update(tiny_model_dir, root / "v1", lr=1e-6, dtype=dtype)
    poisoned = nan_weights(v1, root / "nan", POISONED)
    before, after = _tensors(v0), _tensors(v1)
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    if "model.embed_tokens.weight" in changed:
        changed = sorted([*changed, "lm_head.weight"])  # tied: the model holds it as a parameter too
    assert DROPPED in changed and len(changed) > 10
    store = root / "store"
    writer = ChainWriter(store / PREFIX, run="r1")
    records = [writer.add(v0, step=0), writer.add(v1, base=v0, step=1), writer.add(poisoned, base=v1, step=2)]
    assert [r.kind for r in records] == ["full", "delta", "delta"]
    return Versions(dtype, [v0, v1, poisoned], store, [r.identity for r in records], changed)


@pytest.fixture
def serve(versions, tmp_path):
    """serve(**ServeConfig fields) -> (server, Api, hot-load client) booted from v0; stopped at teardown."""
    from pydantic import SecretStr

    from posttrain.inference.hotload import CoreWeaveHotLoader, HotLoadConfig
    from posttrain.serve.serve_config import ServeConfig
    from posttrain.serve.server import InferenceServer

    started = []

    def make(**overrides):
        config = ServeConfig(**{"model_dir": versions.folders[0], "port": 0, "deployment_id": DEPLOYMENT,
                                "store": str(versions.store), "prefix": PREFIX, "token": SecretStr(TOKEN),
                                "work_dir": tmp_path / "work", "test_hooks": True, "served_model_name": "tiny",
                                "device": "cpu", **overrides})
        server = InferenceServer(config).start()
        started.append(server)
        assert server.engine.faults is server.faults  # faults armed through /_test/faults reach the engine
        client = CoreWeaveHotLoader(HotLoadConfig(api_url=server.url, deployment_id=DEPLOYMENT, token=TOKEN,
                                                  poll_interval=0.05, timeout=30, request_timeout=10,
                                                  backoff_base=0.01, backoff_max=0.05, fallback_to_full=False))
        started.append(client)
        return server, Api(server.url), client

    yield make
    for s in reversed(started):
        s.shutdown() if hasattr(s, "shutdown") else s.close()


def _stamp(api: Api) -> str:
    return api.complete(prompt=PROMPT, max_tokens=2)["snapshot_identity"]


def _failure(api: Api, client, identity: str, base: str) -> str:
    """The message of the hot-load of ``identity`` that must fail."""
    with pytest.raises(HotLoadFailed) as info:
        client.hot_load(identity, base_identity=base)
    op = api.get(f"{API_PREFIX}/{info.value.operation_id}").json()["hotLoad"]
    return op["status"]["conditions"][0]["message"]


def _names(changed: list[str], identity: str, total: int) -> str:
    """How the readback's reason starts for parameters ``changed`` (the first five named)."""
    shown = "; ".join(f"{n} differs" for n in changed[:5])
    more = f"; and {len(changed) - 5} more" if len(changed) > 5 else ""
    return f"{len(changed)} of {total} tensors are not {identity}'s ({shown}{more})"


def test_a_replica_left_on_other_weights_is_refused_at_the_switch(versions, serve):
    server, api, client = serve()
    full, d1, poisoned = versions.ids
    client.hot_load(full)
    total = len(server.engine.slot.current().model.state_dict())
    for fault, differing in [
        ({"kind": "stale_weights"}, versions.changed),  # the engine did not take the update: N-1 left
        ({"kind": "stale_weights", "tensors": [DROPPED]}, [DROPPED]),  # it skipped one tensor
        ({"kind": "cached_weights"}, versions.changed),  # it re-served the weights it had cached
    ]:
        api.faults(fault)
        message = _failure(api, client, d1, full)
        assert message.startswith("the parameters the reference engine loaded: " + _names(differing, d1, total)), (
            fault, message)
        assert api.stats()["pending"] == [], fault
        assert _stamp(api) == full, fault  # N-1 still served, and said to be
    client.hot_load(d1, base_identity=full)  # the same load without a fault: read back exactly
    assert _stamp(api) == d1
    message = _failure(api, client, poisoned, d1)
    assert f"1 of {total} tensors are not {poisoned}'s ({POISONED} holds NaN or infinity)" in message
    assert _stamp(api) == d1
    assert server.engine.replica_errors() == {}


def _overwrite(engine, folder: Path) -> None:
    """Put ``folder``'s values into the served model's parameters in place (weights changed under it)."""
    import torch

    values = _tensors(folder)
    with torch.no_grad():
        for name, t in engine.slot.current().model.state_dict().items():
            t.copy_(values["model.embed_tokens.weight" if name == "lm_head.weight" else name])


def _replicas(api: Api, op_id: str) -> list[dict]:
    return api.get(f"{API_PREFIX}/{op_id}/replicas").json()["replicas"]


def test_the_monitor_catches_weights_changed_after_the_switch(versions, serve):
    server, api, client = serve(probe_interval_s=INTERVAL, replicas=2)
    full, d1, _ = versions.ids
    client.hot_load(full)
    op = client.hot_load(d1, base_identity=full).operation_id
    assert _stamp(api) == d1
    assert {r["state"] for r in _replicas(api, op)} == {"READY"}

    _overwrite(server.engine, versions.folders[0])  # the served model holds N-1's values from here on
    deadline = time.monotonic() + 30 * INTERVAL + 5
    while time.monotonic() < deadline and not server.engine.replica_errors():
        time.sleep(INTERVAL / 4)
    replicas = _replicas(api, op)
    assert [r["state"] for r in replicas] == ["ERROR", "ERROR"], replicas
    total = len(server.engine.slot.current().model.state_dict())
    for r in replicas:
        assert r["errorReason"].startswith("the parameters the reference engine serves: "
                                           + _names(versions.changed, d1, total)), r
    reply = requests.post(f"{server.url}/v1/completions", headers=api.headers, timeout=30,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 503 and "does not hold" in reply.json()["error"]["message"], reply.text
    # a hot-load of the served version reads the parameters back too: it fails, naming them
    message = _failure(api, client, d1, full)
    assert "tensors are not " + d1 in message and versions.changed[0] in message

    _overwrite(server.engine, versions.folders[1])  # N's values again: served again
    deadline = time.monotonic() + 30 * INTERVAL + 5
    while time.monotonic() < deadline and server.engine.replica_errors():
        time.sleep(INTERVAL / 4)
    assert {r["state"] for r in _replicas(api, op)} == {"READY"}
    assert _stamp(api) == d1
