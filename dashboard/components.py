"""Small layout pieces shared by the pages: navigation, headers, KPI tiles, empty states, tables."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import dash
from dash import Output, dcc, html
from dash.exceptions import PreventUpdate

from .figures import failed_figure, reason

__all__ = [
    "mfu_kpi",
    "navbar",
    "page_header",
    "kpi",
    "kpi_strip",
    "empty_state",
    "section",
    "graph",
    "loading",
    "simple_table",
    "status_badge",
    "URL_SYNC_JS",
    "md_escape",
    "render_error",
    "contained",
    "callback",
]

log = logging.getLogger("fleetscope.dashboard")

_MD_SPECIAL = "\\`*_{}[]()#+-.!|<>~"


def md_escape(text: object) -> str:
    """User text shown in a Markdown cell: every Markdown character backslash-escaped, so a run name
    cannot become a link, an image (a remote request) or formatting."""
    return "".join("\\" + ch if ch in _MD_SPECIAL else ch for ch in str(text).replace("\n", " "))

NAV = (("Fleet", "/"), ("Runs table", "/runs-table"), ("Scaling", "/scaling"), ("Compare", "/compare"), ("Regressions", "/regressions"),
       ("Cluster", "/cluster"), ("Utilisation", "/utilisation"), ("Benchmarks", "/benchmarks"))

#: clientside: write the page's state into the URL query without a navigation (history.replaceState),
#: so a copied link reproduces the view; takes a list of [key, value] pairs as the first argument
URL_SYNC_JS = """
function(pairs) {
    const parts = [];
    for (const [k, v] of pairs) {
        if (v === null || v === undefined || v === '' || (Array.isArray(v) && v.length === 0)) continue;
        const val = Array.isArray(v) ? v.map(String).join(',') : String(v);
        parts.push(encodeURIComponent(k) + '=' + encodeURIComponent(val).replace(/%2C/g, ','));
    }
    const qs = parts.join('&');
    const url = window.location.pathname + (qs ? '?' + qs : '');
    if (url !== window.location.pathname + window.location.search) {
        window.history.replaceState(window.history.state, '', url);
    }
    return qs;
}
"""


def navbar() -> html.Header:
    """The top bar: product name, page links, the time zone every timestamp is shown in."""
    return html.Header(
        [
            dcc.Link([html.Span("◆", className="fs-logo-mark"), "fleetscope"], href="/", className="fs-brand"),
            html.Nav([dcc.Link(label, href=href, className="fs-nav-link") for label, href in NAV], className="fs-nav"),
            html.Div([html.Span("times in UTC", className="fs-muted"), html.A("API", href="/docs", className="fs-nav-link")],
                     className="fs-nav-right"),
        ],
        className="fs-header",
    )


def page_header(title: Any, subtitle: Any = None, right: Any = None) -> html.Div:
    """A page title line with an optional subtitle and right-aligned extras."""
    return html.Div(
        [html.Div([html.H1(title, className="fs-title"), html.Div(subtitle, className="fs-subtitle") if subtitle else None]),
         html.Div(right, className="fs-header-right") if right is not None else None],
        className="fs-page-header",
    )


def kpi(label: str, value: str, sub: str | None = None, *, tone: str | None = None, kid: str | None = None) -> html.Div:
    """One figure tile: label, value, optional small print."""
    return html.Div(
        [html.Div(label, className="fs-kpi-label"), html.Div(value, className="fs-kpi-value"),
         html.Div(sub, className="fs-kpi-sub") if sub else None],
        className="fs-kpi" + (f" fs-kpi-{tone}" if tone else ""),
        **({"id": kid} if kid else {}),
    )


def mfu_kpi(summary: dict[str, Any]) -> html.Div:
    """The MFU tile, honest about why there is no figure: flagged (implausible), no peak FLOP/s known for the
    device (CPU, an unknown part: MFU needs a peak), FLOPs not measured, or the figure with its source."""
    from .theme import fmt_pct

    if summary.get("mfu_flag"):
        return kpi("MFU", "flagged", summary["mfu_flag"], tone="bad", kid="run-mfu")
    run = summary.get("run") or {}
    if summary.get("mfu") is None:
        if not run.get("peak_flops"):
            dev = run.get("device_type")
            return kpi("MFU", "n/a", "no peak for this device" + (f" ({dev})" if dev else ""), kid="run-mfu")
        return kpi("MFU", "n/a", "FLOPs not measured", kid="run-mfu")
    return kpi("MFU", fmt_pct(summary.get("mfu")),
               "estimated" if summary.get("mfu_estimated") else (summary.get("flops_source") or ""), kid="run-mfu")


def kpi_strip(items: Sequence[html.Div], kid: str | None = None) -> html.Div:
    return html.Div(list(items), className="fs-kpis", **({"id": kid} if kid else {}))


def empty_state(title: str, body: Any, how: Sequence[str] = (), *, eid: str | None = None) -> html.Div:
    """What will appear here, and how to get data (commands shown as code)."""
    return html.Div(
        [html.Div(title, className="fs-empty-title"), html.Div(body, className="fs-empty-body"),
         html.Pre("\n".join(how), className="fs-empty-code") if how else None],
        className="fs-empty",
        **({"id": eid} if eid else {}),
    )


def section(title: str | None, children: Any, *, sid: str | None = None, right: Any = None, cls: str = "") -> html.Section:
    head = (html.Div([html.H2(title, className="fs-h2") if title else html.Span(), right], className="fs-section-head")
            if title or right is not None else None)
    return html.Section([head, *(children if isinstance(children, list) else [children])],
                        className=("fs-section " + cls).strip(), **({"id": sid} if sid else {}))


def graph(gid: str, figure: Any = None, *, height: int | None = None) -> dcc.Graph:
    """A chart without the Plotly logo; the figure comes from a callback or is given."""
    kw: dict[str, Any] = {"figure": figure} if figure is not None else {}
    if height:
        kw["style"] = {"height": f"{height}px"}
    return dcc.Graph(id=gid, config={"displaylogo": False, "displayModeBar": False}, **kw)


def loading(children: Any, lid: str | None = None) -> dcc.Loading:
    return dcc.Loading(children, type="dot", delay_show=250, color="#0072B2", **({"id": lid} if lid else {}))


def simple_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, tid: str | None = None,
                 numeric: Sequence[int] = (), row_classes: Sequence[str] | None = None) -> html.Table:
    """A dense HTML table (for small tables; the fleet uses a DataTable)."""
    head = html.Thead(html.Tr([html.Th(c, className="fs-num" if i in numeric else None) for i, c in enumerate(columns)]))
    body = html.Tbody([
        html.Tr([html.Td(v, className="fs-num" if i in numeric else None) for i, v in enumerate(r)],
                className=(row_classes[j] if row_classes else None))
        for j, r in enumerate(rows)
    ])
    return html.Table([head, body], className="fs-table", **({"id": tid} if tid else {}))


def status_badge(status: str | None) -> html.Span:
    s = status or "unknown"
    return html.Span(s, className=f"fs-badge fs-badge-{s}")


# --- containment: one run's odd data costs one panel, row or chart, never the page -------------------------

ERROR_STYLE = {"color": "#b42318", "fontSize": "12px", "padding": "4px 0"}


def render_error(why: str, *, what: str | None = None) -> html.Div:
    """The small note a panel (or a page, or a fleet row's cell) shows instead of itself when its
    builder failed: "could not render: <reason>". Dash components escape their text."""
    return html.Div(f"could not render{' ' + what if what else ''}: {why}", className="fs-render-error",
                    style=ERROR_STYLE)


def contained(what: str, fallback: Callable[..., Any] | None = None,
              key: Callable[..., Any] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a builder of one part of a page (a panel, a table, a fleet row, a page layout):
    any exception is logged (``logging.exception``: ``what``, and ``key(*args)`` — e.g. the run — when
    given) and the builder returns ``fallback(reason, *args, **kwargs)`` instead — by default
    ``render_error(reason)``. ``PreventUpdate`` passes through."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except PreventUpdate:
                raise
            except Exception as e:
                try:
                    ctx = f" ({key(*args, **kwargs)})" if key is not None else ""
                except Exception:
                    ctx = ""
                log.exception("dashboard: %s could not render%s", what, ctx)
                why = reason(e)
                return fallback(why, *args, **kwargs) if fallback is not None else render_error(why)

        return wrapper

    return deco


def _outputs(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Output], bool]:
    """The callback's outputs in order, and whether it returns a single value (one bare Output)."""
    given = kwargs.get("output", [a for a in args if isinstance(a, (Output, list, tuple))
                                  and (isinstance(a, Output) or all(isinstance(o, Output) for o in a))])
    if isinstance(given, Output):
        return [given], True
    flat: list[Output] = []
    for g in given:
        flat += [g] if isinstance(g, Output) else list(g)
    single = len(given) == 1 and isinstance(given[0], Output)
    return flat, single


def _on_error(out: Output, why: str) -> Any:
    prop = out.component_property
    if prop == "figure":
        return failed_figure(why)
    if prop == "children":
        return render_error(why)
    return dash.no_update


def callback(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``dash.callback`` whose failure stays in its own outputs: an exception (a run's data the page
    did not expect) is logged with the callback and its inputs (``logging.exception``) and each output
    gets its error form — a chart the "could not render: <reason>" figure, a panel (``children``) the
    note, anything else left as it is — instead of an HTTP 500 that leaves the section (or, for the
    fleet, the whole page) blank. Pages register their callbacks through this."""
    outputs, single = _outputs(args, kwargs)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            try:
                return fn(*a, **kw)
            except PreventUpdate:
                raise
            except Exception as e:
                log.exception("dashboard: callback %s could not render (inputs %.200r)", name, a)
                why = reason(e)
                vals = [_on_error(o, why) for o in outputs]
                return vals[0] if single else tuple(vals)

        return dash.callback(*args, **kwargs)(wrapper)

    return deco
