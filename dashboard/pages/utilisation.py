"""Utilisation (``/utilisation?days=7``, or ``?since=…&until=…``): the fleet's GPU-hours over a window per team,
model family and UTC day — how much of it ran steps, how much sat allocated but idle (initialisation, hangs,
stalls, checkpoints, failures), failed and redone work, MFU-weighted GPU-hours. Read through
``reports.fleet_utilisation`` (``GET /api/v1/fleet/utilisation``; definitions in docs/metrics.md)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import dash
from dash import Input, Output, State, clientside_callback, dcc, html
from fleetscope.server import reports
from fleetscope.server.reports.utilisation import parse_time

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
from ..theme import FONT, SERIES_COLORS, fmt_pct

dash.register_page(__name__, path="/utilisation", name="Utilisation", title="fleetscope · utilisation", order=7)

DAYS = "util-days"
RANGE = "util-range"
URL = "util-url"
KPIS = "util-kpis"
CHART = "util-chart"
TEAMS = "util-teams"
FAMILIES = "util-families"
NOTE = "util-note"
CHOICES = (1, 7, 14, 30, 92)


def _hours(v: float | None) -> str:
    return "–" if v is None else f"{v:,.2f}"


def layout(days: str | None = None, since: str | None = None, until: str | None = None, **_: Any) -> html.Div:
    try:
        _state.engine()
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    try:
        d = int(days) if days else 7
    except ValueError:
        d = 7
    custom = bool(since or until)
    options = [{"label": f"last {n} day{'s' if n > 1 else ''}", "value": n} for n in CHOICES]
    if d not in CHOICES:
        options.append({"label": f"last {d} days", "value": d})
    return html.Div([
        page_header("Utilisation", "GPU-hours per team, family and day: how much ran steps, how much sat allocated "
                    "but idle, failed and redone work, MFU-weighted GPU-hours.",
                    dcc.Dropdown(id=DAYS, options=options, value=None if custom else d, clearable=False,
                                 placeholder="custom window (since/until in the URL)", className="fs-control")),
        dcc.Store(id=RANGE, data={"since": since, "until": until} if custom else None),
        dcc.Store(id=URL),
        loading(html.Div(id=KPIS)),
        html.Div(id=NOTE, className="fs-muted"),
        section(None, loading(graph(CHART))),
        section("Per team", loading(html.Div(id=TEAMS))),
        section("Per model family", loading(html.Div(id=FAMILIES))),
    ])


def _table(rows: list[dict[str, Any]], key: str, tid: str) -> Any:
    if not rows:
        return html.Div("No runs in this window.", className="fs-muted")
    body = [[r[key] or f"(no {key})", _hours(r["gpu_hours"]), _hours(r["busy_gpu_hours"]), _hours(r["idle_gpu_hours"]),
             fmt_pct(r["idle_share"], 0), _hours(r["failed_gpu_hours"]), _hours(r["redone_gpu_hours"]),
             _hours(r["mfu_gpu_hours"]), fmt_pct(r["mfu"], 1), fmt_pct(r["mfu_unknown_share"], 0), r["runs"]]
            for r in rows]
    return simple_table([key, "GPU-hours", "running steps", "idle", "idle share", "failed runs", "redone",
                         "MFU-weighted", "MFU", "MFU unknown", "runs"], body, numeric=tuple(range(1, 11)), tid=tid)


@F.guarded
def day_figure(days: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU-hours per UTC day, stacked: running steps and allocated-but-idle."""
    if not days:
        return F.empty_figure("No run used a GPU in this window.")
    x = [d["date"] for d in days]
    data = [{"type": "bar", "name": label, "x": x, "y": [d[key] for d in days], "marker": {"color": color},
             "hovertemplate": "%{x}: %{y:,.2f} GPU-h " + label + "<extra></extra>"}
            for key, label, color in (("busy_gpu_hours", "running steps", SERIES_COLORS[0]),
                                      ("idle_gpu_hours", "allocated, idle", SERIES_COLORS[1]))]
    return {"data": data, "layout": {
        "title": {"text": "<b>GPU-hours per day (UTC)</b>", "x": 0.0, "xanchor": "left", "font": {"size": 13}},
        "barmode": "stack", "height": 300, "margin": {"l": 56, "r": 16, "t": 40, "b": 60},
        "font": {"family": FONT, "size": 11}, "paper_bgcolor": "white", "plot_bgcolor": "white",
        "xaxis": {"title": {"text": "day"}, "type": "category"},
        "yaxis": {"title": {"text": "GPU-hours"}, "rangemode": "tozero"}, "legend": {"orientation": "h", "y": 1.12}}}


@callback(Output(KPIS, "children"), Output(NOTE, "children"), Output(CHART, "figure"), Output(TEAMS, "children"),
          Output(FAMILIES, "children"), Input(DAYS, "value"), State(RANGE, "data"))
def _fill(days: int | None, rng: dict[str, Any] | None) -> tuple[Any, ...]:
    engine = _state.engine()
    try:
        if days is None and rng:
            since, until = parse_time(rng.get("since"), "since"), parse_time(rng.get("until"), "until")
        else:
            until = dt.datetime.now(dt.timezone.utc)
            since = until - dt.timedelta(days=int(days or 7))
        u = reports.fleet_utilisation(engine, since=since, until=until)
    except reports.UtilisationError as e:
        msg = html.Div(str(e), className="fs-muted")
        return None, msg, F.empty_figure(str(e)), None, None
    t = u["total"]
    kpis = kpi_strip([
        kpi("GPU-hours", _hours(t["gpu_hours"]), f"{t['runs']:,} runs"),
        kpi("idle (allocated)", _hours(t["idle_gpu_hours"]), fmt_pct(t["idle_share"], 0) + " of GPU-hours",
            tone="bad" if (t["idle_share"] or 0) > 0.3 else None),
        kpi("failed runs", _hours(t["failed_gpu_hours"]), "GPU-hours of runs that failed"),
        kpi("redone", _hours(t["redone_gpu_hours"]), "steps run again after a restart"),
        kpi("MFU-weighted", _hours(t["mfu_gpu_hours"]), f"MFU {fmt_pct(t['mfu'], 1)}; unknown for "
            f"{fmt_pct(t['mfu_unknown_share'], 0)}"),
    ], kid="util-kpi-strip")
    note = (f"{u['since'][:16].replace('T', ' ')} – {u['until'][:16].replace('T', ' ')} UTC. Each run counts world size × "
            "its wall time inside the window; idle: wall time with no step running (init, hangs, stalls, checkpoints, "
            "failures); MFU-weighted: model FLOPs done / peak FLOP/s (unknown where a run has no peak or no FLOPs).")
    return (kpis, note, day_figure(u["day"]), _table(u["team"], "team", "util-team-table"),
            _table(u["family"], "family", "util-family-table"))


clientside_callback(f"function(d) {{ return ({URL_SYNC_JS})(d ? [['days', d]] : []); }}", Output(URL, "data"),
                    Input(DAYS, "value"), prevent_initial_call=True)
