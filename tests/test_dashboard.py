"""dashboards/posttrain.json, the Grafana dashboard (scripts/grafana_dashboard.py writes it): the committed file is
what the generator writes, it round-trips through Grafana's schema (the Foundation SDK's models, Grafana 11.6),
every panel queries the datasource variable, and every metric it queries is one a scrape of the reference server
exports, while every family the server exports is on it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.scripts import load_script
from tests.support.serving import PREFIX, TOKEN, Api

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "posttrain.json"
SCHEMA_VERSION = 41  # Grafana 11.6's dashboard schema, the SDK's default
METRIC = re.compile(r"\bposttrain_[a-z_]+")
# Families the server exports that the dashboard deliberately leaves off, each with why (none today). A family
# added to posttrain/serve/metrics.py fails test_every_metric_is_exported_and_every_family_shown until it gets a
# panel or a line here.
NOT_ON_THE_DASHBOARD: dict[str, str] = {}
# The one rule besides: prometheus_client exports, beside each counter and histogram, a gauge family
# `<name>_created` (when the series was created, a Unix time), not a figure of the server; it is left off when
# the family it belongs to is on the dashboard.
CREATED = "_created"


def generator():
    return load_script("grafana_dashboard")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(dashboard: dict) -> list[dict]:
    """Every panel that queries (rows left out; a collapsed row's panels included)."""
    out = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return exprs


def test_the_committed_json_is_what_the_generator_writes():
    assert DASHBOARD.read_text(encoding="utf-8") == generator().render(), \
        "dashboards/posttrain.json is out of date: run .venv/bin/python scripts/grafana_dashboard.py"


def test_the_dashboard_round_trips_through_grafanas_schema(dashboard):
    from grafana_foundation_sdk.cog import runtime
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

    register_default_plugins()
    model = Dashboard.from_json(dashboard)
    # nothing the schema does not know is dropped, nothing is changed
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == dashboard
    assert model.schema_version == SCHEMA_VERSION
    for p in model.panels:
        if isinstance(p, RowPanel):
            continue
        assert isinstance(p, Panel)
        config = runtime.panelcfg_config(p.type_val)
        assert config is not None and config.options_from_json_hook is not None, f"unknown panel type {p.type_val}"
        assert not isinstance(p.options, dict), (p.title, "options not decoded by the panel's schema")
        assert p.targets and all(isinstance(t, prometheus.Dataquery) for t in p.targets), p.title


def test_every_panel_queries_the_datasource_variable_and_the_gateway_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == variables["instance"]["type"] == "query"
    ref = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard):
        assert p["datasource"] == ref, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ref, p["title"]
            assert 'job=~"$job", instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == ref


def test_panel_types(dashboard):
    kinds = {p["type"] for p in panels(dashboard)}
    assert {"state-timeline", "timeseries", "stat", "table"} == kinds


