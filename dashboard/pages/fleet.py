"""Fleet (``/``): active and recent runs with their figures; filter and sort state lives in the URL
(``?family=&status=&q=&sort=mfu:desc``); a run's name links to its page."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, clientside_callback, dash_table, dcc, html
from dash.dash_table.Format import Format, Scheme
from fleetscope.server import reports

from .. import _state
from ..components import (
    URL_SYNC_JS,
    callback,
    contained,
    empty_state,
    kpi,
    kpi_strip,
    loading,
    md_escape,
    page_header,
)
from ..health_panel import fleet_goodput_kpi, health_first
from ..theme import FONT, fmt_num, fmt_time

dash.register_page(__name__, path="/", name="Fleet", title="fleetscope · fleet", order=0)

# component ids (page-prefixed)
FAMILY = "fleet-family"
STATUS = "fleet-status"
SEARCH = "fleet-search"
TABLE = "fleet-table"
KPIS = "fleet-kpis"
EMPTY = "fleet-empty"
URL = "fleet-url"
COUNT = "fleet-count"

STATUSES = ("running", "stalled", "hung", "finished", "failed", "aborted")
LIMIT = 2000
_SORTABLE = {"name", "model_family", "world_size", "device_type", "status", "started", "steps", "mfu", "tokens_per_s",
             "tokens_per_s_per_gpu", "step_s_p50", "step_s_p95", "alerts_firing"}

COLUMNS = [
    {"id": "name", "name": "run", "presentation": "markdown"},
    {"id": "model_family", "name": "family"},
    {"id": "world_size", "name": "GPUs", "type": "numeric"},
    {"id": "device_type", "name": "device"},
    {"id": "status", "name": "status"},
    {"id": "started", "name": "started (UTC)"},
    {"id": "steps", "name": "steps", "type": "numeric"},
    {"id": "mfu", "name": "MFU", "type": "numeric", "format": Format(precision=1, scheme=Scheme.percentage)},
    {"id": "tokens_per_s", "name": "tokens/s", "type": "numeric", "format": Format(precision=3, scheme=Scheme.decimal_si_prefix)},
    {"id": "tokens_per_s_per_gpu", "name": "tokens/s/GPU", "type": "numeric",
     "format": Format(precision=3, scheme=Scheme.decimal_si_prefix)},
    {"id": "step_s_p50", "name": "step p50 (s)", "type": "numeric", "format": Format(precision=3, scheme=Scheme.fixed)},
    {"id": "step_s_p95", "name": "step p95 slowest rank (s)", "type": "numeric",
     "format": Format(precision=3, scheme=Scheme.fixed)},
    {"id": "bottleneck", "name": "top bottleneck (share · Amdahl ceiling)"},
    {"id": "alerts_firing", "name": "alerts", "type": "numeric"},
    {"id": "health", "name": "where it stopped and why"},
]


def _parse_sort(sort: str | None) -> list[dict[str, str]]:
    if not sort:
        return []
    col, _, d = sort.partition(":")
    if col not in _SORTABLE:
        return []
    return [{"column_id": col, "direction": "asc" if d == "asc" else "desc"}]


def layout(family: str | None = None, status: str | None = None, q: str | None = None, sort: str | None = None,
           **_: Any) -> html.Div:
    try:
        fams = reports.families(_state.engine())
    except _state.NotReady:
        fams = []
    return html.Div([
        page_header("Fleet", "Active and recent runs: where each one spends its step, and what to fix first."),
        kpi_strip([], kid=KPIS),
        html.Div([
            dcc.Dropdown(id=FAMILY, options=[{"label": f, "value": f} for f in fams], value=family or None,
                         placeholder="all families", clearable=True, className="fs-control"),
            dcc.Dropdown(id=STATUS, options=[{"label": s, "value": s} for s in STATUSES], value=status if status in STATUSES else None,
                         placeholder="any status", clearable=True, className="fs-control fs-control-sm"),
            dcc.Input(id=SEARCH, type="search", value=q or "", placeholder="filter by name…", debounce=0.3,
                      className="fs-input", style={"width": "280px"}),
            html.Span(id=COUNT, className="fs-muted"),
        ], className="fs-controls"),
        loading(html.Div([
            html.Div(id=EMPTY),
            dash_table.DataTable(
                id=TABLE, columns=COLUMNS, data=[], sort_action="native", sort_mode="single", sort_by=_parse_sort(sort),
                page_action="native", page_size=30, markdown_options={"link_target": "_self"},
                export_format="csv", export_headers="display",  # an "Export" button: every row, as sorted
                style_as_list_view=True, cell_selectable=False,
                style_table={"overflowX": "auto"},
                style_header={"fontFamily": FONT, "fontWeight": 600, "backgroundColor": "#f6f8fa", "borderBottom": "1px solid #d0d7de",
                              "fontSize": "11px", "whiteSpace": "normal", "height": "auto"},
                style_cell={"fontFamily": FONT, "fontSize": "12px", "padding": "3px 8px", "textAlign": "left",
                            "border": "none", "borderBottom": "1px solid #eef0f3", "maxWidth": "320px",
                            "overflow": "hidden", "textOverflow": "ellipsis"},
                style_cell_conditional=[{"if": {"column_type": "numeric"}, "textAlign": "right",
                                         "fontVariantNumeric": "tabular-nums"}],
                style_data_conditional=[
                    {"if": {"filter_query": "{alerts_firing} > 0", "column_id": "alerts_firing"},
                     "color": "#b42318", "fontWeight": 700},
                    {"if": {"filter_query": '{status} = "running"', "column_id": "status"}, "color": "#0072B2", "fontWeight": 600},
                    {"if": {"filter_query": '{status} = "failed"', "column_id": "status"}, "color": "#b42318", "fontWeight": 600},
                    {"if": {"filter_query": '{status} = "hung" || {status} = "stalled"', "column_id": "status"},
                     "color": "#b42318", "fontWeight": 700},
                ],
            ),
        ]), lid="fleet-loading"),
        dcc.Store(id=URL),
    ])


def _run_link(r: Any) -> str:
    """The run's name (Markdown-escaped) linking to its page."""
    r = r if isinstance(r, dict) else {}
    name = md_escape(r.get("name") or "?")
    try:
        return f"[{name}](/runs/{int(r['id'])})"
    except (KeyError, TypeError, ValueError):
        return name


