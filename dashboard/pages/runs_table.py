"""Runs table (``/runs-table``): runs filtered by config keys, meta, tags, commit, time, figures and
training scalars with operators, grouped by one or two keys (count, median MFU, tokens/s/GPU, step
time), sorted by any column, with any config key, meta key, figure or scalar (last / min) as a column;
selected runs open in Compare. Filtering, sorting and paging run in SQL (``reports.research``, the
same query as ``GET /api/v1/runs``); the whole state is in the URL
(``?filter=config.tp=4 tag=x&group=config.tp&columns=config.lr,scalar.loss.last&sort=mfu:desc&page=2``)."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, clientside_callback, dash_table, dcc, html
from dash.dash_table.Format import Format, Scheme
from fleetscope.server.reports import research

from .. import _state
from ..components import URL_SYNC_JS, callback, loading, md_escape, page_header, section
from ..theme import FONT, fmt_time

dash.register_page(__name__, path="/runs-table", name="Runs table", title="fleetscope · runs table", order=1)

FILTER = "rt-filter"
GROUP = "rt-group"
COLUMNS = "rt-columns"
TABLE = "rt-table"
GROUPS = "rt-groups"
GROUPS_BOX = "rt-groups-box"
COUNT = "rt-count"
ERROR = "rt-error"
COMPARE = "rt-compare"
URL = "rt-url"
PAGE_SIZE = 50
MAX_COMPARE = 8

_PCT = Format(precision=1, scheme=Scheme.percentage)
_SI = Format(precision=3, scheme=Scheme.decimal_si_prefix)
_FIX = Format(precision=3, scheme=Scheme.fixed)
#: the table's own columns: (id, label, sort field or None, format)
BASE = (
    ("name", "run", "name", None), ("family", "family", "family", None), ("status", "status", "status", None),
    ("started", "started (UTC)", "started_at", None), ("world_size", "GPUs", "world_size", None),
    ("steps", "steps", "steps", None), ("mfu", "MFU", "mfu", _PCT),
    ("tokens_per_s_per_gpu", "tokens/s/GPU", "tokens_per_s_per_gpu", _SI), ("step_s", "step p50 (s)", "step_s", _FIX),
    ("tags", "tags", None, None),
)
_SORT_FIELD = {cid: f for cid, _l, f, _fmt in BASE if f}
_GROUP_BASE = ("family", "status", "world_size", "device_type")
_FIG_FORMAT = {"mfu": _PCT, "hfu": _PCT, "tokens_per_s": _SI, "tokens_per_s_per_gpu": _SI, "mem_peak_bytes": _SI}


def _csv(v: str | None) -> list[str]:
    return [p for p in (v or "").split(",") if p]


def _parse_sort(sort: str | None) -> list[dict[str, str]]:
    col, _, d = (sort or "").partition(":")
    return [{"column_id": col, "direction": "asc" if d == "asc" else "desc"}] if col else []


def _options() -> tuple[list[str], list[str]]:
    """(group-by choices, column choices)."""
    try:
        keys = research.key_options(_state.engine())
    except _state.NotReady:
        keys = {"config": [], "meta": [], "scalars": []}
    groups = [*_GROUP_BASE, *keys["config"], *keys["meta"]]
    cols = [*keys["config"], *keys["meta"], *(f for f in research.FIGURES if f not in _SORT_FIELD),
            *(f"scalar.{n}.{w}" for n in keys["scalars"] for w in ("last", "min"))]
    return groups, cols


def layout(filter: str | None = None, group: str | None = None, columns: str | None = None,  # noqa: A002
           sort: str | None = None, page: str | None = None, **_: Any) -> html.Div:
    groups, cols = _options()
    g, c = _csv(group), _csv(columns)
    # a key from the URL that the recent runs do not have stays choosable (older runs may)
    groups += [x for x in g if x not in groups and x.startswith(("config.", "meta."))]
    cols += [x for x in c if x not in cols and x.startswith(("config.", "meta.", "scalar."))]
    try:
        page_n = max(0, int(page or 0))
    except ValueError:
        page_n = 0
    return html.Div([
        page_header("Runs table", "Runs by config, tags, commit and time: filter with operators, group, choose "
                                  "columns, select runs to compare. Sorting, filtering and paging run on the server."),
        html.Div([
            dcc.Input(id=FILTER, type="search", value=filter or "", debounce=True, className="fs-input",
                      placeholder="config.tp=4 config.lr>0.001 tag=ablation commit=ab12 since=2026-01-01 mfu>0.3",
                      style={"width": "560px"}),
            dcc.Dropdown(id=GROUP, options=groups, value=[x for x in g if x in groups][:2], multi=True,
                         placeholder="group by (one or two keys)", className="fs-control", style={"minWidth": "240px"}),
            dcc.Dropdown(id=COLUMNS, options=cols, value=[x for x in c if x in cols], multi=True,
                         placeholder="columns: config keys, figures, scalars", className="fs-control",
                         style={"minWidth": "320px"}),
        ], className="fs-controls"),
        html.Div([html.Span(id=COUNT, className="fs-muted"), html.Span(" "), html.Span(id=COMPARE)]),
        html.Div(id=ERROR, className="fs-error"),
        html.Div(section("Groups", dash_table.DataTable(id=GROUPS, columns=[], data=[], style_as_list_view=True,
                                                        style_cell={"fontFamily": FONT, "fontSize": "12px"})),
                 id=GROUPS_BOX, style={"display": "none"}),
        loading(dash_table.DataTable(
            id=TABLE, columns=[], data=[], sort_action="custom", sort_mode="single", sort_by=_parse_sort(sort),
            page_action="custom", page_current=page_n, page_size=PAGE_SIZE, page_count=page_n + 1,
            row_selectable="multi", selected_row_ids=[], markdown_options={"link_target": "_self"},
            style_as_list_view=True, cell_selectable=False, style_table={"overflowX": "auto"},
            style_header={"fontFamily": FONT, "fontWeight": 600, "backgroundColor": "#f6f8fa", "fontSize": "11px",
                          "whiteSpace": "normal", "height": "auto"},
            style_cell={"fontFamily": FONT, "fontSize": "12px", "padding": "3px 8px", "textAlign": "left", "border": "none",
                        "borderBottom": "1px solid #eef0f3", "maxWidth": "280px", "overflow": "hidden",
                        "textOverflow": "ellipsis"},
            style_cell_conditional=[{"if": {"column_type": "numeric"}, "textAlign": "right",
                                     "fontVariantNumeric": "tabular-nums"}],
        ), lid="rt-loading"),
        dcc.Store(id=URL),
    ])


def _column(cid: str) -> dict[str, Any]:
    d: dict[str, Any] = {"id": cid, "name": cid}
    if cid in research.FIGURES or cid.startswith("scalar."):
        d["type"] = "numeric"
        fmt = _FIG_FORMAT.get(cid, _FIX if cid in research.FIGURES else None)
        if fmt is not None:
            d["format"] = fmt
    return d


def _cell(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return str(v)[:200]
    return v


def _row(r: dict[str, Any], cols: list[str]) -> dict[str, Any]:
    f = r.get("figures") or {}
    meta: dict[str, Any] = r["meta"] if isinstance(r.get("meta"), dict) else {}
    tags: list[Any] = meta["tags"] if isinstance(meta.get("tags"), list) else []
    row = {"id": r["id"], "name": f"[{md_escape(r.get('name') or '?')}](/runs/{int(r['id'])})",
           "family": r.get("model_family") or "–", "status": r.get("status"),
           "started": fmt_time(r.get("started_at"))[:-4] if r.get("started_at") else "–",
           "world_size": r.get("world_size"), "steps": f.get("steps", r.get("steps")), "mfu": f.get("mfu"),
           "tokens_per_s_per_gpu": f.get("tokens_per_s_per_gpu"), "step_s": f.get("step_s"),
           "tags": ", ".join(str(t) for t in tags[:10])}
    for c in cols:
        row[c] = _cell((r.get("columns") or {}).get(c))
    return row


@callback(
    Output(TABLE, "columns"), Output(TABLE, "data"), Output(TABLE, "page_count"), Output(COUNT, "children"),
    Output(ERROR, "children"), Output(GROUPS, "columns"), Output(GROUPS, "data"), Output(GROUPS_BOX, "style"),
    Output(TABLE, "page_current"),
    Input(FILTER, "value"), Input(GROUP, "value"), Input(COLUMNS, "value"), Input(TABLE, "sort_by"),
    Input(TABLE, "page_current"),
)
def _fill(filt: str | None, group: list[str] | None, cols: list[str] | None, sort_by: list[dict[str, str]] | None,
          page: int | None) -> tuple[Any, ...]:
    """A new filter, group or sort starts at the first page; a page past the end shows the last one."""
    if dash.ctx.triggered_id in (FILTER, GROUP) or (dash.ctx.triggered_id == TABLE and
                                                     dash.ctx.triggered_prop_ids and
                                                     any(k.endswith(".sort_by") for k in dash.ctx.triggered_prop_ids)):
        page = 0
    page = max(0, int(page or 0))
    out = _page(filt, group, cols, sort_by, page)
    n_pages = int(out[2])
    if page >= n_pages:
        page = n_pages - 1
        out = _page(filt, group, cols, sort_by, page)
    return (*out, page)


def _page(filt: str | None, group: list[str] | None, cols: list[str] | None, sort_by: list[dict[str, str]] | None,
          page: int) -> tuple[Any, ...]:
    cols = list(cols or [])
    columns = [{"id": cid, "name": label, **({"presentation": "markdown"} if cid == "name" else {}),
                **({"type": "numeric", "format": fmt} if fmt is not None else {}),
                **({"type": "numeric"} if cid in ("world_size", "steps") else {})}
               for cid, label, _f, fmt in BASE] + [_column(c) for c in cols if c not in _SORT_FIELD]
    hidden = {"display": "none"}
    try:
        eng = _state.engine()
    except _state.NotReady as e:
        return columns, [], 1, "", str(e), [], [], hidden
    items = research.parse_clauses(filt or "") if filt else []
    sort = ""
    if sort_by:
        s = sort_by[0]
        field = _SORT_FIELD.get(s["column_id"], s["column_id"])
        sort = ("-" if s.get("direction") == "desc" else "") + field
    try:
        q = research.parse_query([*items, *([("sort", sort)] if sort else []),
                                  ("offset", str(max(0, int(page or 0)) * PAGE_SIZE)), ("limit", str(PAGE_SIZE))])
        view = research.runs_view(eng, q, columns=[c for c in cols if c not in _SORT_FIELD], with_figures=True)
        gcols: list[dict[str, Any]] = []
        gdata: list[dict[str, Any]] = []
        gstyle = hidden
        if group:
            gq = research.parse_query([*items, ("group_by", ",".join(group[:2]))])
            groups = research.groups_view(eng, gq)["groups"]
            gcols = [{"id": k, "name": k} for k in group[:2]] + [
                {"id": "count", "name": "runs", "type": "numeric"},
                {"id": "median_mfu", "name": "median MFU", "type": "numeric", "format": _PCT},
                {"id": "median_tokens_per_s_per_gpu", "name": "median tokens/s/GPU", "type": "numeric", "format": _SI},
                {"id": "median_step_s", "name": "median step (s)", "type": "numeric", "format": _FIX}]
            gdata = [{k: _cell(v) for k, v in g.items()} for g in groups]
            gstyle = {}
    except research.QueryError as e:
        return columns, [], 1, "", f"Filter not understood — {e.param}: {e.message}", [], [], hidden
    total = int(view["total"])
    if not total:
        msg = "No runs match these filters." if filt else "No runs yet."
        return columns, [], 1, msg, None, gcols, gdata, gstyle
    count = f"{total:,} runs match" + (f" · page {int(page or 0) + 1} of {-(-total // PAGE_SIZE):,}" if total > PAGE_SIZE else "")
    return (columns, [_row(r, cols) for r in view["runs"]], max(1, -(-total // PAGE_SIZE)), count, None, gcols, gdata,
            gstyle)


@callback(Output(COMPARE, "children"), Input(TABLE, "selected_row_ids"))
def _compare(ids: list[int] | None) -> Any:
    ids = [int(i) for i in (ids or [])][:MAX_COMPARE]
    if not ids:
        return "select runs (the boxes) to compare them"
    return dcc.Link(f"Compare {len(ids)} selected run{'s' if len(ids) > 1 else ''} →",
                    href="/compare?runs=" + ",".join(str(i) for i in ids), id="rt-compare-link")


clientside_callback(
    "function(f, g, c, sort, page) {"
    " const sb = (sort && sort.length) ? sort[0].column_id + ':' + sort[0].direction : null;"
    f" return ({URL_SYNC_JS})([['filter', f], ['group', g], ['columns', c], ['sort', sb], ['page', page ? page : null]]); }}",
    Output(URL, "data"),
    Input(FILTER, "value"), Input(GROUP, "value"), Input(COLUMNS, "value"), Input(TABLE, "sort_by"),
    Input(TABLE, "page_current"),
)
