"""Generate dashboards/posttrain.json, the Grafana dashboard over what ``posttrain serve`` exports at /metrics.

Built with Grafana's Foundation SDK (``grafana-foundation-sdk``, the Grafana 11.6 schema; a dev dependency).
Run it after changing the dashboard and commit the JSON it writes; tests/test_dashboard.py checks that the
committed file is what this script writes, that it round-trips through the SDK's schema, and that every
metric it queries is one a scrape of the reference server shows. The metrics: docs/metrics.md.

    .venv/bin/python scripts/grafana_dashboard.py            # writes dashboards/posttrain.json
    .venv/bin/python scripts/grafana_dashboard.py --check    # exit 1 when the committed file differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    FieldColorModeId,
    DataTransformerConfig,
    DynamicConfigValue,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).resolve().parents[1] / "dashboards" / "posttrain.json"
UID = "posttrain-serve"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")  # every panel and query: the variable
# the gateways the panels show: Prometheus's own job and instance labels, present whatever the scrape config adds
SEL = 'job=~"$job", instance=~"$instance"'
WINDOW = "$window"  # hot-loads are rare: their rates and quantiles use a window of hours, not the scrape's
RATE = "$__rate_interval"  # requests and tokens: the usual rate window

# the replica state as one number per replica, for the state timeline's value mappings
REPLICA_STATE_CODES = {"READY": ("0", "green"), "LOADING": ("1", "blue"), "ERROR": ("2", "red")}


def counted(series: str, window: str) -> str:
    """How much each counter series of ``series`` grew over ``window``, its first sample included.
    ``increase()`` takes a series' first sample as its start: a series that appeared within the
    window at 1 (the first failure of a reason the server does not export at 0 from the start)
    would count 0. Such a series (no sample ``window`` ago) counts its whole value instead."""
    return f"(({series} unless {series} offset {window}) or increase({series}[{window}]))"


def _query(expr: str, legend: str = "__auto", ref: str = "A", *, instant: bool = False,
           table_format: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    if instant:
        q = q.instant()
    else:
        q = q.range()
    if table_format:
        q = q.format(PromQueryFormat.TABLE)
    return q


def _legend(mode: common.LegendDisplayMode = common.LegendDisplayMode.LIST,
            calcs: list[str] | None = None) -> common_b.VizLegendOptions:
    return (common_b.VizLegendOptions().show_legend(True).display_mode(mode)
            .placement(common.LegendPlacement.BOTTOM).calcs(calcs or []))


def _tooltip() -> common_b.VizTooltipOptions:
    return common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)


def _timeseries(title: str, description: str, unit: str, *queries: prometheus.Dataquery,
                width: int = 12, bars: bool = False) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
         .height(8).span(width).legend(_legend(common.LegendDisplayMode.TABLE, ["lastNotNull", "max"]))
         .tooltip(_tooltip()).line_width(1).fill_opacity(10).show_points(common.VisibilityMode.AUTO))
    if bars:
        p = p.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80).stacking(
            common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    for q in queries:
        p = p.with_target(q)
    return p


def _per_replica(label: str, numeric: bool = False) -> list[DataTransformerConfig]:
    """Turn each (instance, replica, <label>) series of an info metric into one frame per replica whose
    field is the label's value over time: the label becomes a column, the series are merged into one
    table and split again by instance and replica (``numeric``: the label's text converted to a number)."""
    convert = [DataTransformerConfig(id_val="convertFieldType", options={
        "conversions": [{"targetField": label, "destinationType": "number"}]})] if numeric else []
    return [
        DataTransformerConfig(id_val="labelsToFields",
                              options={"mode": "columns", "keepLabels": ["instance", "replica", label]}),
        DataTransformerConfig(id_val="merge", options={}),
        DataTransformerConfig(id_val="partitionByValues",
                              options={"fields": ["instance", "replica"], "keepFields": False,
                                       "naming": {"asLabels": True}}),
        *convert,
        DataTransformerConfig(id_val="organize", options={"excludeByName": {"Value": True}}),
    ]


def _replica_name() -> list[DynamicConfigValue]:
    return [DynamicConfigValue(id_val="displayName", value="${__field.labels.instance} ${__field.labels.replica}")]


def served_version_panels() -> list:
    info = f"posttrain_replica_snapshot_info{{{SEL}}}"
    identity = (statetimeline.Panel().title("Served snapshot per replica")
                .description("The snapshot identity each replica serves (posttrain_replica_snapshot_info); a "
                             "colour change is a hot-load. Empty identity: boot weights that name none.")
                .datasource(DATASOURCE).height(8).span(24)
                .with_target(_query(f"max by (instance, replica, identity) ({info})", "{{instance}} {{replica}}"))
                .show_value(common.VisibilityMode.AUTO).merge_values(True).row_height(0.8)
                .line_width(0).fill_opacity(70)
                .legend(_legend()).tooltip(_tooltip())
                .override_by_regexp("identity.*", _replica_name()))
    for t in _per_replica("identity"):
        identity = identity.with_transformation(t)
    version = (_timeseries("Policy version per replica", "The training step of the version each replica serves "
                           "(the identity's step-<N>, slime's weight_v<N>); flat between hot-loads.", "none",
                           _query(f"max by (instance, replica, policy_version) ({info})", "{{instance}} {{replica}}"))
               .decimals(0).override_by_regexp("policy_version.*", _replica_name()))
    for t in _per_replica("policy_version", numeric=True):
        version = version.with_transformation(t)
    now = (table.Panel().title("Served now").description("What each replica serves at the end of the time range.")
           .datasource(DATASOURCE).height(8).span(12)
           .with_target(_query(f"max by (instance, replica, identity, policy_version) ({info})", instant=True,
                               table_format=True))
           .with_transformation(DataTransformerConfig(
               id_val="organize", options={"excludeByName": {"Time": True, "Value": True},
                                           "indexByName": {"instance": 0, "replica": 1, "identity": 2,
                                                           "policy_version": 3}})))
    return [identity, version, now]


def replica_panels() -> list:
    state = f'posttrain_replica_state{{{SEL}, state="%s"}}'
    by = "max by (instance, replica)"
    code = f'{by} ({state % "LOADING"}) + 2 * {by} ({state % "ERROR"})'
    mapping = ValueMap(options={value: ValueMappingResult(text=name, color=color, index=i)
                                for i, (name, (value, color)) in enumerate(REPLICA_STATE_CODES.items())})
    timeline = (statetimeline.Panel().title("Replica state")
                .description("The state the hot-load API reports for each replica (posttrain_replica_state): "
                             "READY, LOADING (a hot-load in progress), ERROR.")
                .datasource(DATASOURCE).height(8).span(18).with_target(_query(code, "{{instance}} {{replica}}"))
                .mappings([mapping]).show_value(common.VisibilityMode.AUTO).merge_values(True).row_height(0.8)
                .line_width(0).fill_opacity(70)
                .legend(_legend()).tooltip(_tooltip())
                .color_scheme(dash_b.FieldColor().mode(FieldColorModeId.THRESHOLDS)))
    counts = (stat.Panel().title("Replicas by state").description("Replicas in each state now.")
              .datasource(DATASOURCE).height(8).span(6)
              .with_target(_query(f"sum by (state) (posttrain_replica_state{{{SEL}}})", "{{state}}", instant=True))
              .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
              .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.NONE)
              .override_by_name("ERROR", [DynamicConfigValue(id_val="color",
                                                             value={"mode": "fixed", "fixedColor": "red"})])
              .override_by_name("READY", [DynamicConfigValue(id_val="color",
                                                             value={"mode": "fixed", "fixedColor": "green"})]))
    return [timeline, counts]


