"""Benchmarks (``/benchmarks?cluster=C``): microbenchmark series over time (matmul TFLOP/s, collective
busbw) per cluster, and collective busbw against message size."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, clientside_callback, dcc, html
from fleetscope.server import reports

from .. import _state
from .. import figures as F
from ..components import URL_SYNC_JS, callback, empty_state, graph, loading, page_header, section

dash.register_page(__name__, path="/benchmarks", name="Benchmarks", title="fleetscope · benchmarks", order=5)

CLUSTER = "benchmarks-cluster"
URL = "benchmarks-url"
CHARTS = "benchmarks-charts"


def layout(cluster: str | None = None, **_: Any) -> html.Div:
    try:
        series = reports.benchmarks_view(_state.engine())
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    if not series:
        return html.Div([page_header("Benchmarks"), empty_state(
            "No microbenchmarks yet",
            "Matmul TFLOP/s and collective bus bandwidth by message size, per cluster and over time, appear here; a drop "
            "raises a regression alert.",
            ["fleetscope bench --server URL --token T   # on each cluster, e.g. nightly"], eid="benchmarks-empty")])
    clusters = sorted({s["cluster"] for s in series})
    return html.Div([
        page_header("Benchmarks", "Microbenchmarks per cluster over time.",
                    dcc.Dropdown(id=CLUSTER, options=[{"label": c, "value": c} for c in clusters],
                                 value=cluster if cluster in clusters else None, placeholder="all clusters",
                                 className="fs-control")),
        dcc.Store(id=URL),
        loading(html.Div(id=CHARTS)),
    ])


@callback(Output(CHARTS, "children"), Input(CLUSTER, "value"))
def _fill(cluster: str | None) -> Any:
    series = [s for s in reports.benchmarks_view(_state.engine()) if not cluster or s["cluster"] == cluster]
    names = sorted({s["name"] for s in series})
    charts = [section(None, graph("benchmarks-size", F.busbw_by_size_figure(series)))] if any(
        (s.get("params") or {}).get("bytes") is not None for s in series) else []
    charts += [section(None, graph(f"benchmarks-{i}", F.benchmark_figure(series, n)), cls="fs-col-6")
               for i, n in enumerate(names)]
    return html.Div(charts, className="fs-row")


clientside_callback(f"function(c) {{ return ({URL_SYNC_JS})([['cluster', c]]); }}", Output(URL, "data"), Input(CLUSTER, "value"))