def _failed_row(why: str, r: Any) -> dict[str, Any]:
    """A run whose row could not be built stays listed (linked), its figures replaced by the reason."""
    r = r if isinstance(r, dict) else {}
    return {"name": _run_link(r), "model_family": str(r.get("model_family") or "–"), "bottleneck": f"could not render: {why}"}


def _bottleneck(top: dict[str, Any] | None) -> str:
    """The top bottleneck's share and Amdahl ceiling ("no ceiling" for compute, under 10 % or over 90 %)."""
    if not top:
        return "–"
    share = top.get("share")
    ceiling = top.get("max_speedup")
    return (f"{top.get('component') or '?'} {f'{share * 100:.0f} %' if share is not None else '–'} · "
            + (f"≤{ceiling:.2f}×" if ceiling else "no ceiling"))


@contained("fleet row", fallback=_failed_row, key=lambda r: f"run {r.get('id')}" if isinstance(r, dict) else "")
def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": _run_link(r),
        "model_family": r.get("model_family") or "–",
        "world_size": r.get("world_size"),
        "device_type": r.get("device_type") or "–",
        "status": r.get("status"),
        "started": fmt_time(r.get("started_at"))[:-4],
        "steps": r.get("steps"),
        "mfu": r.get("mfu"),
        "tokens_per_s": r.get("tokens_per_s"),
        "tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"),
        "step_s_p50": r.get("step_s_p50"),
        "step_s_p95": r.get("step_s_p95"),
        "bottleneck": _bottleneck(r.get("top_bottleneck")),
        "alerts_firing": r.get("alerts_firing", 0),
        "health": r.get("health_finding") or "",
    }


@callback(
    Output(TABLE, "data"), Output(KPIS, "children"), Output(EMPTY, "children"), Output(TABLE, "style_table"),
    Output(COUNT, "children"),
    Input(FAMILY, "value"), Input(STATUS, "value"), Input(SEARCH, "value"),
)
def _fill(family: str | None, status: str | None, q: str | None) -> tuple[Any, ...]:
    try:
        eng = _state.engine()
    except _state.NotReady as e:
        return [], [], empty_state("Starting up", str(e)), {"display": "none"}, ""
    rows = reports.fleet_rows(eng, family=family or None, status=status or None, q=(q or "").strip() or None, limit=LIMIT)
    if not rows:
        if family or status or q:
            empty = empty_state("No runs match these filters", "Clear the family, status or name filter to see every run.")
        else:
            empty = empty_state(
                "No runs yet",
                "Every training job instrumented with the agent appears here as soon as its first steps arrive: family, "
                "world size, MFU, throughput, step time and its top bottleneck.",
                ["# instrument a job (every rank):", "import fleetscope.agent as fs",
                 "run = fs.init(name='exp-42', model_family='vla-7b')",
                 "# or load a synthetic run:",
                 "fleetscope simulate --server URL --token T --run demo-1 --family vla-7b --ranks 8 --steps 100",
                 "# or everything at once:", "fleetscope demo"],
            )
        return [], [], empty, {"display": "none"}, ""
    rows = health_first(eng, rows)  # hung, stalled and recently failed runs first, with their finding
    running = [r for r in rows if r["status"] == "running"]
    gpus = sum(r["world_size"] or 0 for r in running)
    fleet_tps = sum(r["tokens_per_s"] or 0 for r in running)
    mfus = sorted(r["mfu"] for r in rows if r.get("mfu") is not None)
    alerts = sum(r["alerts_firing"] for r in rows)
    kpis = [
        kpi("runs", f"{len(rows):,}", f"{len(running)} running"),
        kpi("GPUs busy", f"{gpus:,}", "in running runs"),
        kpi("fleet throughput", f"{fmt_num(fleet_tps)} tokens/s" if running else "–", "sum over running runs"),
        kpi("median MFU", f"{mfus[len(mfus) // 2] * 100:.1f} %" if mfus else "–", "over listed runs"),
        kpi("firing alerts", f"{alerts}", "regressions, stragglers", tone="bad" if alerts else None),
        fleet_goodput_kpi(eng),
    ]
    count = f"{len(rows):,} runs" + (f" (the newest {LIMIT:,}: filter to narrow)" if len(rows) >= LIMIT else "")
    return [_row(r) for r in rows], kpis, None, {"overflowX": "auto"}, count


clientside_callback(
    "function(f, s, q, sort) {"
    " const sb = (sort && sort.length) ? sort[0].column_id + ':' + sort[0].direction : null;"
    f" return ({URL_SYNC_JS})([['family', f], ['status', s], ['q', q], ['sort', sb]]); }}",
    Output(URL, "data"),
    Input(FAMILY, "value"), Input(STATUS, "value"), Input(SEARCH, "value"), Input(TABLE, "sort_by"),
)