def lag_panels() -> list:
    age = f"max by (instance) (posttrain_served_snapshot_age_seconds{{{SEL}}})"
    series = _timeseries("Sampling vs training lag", "Seconds since the version served was published "
                         "(posttrain_served_snapshot_age_seconds, from the ledger's published_at): how far "
                         "sampling is behind training. Absent for versions published without a ledger entry.",
                         "s", _query(age, "{{instance}}"), width=18)
    now = (stat.Panel().title("Served snapshot age").description("The lag now, per gateway.")
           .datasource(DATASOURCE).unit("s").height(8).span(6).with_target(_query(age, "{{instance}}", instant=True))
           .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
           .graph_mode(common.BigValueGraphMode.NONE))
    return [series, now]


def hotload_panels() -> list:
    bucket = f"posttrain_hotload_stage_seconds_bucket{{{SEL}}}"
    quantiles = [_query(f"histogram_quantile({q}, sum by (stage, le) (rate({bucket}[{WINDOW}])))",
                        f"{{{{stage}}}} p{round(q * 100)}", ref)
                 for q, ref in ((0.5, "A"), (0.95, "B"))]
    mean = _query(f"sum by (stage) (rate(posttrain_hotload_stage_seconds_sum{{{SEL}}}[{WINDOW}])) / "
                  f"sum by (stage) (rate(posttrain_hotload_stage_seconds_count{{{SEL}}}[{WINDOW}]))",
                  "{{stage}} mean")
    total = f"posttrain_hotloads_total{{{SEL}}}"
    failed = f'posttrain_hotloads_total{{{SEL}, outcome="failed"}}'
    return [
        _timeseries("Hot-load latency by stage (p50, p95)", "Seconds a hot-load spends in each stage (fetch, "
                    "apply, validate, switch, probe), over the $window window "
                    "(posttrain_hotload_stage_seconds).", "s", *quantiles),
        _timeseries("Hot-load mean seconds by stage", "Mean seconds per stage over the $window window "
                    "(the histogram's _sum / _count).", "s", mean),
        _timeseries("Hot-loads by outcome", "Hot-loads that finished in each $window window, completed or failed "
                    "(posttrain_hotloads_total).", "short",
                    _query(f"sum by (outcome) ({counted(total, WINDOW)})", "{{outcome}}"), bars=True),
        _timeseries("Hot-load failures by reason", "Failed hot-loads in each $window window by the failed "
                    "operation's condition reason (LayoutMismatch, SnapshotError, ChecksumMismatch, EngineError ...); "
                    "reasons without a failure in the window are left out.", "short",
                    _query(f"sum by (reason) ({counted(failed, WINDOW)}) > 0", "{{reason}}"), bars=True),
    ]


