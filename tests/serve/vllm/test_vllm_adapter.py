"""LoRA adapters published alone (``lora_publish: adapter``) and hot-loaded into REAL vLLM (CPU
build) through the gateway: each adapter version answers with the same greedy tokens (and
logprobs) as the merged model, a bad adapter never reaches vLLM and leaves the previous one
served, a killed vLLM comes back with the adapter, and a merged model hot-loaded afterwards
answers the same as its adapter did.

The base unties its embeddings, so the merged model reloads in place (a base that ties them makes
the gateway restart vLLM for a merged version, ~25 s here; adapters load on top of either base).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from pydantic import SecretStr

from posttrain.chain.policy import ChainPolicy
from posttrain.inference.contract import HotLoadFailed
from posttrain.lora import BaseRef, base_fingerprint, write_base_ref
from posttrain.lora.merge import merge_adapter
from posttrain.lora.packed import pack_adapter
from posttrain.publish import PublishConfig, Publisher
from posttrain.serve.serve_config import ServeConfig
from posttrain.serve.server import InferenceServer
from posttrain.serve.vllm.process import VLLMProcessConfig
from posttrain.storage import LocalStore
from tests.support.lora import make_adapter
from tests.support.serving import DEPLOYMENT, TOKEN, Api
from tests.support.vllm import (
    assert_matches,
    require_vllm,
    served_greedy,
    transformers_greedy,
    vllm_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(base: Path, out: Path, seed: int, r: int = 8, trained_on: Path | None = None) -> Path:
    make_adapter(trained_on or base, out, seed=seed, r=r, lora_alpha=2 * r, target_modules=TARGETS)
    real = trained_on or base
    write_base_ref(out, BaseRef(path=str(real), fingerprint=base_fingerprint(real)))
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict:
    """Two adapter versions (a full snapshot, then a delta), a rank-32 one, one of another base, and
    the second version merged, all published by one Publisher into one store, in step order."""
    root = tmp_path_factory.mktemp("adapters")
    base = vllm_model(root / "base", tied=False)
    other = vllm_model(root / "other", seed=7, tied=False)
    adapters = [_adapter(base, root / f"a{i}", seed=i) for i in (1, 2)]
    big = _adapter(base, root / "a-big", seed=3, r=32)
    foreign = _adapter(base, root / "a-foreign", seed=4, trained_on=other)
    merged = [merge_adapter(a, base, root / f"merged{i}").path for i, a in enumerate(adapters, 1)]
    store = root / "store"
    config = PublishConfig(run="lora", work_dir=root / "publish", async_publish=False,
                           policy=ChainPolicy(delta_budget=100.0))
    snaps = []
    with Publisher(LocalStore(store), config, owns_store=True) as publisher:
        for step, folder in enumerate([*adapters, big, foreign], 1):
            packed = root / f"packed-{step}"
            pack_adapter(folder, packed)
            snaps.append(publisher.publish_step(packed, step))
        snaps.append(publisher.publish_step(merged[1], 5))
    assert [s.kind for s in snaps] == ["full", "delta", "full", "full", "full"]  # r=32 and r=8 differ in layout
    return {"base": base, "store": store, "ids": [s.identity for s in snaps], "snaps": snaps,
            "refs": [transformers_greedy(m) for m in merged], "base_ref": transformers_greedy(base)}


@pytest.fixture(scope="module")
def gateway(published, tmp_path_factory):
    work = tmp_path_factory.mktemp("gw") / "work"
    config = ServeConfig(model_dir=published["base"], served_model_name="tiny", port=0, deployment_id=DEPLOYMENT,
                         store=str(published["store"]), token=SecretStr(TOKEN), work_dir=work, engine="vllm",
                         vllm=VLLMProcessConfig(max_lora_rank=16, log_file=work.parent / "vllm.log"),
                         probe_interval_s=1.0, idle_probe_interval_s=None)  # each replica read back every second
    server = InferenceServer(config).start()
    yield server
    server.shutdown()


def test_adapter_versions_answer_as_the_merged_model_and_bad_ones_are_refused(gateway, published, make_client):
    api = Api(gateway.url)
    loader = make_client(gateway, timeout=300, fallback_to_full=False)
    ids, refs = published["ids"], published["refs"]
    assert refs[0] != published["base_ref"] and refs[0] != refs[1]  # each adapter changes what is answered
    assert served_greedy(api)[0][0][0] == published["base_ref"][0][0]  # the base, before any adapter
    for i in (0, 1):
        result = loader.hot_load(ids[i], base_identity=ids[i - 1] if i else None)
        got, stamped = served_greedy(api)
        assert result.identity == stamped == ids[i]  # the adapter version that answered
        assert_matches(got, refs[i])
    replicas = api.get(f"/v1alpha1/inference/hotLoads/{api.ops()[0]['spec']['id']}/replicas").json()["replicas"]
    assert [r["currentSnapshotIdentity"] for r in replicas] == [ids[1]]

    # a killed vLLM comes back on the base with the adapter loaded again
    for pid in gateway.engine.replicas[0].process.pids():
        os.kill(pid, signal.SIGKILL)
    op = api.ops()[0]["spec"]["id"]
    states: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not ("ERROR" in states and states[-1] == "READY"):
        states.append(api.get(f"/v1alpha1/inference/hotLoads/{op}/replicas").json()["replicas"][0]["state"])
        time.sleep(0.5)
    assert "ERROR" in states and states[-1] == "READY", states[-5:]
    got, stamped = served_greedy(api)
    assert stamped == ids[1]
    assert_matches(got, refs[1])

    for identity, base, named in [(ids[2], None, "r=32"), (ids[3], None, "was trained on base")]:
        with pytest.raises(HotLoadFailed) as info:
            loader.hot_load(identity, base_identity=base)
        assert named in str(info.value)
        got, stamped = served_greedy(api)
        assert stamped == ids[1]
        assert_matches(got, refs[1])

    # the merged second version, a full model snapshot, reloaded in place
    merged = loader.hot_load(ids[4])
    got, stamped = served_greedy(api)
    assert merged.identity == stamped == ids[4]
    assert_matches(got, refs[1])
    time.sleep(3)  # the monitor's probes meanwhile find the replica on the merged weights: nothing put back
    got, stamped = served_greedy(api)
    assert stamped == ids[4] and not gateway.engine.replica_errors()
    assert_matches(got, refs[1])
    with pytest.raises(HotLoadFailed, match="was trained on base"):  # not on the merged model served now
        loader.hot_load(ids[0])