def scrape(url: str) -> dict[str, str]:
    """sample name -> its family's name, of a /metrics scrape (with the token)."""
    r = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return {s.name: family.name for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_every_metric_is_exported_and_every_family_shown(dashboard, make_server, make_client, chain, store_copy):
    from posttrain.publish.ledger import Ledger, LedgerEntry
    from posttrain.storage import open_store

    # a publish time for the served version, so the age gauge has a sample too
    with open_store(str(store_copy / PREFIX)) as store:
        Ledger(store, "r1").put(LedgerEntry(identity=chain.full, kind="full", base=None, step=0, run="r1", files={},
                                            raw_bytes=1, stored_bytes=1, changed_tensors=1, total_tensors=1,
                                            density=1.0, published_at=time.time() - 10))
    server = make_server(store=store_copy, replicas=2)
    make_client(server).hot_load(chain.full)
    Api(server.url).greedy()
    exported = scrape(server.url)  # sample name -> family

    queried = {m for e in expressions(dashboard) for m in METRIC.findall(e)}
    assert queried, "no metric found in the dashboard's queries"
    unknown = sorted(queried - set(exported))
    assert not unknown, f"the dashboard queries metrics the server does not export: {unknown}"
    # histograms are queried by their series (_bucket, _sum, _count), never by the bare family name
    shown = {exported[m] for m in queried}
    families = set(exported.values())
    created = {f for f in families if f.endswith(CREATED) and f.removesuffix(CREATED) in shown}
    missing = sorted(families - shown - created - set(NOT_ON_THE_DASHBOARD))
    assert not missing, f"exported but on no panel (add one, or to NOT_ON_THE_DASHBOARD with why): {missing}"
    assert not set(NOT_ON_THE_DASHBOARD) - families, "NOT_ON_THE_DASHBOARD names a family the server does not export"
    # counters' _created series are prometheus_client's, not figures: none is queried
    assert not any(m.endswith("_created") for m in queried)


def test_the_metric_regex_maps_series_to_families():
    found = METRIC.findall('histogram_quantile(0.5, sum by (le) (rate(posttrain_hotload_stage_seconds_bucket{a="b"}'
                           '[5m]))) / posttrain_hotloads_total')
    assert found == ["posttrain_hotload_stage_seconds_bucket", "posttrain_hotloads_total"]


def panel_expr(dashboard: dict, title: str, instance: str, window: str) -> str:
    """The panel's (first) query as Grafana sends it for one gateway and hot-load window."""
    expr = next(p for p in panels(dashboard) if p["title"] == title)["targets"][0]["expr"]
    return expr.replace("$job", ".*").replace("$instance", instance).replace("$window", window)


def window_since(start: float, at: float) -> str:
    return f"{int((at - start) * 1000)}ms"


def test_hot_loads_by_outcome_counts_the_first_failure_of_a_reason(dashboard, prometheus):
    """A failure whose series appears at 1 (a reason the server does not export at 0 from the start) is
    counted by the dashboard, where increase() alone counts 0 (a series' first sample is its start)."""
    from prometheus_client import start_http_server

    from posttrain.serve.metrics import HOTLOAD_FAILURE_REASONS, ServeMetrics

    metrics = ServeMetrics()
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        instance = prometheus.scrape(f"http://127.0.0.1:{httpd.server_port}")
        prometheus.wait_scraped(instance, time.time())  # every series exists, at 0
        start = time.time()  # the window begins here
        prometheus.wait_scraped(instance, start)  # a 0 inside the window too
        assert "OSError" not in HOTLOAD_FAILURE_REASONS
        metrics.hotload_finished(True, "", {})
        metrics.hotload_finished(False, "OSError", {})  # its series appears now, at 1
        prometheus.wait_scraped(instance, time.time())
        at = time.time()
        window = window_since(start, at)
        shown = {s["metric"]["outcome"]: s["value"] for s in
                 prometheus.query(panel_expr(dashboard, "Hot-loads by outcome", instance, window), at=at)}
        assert shown["failed"] == 1
        assert 1 <= shown["completed"] < 2  # increase(), extrapolated to the window's end
        by_reason = {s["metric"]["reason"]: s["value"] for s in
                     prometheus.query(panel_expr(dashboard, "Hot-load failures by reason", instance, window), at=at)}
        assert by_reason == {"OSError": 1}
        plain = prometheus.query(f'sum(increase(posttrain_hotloads_total{{instance="{instance}", outcome="failed"}}'
                                 f"[{window}]))", at=at)
        assert plain[0]["value"] == 0  # what the panel showed with increase() alone
    finally:
        prometheus.clear()
        httpd.shutdown()
        httpd.server_close()


def test_the_first_refused_hot_load_and_the_first_400_are_counted(dashboard, prometheus, make_server, make_client,
                                                                   chain):
    """The reference server exports its known failure reasons and statuses at 0 from the start, so the
    first refused hot-load and the first 400 are an increase from 0 that increase() counts."""
    from posttrain.inference.contract import HotLoadFailed

    server = make_server()
    api = Api(server.url)
    instance = prometheus.scrape(server.url, TOKEN)
    prometheus.wait_scraped(instance, time.time())
    start = time.time()
    prometheus.wait_scraped(instance, start)
    api.faults({"kind": "fail_hotload", "reason": "injected"})
    with pytest.raises(HotLoadFailed):
        make_client(server).hot_load(chain.full)
    assert api.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "top_k": 3}).status_code == 400
    prometheus.wait_scraped(instance, time.time())
    at = time.time()
    window = window_since(start, at)
    try:
        sel = f'instance="{instance}"'
        failed = prometheus.query(f'sum(increase(posttrain_hotloads_total{{{sel}, outcome="failed"}}[{window}]))',
                                  at=at)
        assert 1 <= failed[0]["value"] < 2
        refused = prometheus.query(f'sum(increase(posttrain_completions_requests_total{{{sel}, status="400"}}'
                                   f"[{window}]))", at=at)
        assert 1 <= refused[0]["value"] < 2
        shown = {s["metric"]["outcome"]: s["value"] for s in
                 prometheus.query(panel_expr(dashboard, "Hot-loads by outcome", instance, window), at=at)}
        assert 1 <= shown["failed"] < 2
    finally:
        prometheus.clear()