def request_panels() -> list:
    bucket = f"posttrain_completions_latency_seconds_bucket{{{SEL}}}"
    return [
        _timeseries("Requests by status", "POST /v1/completions requests answered per second, by HTTP status "
                    "(posttrain_completions_requests_total).", "reqps",
                    _query(f"sum by (status) (rate(posttrain_completions_requests_total{{{SEL}}}[{RATE}]))",
                           "{{status}}"), width=8),
        _timeseries("Tokens per second", "Tokens generated and prompt tokens read per second "
                    "(posttrain_completion_tokens_total, posttrain_prompt_tokens_total).", "short",
                    _query(f"sum(rate(posttrain_completion_tokens_total{{{SEL}}}[{RATE}]))", "generated", "A"),
                    _query(f"sum(rate(posttrain_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt", "B"), width=8),
        _timeseries("Completion latency (p50, p95)", "Seconds from reading a completions request to its answer, "
                    "every status (posttrain_completions_latency_seconds).", "s",
                    *[_query(f"histogram_quantile({q}, sum by (le) (rate({bucket}[{RATE}])))", f"p{round(q * 100)}",
                             ref) for q, ref in ((0.5, "A"), (0.95, "B"))], width=8),
    ]


def variables() -> list:
    def label_values(name: str, query: str, label: str) -> dash_b.QueryVariable:
        return (dash_b.QueryVariable(name).label(label).datasource(DATASOURCE)
                .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1})
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*")
                .current(VariableOption(selected=True, text=["All"], value=["$__all"])))

    window = (dash_b.IntervalVariable("window").label("hot-load window").values("15m,1h,6h,1d,7d")
              .current(VariableOption(selected=True, text="1h", value="1h")))
    return [
        dash_b.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        label_values("job", "label_values(posttrain_replica_state, job)", "job"),
        label_values("instance", 'label_values(posttrain_replica_state{job=~"$job"}, instance)', "gateway"),
        window,
    ]


def annotations() -> list:
    builtin = (dash_b.AnnotationQuery().name("Annotations & Alerts").built_in(1).type("dashboard").enable(True)
               .hide(True).icon_color("rgba(0, 211, 255, 1)")
               .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --")))
    hotloads = (dash_b.AnnotationQuery().name("Hot-loads").datasource(DATASOURCE).enable(True).icon_color("purple")
                .expr(f"sum by (outcome) ({counted(f'posttrain_hotloads_total{{{SEL}}}', '2m')}) > 0"))
    return [builtin, hotloads]


def build() -> dict:
    """The dashboard, as the JSON Grafana imports."""
    d = (dash_b.Dashboard("posttrain serve").uid(UID).tags(["posttrain"]).editable()
         .description("What posttrain serve exports at /metrics (docs/metrics.md): the version each replica "
                      "serves, replica states, hot-loads, sampling-vs-training lag, requests and tokens.")
         .time("now-6h", "now").refresh("30s").timezone("browser")
         .tooltip(DashboardCursorSync.CROSSHAIR))
    for v in variables():
        d = d.with_variable(v)
    for a in annotations():
        d = d.annotation(a)
    rows = [("Served version", served_version_panels()), ("Replicas", replica_panels()),
            ("Sampling vs training lag", lag_panels()), ("Hot-loads", hotload_panels()), ("Requests", request_panels())]
    for title, panels in rows:
        d = d.with_row(dash_b.Row(title))
        for p in panels:
            d = d.with_panel(p)
    data = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    for i, panel in enumerate(data["panels"], 1):  # stable ids, in order
        panel["id"] = i
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run scripts/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
