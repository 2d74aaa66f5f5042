"""Acceptance of /metrics with a REAL Prometheus (Debian's package, tests/support/prometheus.py)
scraping a gateway in front of REAL vLLM (CPU build) through two hot-loads (full, delta) and one
refused (a snapshot missing a tensor): Prometheus's HTTP API then shows the served identity changed
twice, the failure counted with its reason, and the stage histograms' counts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from posttrain.inference.contract import HotLoadFailed
from tests.serve.vllm.test_vllm_gateway import _chain, _gateway, _without
from tests.support.serving import TOKEN, Api
from tests.support.vllm import require_vllm, served_greedy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
require_vllm()

MISSING = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    return _chain(tmp_path_factory.mktemp("metrics-chain"), tied=False)


@pytest.fixture(scope="module")
def gateway(chain, tmp_path_factory):
    server = _gateway(chain, tmp_path_factory.mktemp("metrics-gw") / "work", metrics_port=0)
    yield server
    server.shutdown()


def _served(prometheus, instance: str) -> set[str]:
    return {s["metric"].get("identity", "") for s in
            prometheus.query(f'posttrain_replica_snapshot_info{{instance="{instance}"}}')}


def _value(prometheus, expr: str) -> float:
    found = prometheus.query(expr)
    assert len(found) == 1, (expr, found)
    return found[0]["value"]


def test_prometheus_sees_two_hot_loads_and_a_refused_one(gateway, chain, prometheus, make_client, tmp_path: Path):
    instance = prometheus.scrape(gateway.metrics_url, TOKEN)
    started = time.time()
    prometheus.wait_scraped(instance, started)
    boot = _served(prometheus, instance)
    assert len(boot) == 1 and chain["ids"][0] not in boot

    loader = make_client(gateway, timeout=300, fallback_to_full=False)
    full, delta = chain["ids"][0], chain["ids"][1]
    for identity, base in ((full, None), (delta, full)):
        assert loader.hot_load(identity, base_identity=base).identity == identity
        t = time.time()
        prometheus.wait_scraped(instance, t)
        assert _served(prometheus, instance) == {identity}
    missing = chain["writer"].add(_without(chain["models"][1], tmp_path / "missing", drop=MISSING), step=11)
    with pytest.raises(HotLoadFailed, match=MISSING):
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
    assert _served(prometheus, instance) == {delta}
    assert _value(prometheus, f'posttrain_replica_snapshot_info{{{sel}}}') == 1
    assert _value(prometheus, f'posttrain_replica_state{{{sel}, replica="vllm-0", state="READY"}}') == 1
    # counted by outcome, the refusal with its reason
    assert _value(prometheus, f'posttrain_hotloads_total{{{sel}, outcome="completed"}}') == 2
    assert _value(prometheus, f'posttrain_hotloads_total{{{sel}, outcome="failed", reason="LayoutMismatch"}}') == 1
    # every load fetched, rebuilt and checked its layout; the refused one went no further
    counts = {s["metric"]["stage"]: s["value"]
              for s in prometheus.query(f"posttrain_hotload_stage_seconds_count{{{sel}}}")}
    assert counts == {"fetch": 3, "apply": 3, "validate": 3, "switch": 2, "probe": 2}
    assert _value(prometheus, f'posttrain_completions_requests_total{{{sel}, status="200"}}') >= 2
    assert _value(prometheus, f"posttrain_completion_tokens_total{{{sel}}}") > 0
    prometheus.clear()
