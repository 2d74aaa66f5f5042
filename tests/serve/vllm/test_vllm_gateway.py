"""posttrain serve --engine vllm against REAL vLLM (CPU build): the gateway hot-loads a chain
into vLLM, and vLLM then answers exactly as transformers does on that version; bad versions
never reach vLLM and leave the previous one served; a killed engine comes back on the last good
version. (A model with tied embeddings, switched by a restart: tests/e2e/test_e2e_vllm.py.)

The module's gateway also serves /metrics, and its first test has a REAL Prometheus (Debian's package,
tests/support/prometheus.py) scrape it through two hot-loads (full, delta) and one refused (a snapshot
missing a tensor): Prometheus's HTTP API then shows the served identity changed twice, the failure
counted with its reason, and the stage histograms' counts. It runs first (file order), so its counts
are the gateway's from boot."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from posttrain.chain.writer import ChainWriter
from posttrain.inference.contract import HotLoadFailed
from tests.support.serving import FORBIDDEN, PREFIX, TOKEN, Api
from tests.support.vllm import (
    KeepsOneTensor,
    assert_matches,
    perturbed,
    require_vllm,
    served_greedy,
    transformers_greedy,
    with_probe,
)
from tests.support.vllm_gateway import assert_stamped_right, gateway_loader, untied_chain, vllm_gateway

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()
UP_PROJ = "model.layers.0.mlp.up_proj.weight"


def _without(src: Path, dst: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    """A copy of ``src`` missing tensor ``drop``, or with tensor ``reshape`` transposed."""
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    if drop:
        del weights[drop]
    if reshape:
        weights[reshape] = weights[reshape].t().contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> dict:
    return untied_chain(tmp_path_factory.mktemp("untied"))


@pytest.fixture(scope="module")
def gateway(untied, tmp_path_factory):
    server = vllm_gateway(untied, tmp_path_factory.mktemp("gw") / "work", metrics_port=0)
    yield server
    server.shutdown()
    assert not server.engine.replicas[0].process.pids(), "shutdown left vLLM processes behind"


def _prom_served(prometheus, instance: str) -> set[str]:
    return {s["metric"].get("identity", "") for s in
            prometheus.query(f'posttrain_replica_snapshot_info{{instance="{instance}"}}')}


def _prom_value(prometheus, expr: str) -> float:
    found = prometheus.query(expr)
    assert len(found) == 1, (expr, found)
    return found[0]["value"]


def test_prometheus_sees_two_hot_loads_and_a_refused_one(gateway, untied, prometheus, make_client, tmp_path: Path):
    instance = prometheus.scrape(gateway.metrics_url, TOKEN)
    started = time.time()
    prometheus.wait_scraped(instance, started)
    boot = _prom_served(prometheus, instance)
    assert len(boot) == 1 and untied["ids"][0] not in boot

    loader = gateway_loader(gateway, make_client)
    full, delta = untied["ids"][0], untied["ids"][1]
    for identity, base in ((full, None), (delta, full)):
        assert loader.hot_load(identity, base_identity=base).identity == identity
        t = time.time()
        prometheus.wait_scraped(instance, t)
        assert _prom_served(prometheus, instance) == {identity}
    # written apart and copied into the store: the chain the later tests extend keeps its head
    missing = ChainWriter(tmp_path / "apart", run="metrics").add(
        _without(untied["models"][1], tmp_path / "missing", drop=UP_PROJ), step=1)
    shutil.copytree(tmp_path / "apart" / missing.identity, untied["store"] / PREFIX / missing.identity)
    with pytest.raises(HotLoadFailed, match=UP_PROJ):
        loader.hot_load(missing.identity)
    assert served_greedy(Api(gateway.url))[1] == delta
    t = time.time()
    prometheus.wait_scraped(instance, t)

    sel = f'instance="{instance}"'
    window = f"[{int(time.time() - started) + 30}s]"
    # the served identity changed twice: three identities over the run (boot, full, delta), one now
    seen = {s["metric"].get("identity", "") for s in prometheus.query(
        f"count by (identity) (count_over_time(posttrain_replica_snapshot_info{{{sel}}}{window}))")}
    assert seen == boot | {full, delta}
    assert _prom_served(prometheus, instance) == {delta}
    assert _prom_value(prometheus, f'posttrain_replica_snapshot_info{{{sel}}}') == 1
    assert _prom_value(prometheus, f'posttrain_replica_state{{{sel}, replica="vllm-0", state="READY"}}') == 1
    # counted by outcome, the refusal with its reason
    assert _prom_value(prometheus, f'posttrain_hotloads_total{{{sel}, outcome="completed"}}') == 2
    assert _prom_value(prometheus, f'posttrain_hotloads_total{{{sel}, outcome="failed", reason="LayoutMismatch"}}') == 1
    # every load fetched, rebuilt and checked its layout; the refused one went no further
    counts = {s["metric"]["stage"]: s["value"]
              for s in prometheus.query(f"posttrain_hotload_stage_seconds_count{{{sel}}}")}
    assert counts == {"fetch": 3, "apply": 3, "validate": 3, "switch": 2, "probe": 2}
    assert _prom_value(prometheus, f'posttrain_completions_requests_total{{{sel}, status="200"}}') >= 2
    assert _prom_value(prometheus, f"posttrain_completion_tokens_total{{{sel}}}") > 0
    prometheus.clear()


def test_full_delta_delta_are_each_served_exactly(gateway, untied, make_client):
    api = Api(gateway.url)
    loader = gateway_loader(gateway, make_client)
    for i, identity in enumerate(untied["ids"]):
        base = untied["ids"][i - 1] if i else None
        result = loader.hot_load(identity, base_identity=base)
        assert result.identity == identity
        got, stamped = served_greedy(api)
        assert stamped == identity
        assert_matches(got, untied["refs"][i])


def test_bad_versions_fail_naming_the_tensor_and_the_previous_one_stays_served(gateway, untied, make_client, tmp_path):
    api = Api(gateway.url)
    loader = gateway_loader(gateway, make_client)
    last = untied["ids"][-1]
    assert served_greedy(api)[1] == last
    writer = untied["writer"]
    m2 = untied["models"][2]
    corrupt = writer.add(perturbed(m2, tmp_path / "m3", 3), base=m2, step=10)
    assert corrupt.kind == "delta"
    shard = next((untied["store"] / PREFIX / corrupt.identity).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)  # the last tensor's zstd frame: decodes to other bytes, or not at all
    shard.write_bytes(bytes(data))
    missing = writer.add(_without(m2, tmp_path / "missing", drop="model.layers.0.mlp.up_proj.weight"), step=11)
    wrong = writer.add(_without(m2, tmp_path / "wrong", reshape="model.layers.1.mlp.down_proj.weight"), step=12)
    assert (missing.kind, wrong.kind) == ("full", "full")  # a layout change starts a new full snapshot

    cases = [(missing.identity, None, "model.layers.0.mlp.up_proj.weight"),
             (wrong.identity, None, "model.layers.1.mlp.down_proj.weight"),
             (corrupt.identity, last, shard.name)]  # the file its checksums (posttrain.checksums.json) refuse
    for identity, base, named in cases:
        with pytest.raises(HotLoadFailed) as info:
            loader.hot_load(identity, base_identity=base)
        assert named in str(info.value)
        got, stamped = served_greedy(api)
        assert stamped == last
        assert_matches(got, untied["refs"][2])
    reload = loader.hot_load(untied["ids"][0])  # a good version afterwards loads
    assert reload.identity == untied["ids"][0]
    assert_matches(served_greedy(api)[0], untied["refs"][0])


def test_a_killed_engine_is_reported_then_restarted_on_the_last_good_version(gateway, untied, make_client):
    api = Api(gateway.url)
    serving = served_greedy(api)[1]
    index = untied["ids"].index(serving)
    process = gateway.engine.replicas[0].process
    for pid in process.pids():
        os.kill(pid, signal.SIGKILL)
    op_id = api.ops()[0]["spec"]["id"]
    states = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        replica = api.get(f"/v1alpha1/inference/hotLoads/{op_id}/replicas").json()["replicas"][0]
        states.append(replica["state"])
        assert_stamped_right(api, serving, untied["refs"][index])  # while it restarts, too
        if "ERROR" in states and replica["state"] == "READY":
            break
        time.sleep(0.5)
    assert "ERROR" in states and states[-1] == "READY", states[-5:]
    got, stamped = served_greedy(api)
    assert stamped == serving
    assert_matches(got, untied["refs"][index])
    loader = gateway_loader(gateway, make_client)
    target = 1 if index != 1 else 2  # a delta that applies to what it serves (or, after the full, its chain)
    loader.hot_load(untied["ids"][target], base_identity=untied["ids"][target - 1])
    assert_matches(served_greedy(api)[0], untied["refs"][target])


def test_an_engine_keeping_one_tensors_old_value_fails_the_probe_and_the_previous_version_serves(
        gateway, untied, make_client, tmp_path):
    """The trainer's probe travels with the snapshot; an engine whose reload kept one tensor's old value
    answers differently (so "it changed" passes) but not as the trainer's weights did: refused."""
    api = Api(gateway.url)
    loader = gateway_loader(gateway, make_client)
    served_answers, served = served_greedy(api)
    index = untied["ids"].index(served)
    base = untied["models"][index]
    new = untied["writer"].add(with_probe(perturbed(base, tmp_path / "m-probe", 7)), base=base, step=30)
    on = {"base_identity": served} if new.kind == "delta" else {}  # full after a test's layout change
    replica = gateway.engine.replicas[0]
    honest = replica.client
    replica.client = KeepsOneTensor(honest, "model.layers.1.mlp.down_proj.weight", gateway.engine.current().path,
                                    tmp_path / "mixed")
    try:
        with pytest.raises(HotLoadFailed, match="it does not hold version"):
            loader.hot_load(new.identity, **on)
    finally:
        replica.client = honest
    got, stamped = served_greedy(api)
    assert stamped == served
    assert_matches(got, untied["refs"][index])  # the previous version, put back
    loader.hot_load(new.identity, **on)  # the honest engine passes the same probe
    assert served_greedy(api)[1] == new.identity
    assert_matches(served_greedy(api)[0], transformers_greedy(tmp_path / "m-probe"))


@pytest.mark.parametrize("extra,field", FORBIDDEN, ids=[f for _, f in FORBIDDEN])
def test_the_gateway_refuses_what_the_contract_forbids_before_vllm_sees_it(gateway, extra, field):
    reply = Api(gateway.url).post("/v1/completions", json={"model": "tiny", "prompt": [10, 20, 30], "max_tokens": 2,
                                                           **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field  # the gateway's refusal (vLLM would take most of these)
