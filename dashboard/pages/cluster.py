"""Cluster (``/cluster?node=N``): nodes ranked by how often they slowed a job — a rank of theirs was a
straggler, or the node's collectives were slower than its peers' (network-slow) — with their median
busbw ratio over runs and their latest per-node microbenchmarks (``fleetscope bench``); one node's
runs below when chosen. Read through ``reports.node_list`` / ``reports.node_detail`` (``GET /api/v1/nodes``).
Beside the table, nodes ranked by device trouble from the agents' GPU telemetry (``reports.node_device_trouble``,
``GET /api/v1/devices/nodes``): XID events, ECC errors, the share of telemetry time throttled."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output, clientside_callback, dcc, html
from fleetscope.server import reports

from .. import _state
from .. import figures as F
from ..components import (
    URL_SYNC_JS,
    callback,
    empty_state,
    graph,
    kpi,
    kpi_strip,
    loading,
    page_header,
    section,
    simple_table,
)
from ..theme import FONT, SERIES_COLORS, fmt_num, fmt_pct, fmt_time

dash.register_page(__name__, path="/cluster", name="Cluster", title="fleetscope · cluster", order=6)

NODE = "cluster-node"
URL = "cluster-url"
KPIS = "cluster-kpis"
CHART = "cluster-chart"
TABLE = "cluster-table"
DETAIL = "cluster-detail"
EMPTY = "cluster-empty"
DEVICES = "cluster-devices"
DEVICE_NODES = 20  # nodes listed by device trouble, worst first
DEVICE_READ = 500  # nodes read to rank (the store orders by runs throttled; the page by errors, then share)
CHART_NODES = 30  # nodes drawn in the chart (the worst of the table's)
TABLE_NODES = 50  # nodes listed, worst first ("showing N of M" says how many more; GET /api/v1/nodes pages through all): Dash renders ~3 ms per cell, 200 rows took 7 s


def layout(node: str | None = None, **_: Any) -> html.Div:
    try:
        data = reports.node_list(_state.engine(), limit=TABLE_NODES)
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    if not data["nodes"]:
        return html.Div([page_header("Cluster"), empty_state(
            "No nodes yet",
            "Every node that ran a rank shows here, ranked by how often it slowed a job: a straggler rank on it, or "
            "collectives slower than its peers' (network-slow); with its latest per-node microbenchmarks.",
            ["fleetscope simulate --server URL --run r1 --family vla-7b --ranks 32 --steps 50 --slow-node node0002=2",
             "fleetscope bench --server URL --token T   # on each node: per-node matmul, memory, all-reduce busbw"],
            eid=EMPTY)])
    names = [n["node"] for n in data["nodes"]]
    return html.Div([
        page_header("Cluster", "Nodes ranked by how often they slowed a job (stragglers, slow network), over all runs.",
                    dcc.Dropdown(id=NODE, options=[{"label": n, "value": n} for n in names],
                                 value=node if node in names else None, placeholder="one node's runs…",
                                 className="fs-control")),
        dcc.Store(id=URL),
        loading(html.Div(id=KPIS)),
        section(None, loading(graph(CHART))),
        loading(html.Div(id=DETAIL)),
        html.Div([
            section("Nodes", loading(html.Div(id=TABLE)), cls="fs-cluster-nodes"),
            section("Device trouble", loading(html.Div(id=DEVICES)), sid="cluster-device-section",
                    cls="fs-cluster-devices"),
        ], className="fs-row fs-cluster-split"),
    ])


def _mb(n: dict[str, Any], name: str) -> str:
    f = (n.get("microbench") or {}).get(name)
    if not f:
        return "–"
    vs = f" ({fmt_pct(f['vs_median'], 0)} of median)" if f.get("vs_median") is not None else ""
    return f"{fmt_num(f['value'])} {f.get('unit') or ''}{vs}"


@F.guarded
def slowed_figure(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs each node slowed, split by cause: straggler ranks and slow network (most first)."""
    top = [n for n in nodes if n["slowed_runs"]][:CHART_NODES]
    if not top:
        return F.empty_figure("No node slowed a job: no straggler rank and no network-slow node in any run.")
    x = [F.plain(n["node"]) for n in top]  # node names are user text: escaped for Plotly
    data = [{"type": "bar", "name": label, "x": x, "y": [n[key] for n in top], "marker": {"color": color},
             "hovertemplate": "%{x}: %{y} run(s) " + label + "<extra></extra>"}
            for key, label, color in (("straggler_runs", "with a straggler rank", SERIES_COLORS[1]),
                                      ("slow_network_runs", "network-slow", SERIES_COLORS[0]))]
    return {"data": data, "layout": {
        "title": {"text": "<b>Runs each node slowed</b>", "x": 0.0, "xanchor": "left", "font": {"size": 13}},
        "barmode": "group", "height": 300, "margin": {"l": 56, "r": 16, "t": 40, "b": 80},
        "font": {"family": FONT, "size": 11}, "paper_bgcolor": "white", "plot_bgcolor": "white",
        "xaxis": {"title": {"text": "node"}, "type": "category"}, "yaxis": {"title": {"text": "runs"}, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": 1.12}}}


def _table(nodes: list[dict[str, Any]]) -> html.Table:
    rows = []
    for i, n in enumerate(nodes, 1):
        rows.append([i, dcc.Link(n["node"], href=f"/cluster?node={quote(n['node'], safe='')}"), n["runs"],
                     f"{n['slowed_runs']}" + (f" ({fmt_pct(n['slowed_share'], 0)})" if n["slowed_share"] is not None else ""),
                     n["straggler_runs"], n["slow_network_runs"],
                     fmt_num(n["busbw_ratio_median"]), fmt_num(n["latency_ratio_median"]), fmt_time(n["last_seen"]),
                     _mb(n, "matmul_tflops"), _mb(n, "mem_bandwidth"), _mb(n, "all_reduce_busbw")])
    cls = ["fs-differs" if n["slowed_runs"] else "" for n in nodes]
    return simple_table(["#", "node", "runs", "slowed", "straggler runs", "slow-network runs", "busbw ratio",
                         "latency ratio", "last seen", "matmul", "memory bw", "all-reduce busbw"], rows,
                        numeric=(0, 2, 3, 4, 5, 6, 7), tid="cluster-nodes", row_classes=cls)


def _detail(node: str | None) -> Any:
    if not node:
        return None
    d = reports.node_detail(_state.engine(), node)
    if d is None:
        return empty_state(f"No node {node!r}", "It ran no rank of a run and no per-node microbenchmark.")
    rows = [[dcc.Link(r["name"], href=f"/runs/{r['run_id']}"), r["ranks"], r["straggler_ranks"], r["slow_ranks"],
             "yes" if r["slow_network"] else "no", fmt_num(r["busbw_ratio"]), fmt_num(r["latency_ratio"]),
             fmt_time(r["seen_at"])] for r in d["run_history"]]
    table = simple_table(["run", "ranks", "straggler ranks", "network-slow ranks", "network-slow node", "busbw ratio",
                          "latency ratio", "seen"], rows, numeric=(1, 2, 3, 5, 6), tid="cluster-node-runs")
    mb = d.get("microbench") or {}
    bench = [html.Div(f"{name}: {_mb(d, name)}" + (
        "  ·  by size: " + ", ".join(f"{int(k) >> 20} MiB {fmt_num(v)}" for k, v in f["by_size"].items())
        if f.get("by_size") else ""), className="fs-muted") for name, f in sorted(mb.items())]
    return section(f"Node {node}: {d['runs']} run(s), slowed {d['slowed_runs']}", [table, *bench], sid="cluster-node")


@callback(Output(KPIS, "children"), Output(CHART, "figure"), Output(TABLE, "children"), Output(DETAIL, "children"),
          Input(NODE, "value"))
def _fill(node: str | None) -> tuple[Any, ...]:
    data = reports.node_list(_state.engine(), limit=TABLE_NODES, refresh=0)  # the layout just refreshed
    nodes = data["nodes"]
    kpis = kpi_strip([
        kpi("nodes", f"{data['total']:,}"),
        kpi("slowed a job", f"{data['slowed_total']:,}", tone="bad" if data["slowed_total"] else None),
        kpi("network-slow", f"{data['slow_network_total']:,}"),
        kpi("runs not assessed yet", f"{data['pending_runs']:,}", "brought up to date on the next loads"),
    ], kid="cluster-kpi-strip")
    shown = html.Div(f"Showing the {len(nodes):,} worst of {data['total']:,} nodes" if data["total"] > len(nodes)
                     else f"Showing all {len(nodes):,} nodes", className="fs-muted", id="cluster-shown")
    return kpis, slowed_figure(nodes), html.Div([shown, _table(nodes)]), _detail(node)


def _device_table(nodes: list[dict[str, Any]]) -> Any:
    bad = reports.rank_device_nodes(nodes)
    if not bad:
        return html.Div(f"No GPU throttled or logged XID / ECC errors on the {len(nodes):,} node(s) with device "
                        "telemetry." if nodes else "No device telemetry yet (the agent sends it from jobs on NVIDIA "
                        "GPUs; fleetscope simulate --throttle RANK:REASON for a test).", className="fs-muted",
                        id="cluster-devices-none")
    rows = [[i, dcc.Link(n["node"], href=f"/cluster?node={quote(n['node'], safe='')}"), n["xid_windows"],
             n["ecc_errors"], fmt_pct(n["throttled_share"], 0), f"{n['runs_throttled']} of {n['runs']}"]
            for i, n in enumerate(bad[:DEVICE_NODES], 1)]
    shown = html.Div(f"{len(bad):,} of {len(nodes):,} node(s) with telemetry had trouble"
                     + (f"; the {DEVICE_NODES} worst" if len(bad) > DEVICE_NODES else ""), className="fs-muted")
    return html.Div([shown, simple_table(["#", "node", "XID windows", "ECC errors", "time throttled", "runs throttled"],
                                         rows, numeric=(0, 2, 3, 4), tid="cluster-device-nodes",
                                         row_classes=["fs-differs" if n["xid_windows"] or n["ecc_errors"] else ""
                                                      for n in bad[:DEVICE_NODES]])])


@callback(Output(DEVICES, "children"), Input(NODE, "value"))
def _fill_devices(_node: str | None) -> Any:
    return _device_table(reports.node_device_trouble(_state.engine(), limit=DEVICE_READ))


clientside_callback(f"function(n) {{ return ({URL_SYNC_JS})([['node', n]]); }}", Output(URL, "data"), Input(NODE, "value"))
