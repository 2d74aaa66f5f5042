"""/metrics of posttrain serve (reference server, in this process): what a scrape reads after a full,
a delta and a failing hot-load, and who may scrape (the token on the main port; a separate
--metrics-port without it only on loopback or with --metrics-no-auth)."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from posttrain.inference.contract import HotLoadFailed
from posttrain.inference.protocol import TYPE_INCREMENTAL
from posttrain.serve.metrics import COMPLETION_STATUSES, HOTLOAD_FAILURE_REASONS, policy_version
from tests.support.serving import TOKEN, Api

AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAULT_REASON = "injected: replica could not apply the delta"


def scrape(url: str, headers: dict | None = None) -> dict[str, list]:
    """name -> [(labels, value)] of every sample of a /metrics scrape (with the token)."""
    r = requests.get(f"{url}/metrics", headers=AUTH if headers is None else headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain")
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_hotloads_and_completions_are_counted_and_the_served_identity_is_the_only_info_series(
        make_server, make_client, chain):
    server = make_server(replicas=2)
    api, client = Api(server.url), make_client(server)
    client.hot_load(chain.full)
    client.hot_load(chain.d1, base_identity=chain.full)
    api.faults({"kind": "fail_hotload", "reason": FAULT_REASON, "snapshot_type": TYPE_INCREMENTAL})
    with pytest.raises(HotLoadFailed):
        client.hot_load(chain.d2, base_identity=chain.d1)
    api.greedy()
    api.greedy(max_tokens=4)
    refused = api.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "top_k": 3})
    assert refused.status_code == 400

    m = scrape(server.url)
    info = m["posttrain_replica_snapshot_info"]
    assert sorted(lab["replica"] for lab, _ in info) == ["replica-0000", "replica-0001"]
    assert {(lab["identity"], lab["policy_version"], v) for lab, v in info} == {(chain.d1, "1", 1.0)}
    for replica in ("replica-0000", "replica-0001"):
        assert value(m, "posttrain_replica_state", replica=replica, state="READY") == 1
        assert value(m, "posttrain_replica_state", replica=replica, state="LOADING") == 0
        assert value(m, "posttrain_replica_state", replica=replica, state="ERROR") == 0
    assert value(m, "posttrain_hotloads_total", outcome="completed", reason="") == 2
    assert value(m, "posttrain_hotloads_total", outcome="failed", reason="InjectedFault") == 1
    # the injected failure comes before the fetch: no stage counts it
    for stage, n in {"fetch": 2, "apply": 2, "validate": 2, "switch": 2, "probe": 2}.items():
        assert value(m, "posttrain_hotload_stage_seconds_count", stage=stage) == n, stage
        assert value(m, "posttrain_hotload_stage_seconds_sum", stage=stage) > 0, stage
    assert value(m, "posttrain_completions_requests_total", status="200") == 2
    assert value(m, "posttrain_completions_requests_total", status="400") == 1
    assert value(m, "posttrain_completion_tokens_total") == 12  # greedy 8 + 4 (no EOS in the tiny model's reach)
    assert value(m, "posttrain_prompt_tokens_total") == 10
    assert value(m, "posttrain_completions_latency_seconds_count") == 3
    # a chain written without the publisher records no publish time: no age series rather than a guess
    assert "posttrain_served_snapshot_age_seconds" not in m


def test_snapshot_age_comes_from_the_ledger(make_server, make_client, chain, store_copy):
    import time

    from posttrain.publish.ledger import Ledger, LedgerEntry
    from posttrain.storage import open_store
    from tests.support.serving import PREFIX

    published = time.time() - 100
    with open_store(str(store_copy / PREFIX)) as store:
        Ledger(store, "r1").put(LedgerEntry(identity=chain.full, kind="full", base=None, step=0, run="r1", files={},
                                            raw_bytes=1, stored_bytes=1, changed_tensors=1, total_tensors=1,
                                            density=1.0, published_at=published))
    server = make_server(store=store_copy)
    make_client(server).hot_load(chain.full)
    age = value(scrape(server.url), "posttrain_served_snapshot_age_seconds")
    assert 100 <= age < 100 + 60


def test_main_port_needs_the_token(server):
    r = requests.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 401
    assert "posttrain_hotloads_total" not in r.text
    assert requests.get(f"{server.url}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert "posttrain_replica_state" in scrape(server.url)


def test_loopback_metrics_port_needs_no_token_and_takes_metrics_off_the_main_port(make_server):
    server = make_server(metrics_port=0)
    assert server.metrics_url != server.url
    assert "posttrain_replica_snapshot_info" in scrape(server.metrics_url, headers={})
    assert requests.get(f"{server.url}/metrics", headers=AUTH, timeout=10).status_code == 404
    assert requests.get(f"{server.metrics_url}/v1/models", headers=AUTH, timeout=10).status_code == 404


def test_metrics_port_on_a_non_loopback_host_needs_the_token_unless_no_auth(make_server):

    from posttrain.serve.serve_config import ServeConfig, metrics_need_token

    # the rule itself, for hosts this machine may not have
    base = dict(model_dir="m", deployment_id="d", store="s", token="t", allow_remote=True)
    assert metrics_need_token(ServeConfig(**base, host="10.0.0.5", metrics_port=9100))
    assert not metrics_need_token(ServeConfig(**base, host="10.0.0.5", metrics_port=9100, metrics_no_auth=True))
    assert not metrics_need_token(ServeConfig(**base, host="::1", metrics_port=9100))
    assert metrics_need_token(ServeConfig(**base, host="127.0.0.1"))  # the main port: always
    with pytest.raises(ValueError, match="metrics_no_auth"):
        ServeConfig(**base, metrics_no_auth=True)

    # and a real server bound to every address (reached over loopback here)
    server = make_server(host="0.0.0.0", allow_remote=True, metrics_port=0)  # noqa: S104 - the test's point
    url = server.metrics_url.replace("0.0.0.0", "127.0.0.1")
    assert requests.get(f"{url}/metrics", timeout=10).status_code == 401
    assert "posttrain_replica_state" in scrape(url)
    open_server = make_server(host="0.0.0.0", allow_remote=True, metrics_port=0, metrics_no_auth=True)  # noqa: S104
    assert "posttrain_replica_state" in scrape(open_server.metrics_url.replace("0.0.0.0", "127.0.0.1"), headers={})


def test_policy_version_is_the_identitys_step():
    assert policy_version("step-00000100-abcdef") == "100"
    assert policy_version("weight_v000007") == "7"
    assert policy_version("fallback-full-m1") == ""
    assert policy_version(None) == ""


def test_two_servers_in_one_process_keep_their_figures_apart(make_server, make_client, chain):
    a, b = make_server(), make_server()
    make_client(a).hot_load(chain.full)
    assert value(scrape(a.url), "posttrain_hotloads_total", outcome="completed", reason="") == 1
    assert value(scrape(b.url), "posttrain_hotloads_total", outcome="completed", reason="") == 0


def test_every_known_failure_and_status_has_its_series_at_0_before_any_happens(server):
    """Prometheus's increase() counts no series' first sample: a failure whose series appeared at 1 was
    0 on the dashboard. Every reason a hot-load fails with by design, and every status the server
    answers itself, is exported at 0 from the start."""
    m = scrape(server.url)
    for reason in HOTLOAD_FAILURE_REASONS:
        assert value(m, "posttrain_hotloads_total", outcome="failed", reason=reason) == 0, reason
    for status in COMPLETION_STATUSES:
        assert value(m, "posttrain_completions_requests_total", status=status) == 0, status
    assert value(m, "posttrain_hotloads_total", outcome="completed", reason="") == 0
    assert {"400", "404", "503"} <= set(COMPLETION_STATUSES)


def test_the_known_failure_reasons_are_the_classes_a_hot_load_raises():
    """Each reason is the name of an error class of the load path (a reason is the error's class name),
    so a renamed class does not leave its series at 0 for ever beside the new name's."""
    from posttrain.chain import errors as chain_errors
    from posttrain.chain import fetch
    from posttrain.serve import adapters, engine, hotload_service
    from posttrain.storage import errors as storage_errors

    classes = {name for module in (chain_errors, fetch, adapters, engine, hotload_service, storage_errors)
               for name, obj in vars(module).items() if isinstance(obj, type) and issubclass(obj, Exception)}
    assert set(HOTLOAD_FAILURE_REASONS) - {"Unknown"} <= classes
    assert len(set(HOTLOAD_FAILURE_REASONS)) == len(HOTLOAD_FAILURE_REASONS)
