"""Regressions (``/regressions?state=firing&alert=ID``): alerts with the series they were raised on,
the change point marked, before/after levels, and links to the run and its commit."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output, dcc, html
from fleetscope.server import reports

from .. import _state
from .. import figures as F
from ..components import (
    callback,
    contained,
    empty_state,
    graph,
    loading,
    page_header,
    render_error,
    section,
    simple_table,
)
from ..theme import fmt_bw, fmt_time

dash.register_page(__name__, path="/regressions", name="Regressions", title="fleetscope · regressions", order=4)

STATE = "regressions-state"
ALERT = "regressions-alert"
CHART = "regressions-chart"
DETAIL = "regressions-detail"
TABLE = "regressions-table"
WHY = "regressions-why"
CAUSE = "regressions-cause"
DIFF = "regressions-diff"
STATES = ("firing", "acknowledged", "resolved", "all")


def _fmt_val(metric: str | None, v: Any, unit: str | None = None) -> str:
    if v is None:
        return "–"
    if metric == "mfu":
        return f"{v * 100:.1f} %"
    if unit == "B":
        return f"{v / 2**30:.1f} GiB"
    if unit == "B/s":
        return fmt_bw(v)
    if unit == "s" or (not unit and metric and metric.endswith("_s") and not metric.startswith("tokens")):
        return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"
    return f"{v:.4g}" + (f" {unit}" if unit else "")


def _series_label(a: dict[str, Any]) -> Any:
    """What the alert is about: the run, the comparable-run series, or the benchmark series."""
    d = a.get("details") or {}
    if a["kind"] == "benchmark":
        params = ", ".join(f"{k}={v}" for k, v in sorted((d.get("params") or {}).items()))
        return dcc.Link(f"{d.get('cluster', '?')} · {params}", href=f"/benchmarks?cluster={quote(str(d.get('cluster', '')), safe='')}")
    if a["kind"] == "run_series" and d.get("scope") == "family":
        bad = (a.get("first_bad") or {}).get("run_id") or a["run_id"]
        sw = d.get("switch") or {}
        label = (f"{d.get('family')} · {d.get('device_type') or '?'} (setup switch "
                 f"{(sw.get('from') or {}).get('world_size', '?')} → {(sw.get('to') or {}).get('world_size', '?')} ranks)")
        return dcc.Link(label, href=f"/runs/{bad}") if bad else label
    if a["kind"] == "run_series" and d.get("family") is not None:
        bad = (a.get("first_bad") or {}).get("run_id") or a["run_id"]
        label = f"{d['family']} · {d.get('world_size', '?')} × {d.get('device_type') or '?'} (comparable runs)"
        return dcc.Link(label, href=f"/runs/{bad}") if bad else label
    if a["run_id"]:
        return dcc.Link(a["run_name"] or f"run {a['run_id']}", href=f"/runs/{a['run_id']}")
    return "–"


def layout(state: str | None = None, alert: str | None = None, **_: Any) -> html.Div:
    state = state if state in STATES else "firing"
    try:
        alerts = reports.alerts_view(_state.engine(), state=None if state == "all" else state)
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    tabs = html.Div([dcc.Link(s, href=f"/regressions?state={s}", className="fs-tab" + (" fs-tab-on" if s == state else ""))
                     for s in STATES], className="fs-tabs", id=STATE)
    head = page_header("Regressions", "Statistically significant, practically large changes: runs vs their baseline, "
                                      "series over commits, change points within runs.", tabs)
    if not alerts:
        return html.Div([head, empty_state(
            f"No {state if state != 'all' else ''} alerts".replace("  ", " "),
            "Alerts appear when a run is slower than comparable runs (same family, config, device and world size), when a "
            "benchmark or family series shifts, or when a run's step time changes mid-run. Each shows its series with the "
            "change point.",
            ["fleetscope check --server URL --run NAME   # CI gate on one run",
             "fleetscope detect series.json            # the detector on any series"], eid="regressions-empty")])
    sel = next((a for a in alerts if str(a["id"]) == str(alert)), alerts[0])
    rows = [_alert_row(a, a["id"] == sel["id"], state) for a in alerts]
    table = simple_table(["alert", "state", "kind", "metric", "run / series", "before", "after", "change", "raised (UTC)"], rows,
                         numeric=(5, 6, 7), row_classes=["fs-selected" if a["id"] == sel["id"] else "" for a in alerts],
                         tid=TABLE)
    return html.Div([head, dcc.Store(id=ALERT, data=sel["id"]),
                     html.Div([section(None, loading(graph(CHART)), cls="fs-col-8"),
                               section("Alert", loading(html.Div(id=DETAIL)), cls="fs-col-4")], className="fs-row"),
                     section(f"{len(alerts)} alerts", html.Div(table, className="fs-scroll fs-tall"))])


def _failed_alert_row(why: str, a: dict[str, Any], on: bool, state: str) -> list[Any]:
    return [f"#{a.get('id')}", a.get("state"), a.get("kind"), a.get("metric"), render_error(why), "", "", "", ""]


@contained("alert row", fallback=_failed_alert_row, key=lambda a, *_: f"alert {a.get('id')}")
def _alert_row(a: dict[str, Any], on: bool, state: str) -> list[Any]:
    return [
        dcc.Link(f"#{a['id']}", href=f"/regressions?state={state}&alert={a['id']}", className="fs-strong" if on else None),
        a["state"], a["kind"], a["metric"], _series_label(a),
        _fmt_val(a["metric"], a["before"], (a.get("details") or {}).get("unit")),
        _fmt_val(a["metric"], a["after"], (a.get("details") or {}).get("unit")),
        f"{a['change'] * 100:+.1f} %" if a["change"] is not None else "–", fmt_time(a["created_at"]),
    ]


@callback(Output(CHART, "figure"), Output(DETAIL, "children"), Input(ALERT, "data"))
def _detail(alert_id: int) -> tuple[Any, Any]:
    eng = _state.engine()
    a = next((x for x in reports.alerts_view(eng) if x["id"] == alert_id), None)
    if a is None:
        return F.empty_figure("Alert not found."), None
    ser = reports.alert_series(eng, a)
    return F.alert_series_figure(ser, a), _detail_panel(a)


@contained("alert detail")
def _detail_panel(a: dict[str, Any]) -> Any:
    fb = a.get("first_bad") or {}
    unit = (a.get("details") or {}).get("unit")
    first_bad = ", ".join(f"{k} {fmt_time(v) if k in ('ts', 'started_at') else v}" for k, v in fb.items()
                          if k not in ("index", "series_id") and v is not None)
    items = [["metric", a["metric"]], ["kind", a["kind"]], ["state", a["state"]], ["series", _series_label(a)],
             ["before → after", f"{_fmt_val(a['metric'], a['before'], unit)} → {_fmt_val(a['metric'], a['after'], unit)}"],
             ["change", f"{a['change'] * 100:+.1f} %" if a["change"] is not None else "–"],
             ["significance", f"{a['significance']:.3g}" if a["significance"] is not None else "–"],
             ["first bad", first_bad or "–"],
             ["last good commit", (a.get("details") or {}).get("good_commit") or "–"],
             ["raised", fmt_time(a["created_at"])], ["updated", fmt_time(a["updated_at"])]]
    why = _why(a)
    links = []
    bad = fb.get("run_id") or a.get("run_id")
    if bad:
        links.append(dcc.Link("open first bad run", href=f"/runs/{bad}", className="fs-btn"))
    runs, i = (a.get("details") or {}).get("runs") or [], fb.get("index")
    if isinstance(i, int) and 0 < i < len(runs):
        links.append(dcc.Link("compare last good vs first bad", href=f"/compare?runs={runs[i - 1]},{runs[i]}",
                              className="fs-btn"))
    return html.Div([*why, simple_table(["", ""], items), html.Div(links, className="fs-inline")])


def _s(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "–" if v is None else str(v)


@contained("alert explanation", fallback=lambda why, a: [render_error(why)])
def _why(a: dict[str, Any]) -> list[Any]:
    """The explanation sentence, the components' before → after, and the last good vs first bad run."""
    out: list[Any] = []
    if a.get("explanation"):
        out.append(html.P(a["explanation"], id=WHY, className="fs-strong"))
    cause = a.get("cause") or {}
    comps = cause.get("components") or {}
    if comps:
        rows = [[k, _fmt_val(k, c["before"], "s"), _fmt_val(k, c["after"], "s"), f"{c['share_of_change'] * 100:+.0f} %"]
                for k, c in comps.items()]
        out.append(simple_table([f"component ({'per 1k tokens' if cause.get('basis') == 'per_1k_tokens' else 'per step'})",
                                 "before", "after", "share of change"], rows, numeric=(1, 2, 3), tid=CAUSE))
    diff = a.get("diff") or {}
    if diff.get("kind") == "rank_vs_peers":  # a straggler: its rank against its peers (docs/api.md)
        dev = diff.get("device") if isinstance(diff.get("device"), list) else [None, None]
        prow = [["node", _s(diff.get("node")), f"{_s(diff.get('nodes'))} nodes"],
                ["local_rank", _s(diff.get("local_rank")), "–"], ["device", _s(dev[1]), _s(dev[0])],
                ["its node's stragglers", f"{_s(diff.get('node_straggler_ranks'))} of {_s(diff.get('node_ranks'))}", "–"],
                ["tokens vs median rank", _s(diff.get("tokens_ratio")), "1"]]
        out.append(simple_table([f"rank {_s(diff.get('rank'))}", "this rank", "peers"], prow, tid=DIFF))
        return out
    rows = [[k, _s(diff[k][0]), _s(diff[k][1])] for k in ("commit", "world_size", "nodes", "device_type", "mp_size")
            if isinstance(diff.get(k), list) and len(diff[k]) == 2 and diff[k][0] != diff[k][1]]
    rows += [[f"config.{k}", _s(v[0]), _s(v[1])] for k, v in (diff.get("config") or {}).items()]
    rows += [[f"meta.{k}", _s(v[0]), _s(v[1])] for k, v in (diff.get("meta") or {}).items()]
    hosts = diff.get("hosts") or {}
    if hosts.get("added") or hosts.get("removed"):
        rows.append(["nodes", " ".join(hosts.get("removed") or []) or "–", " ".join(hosts.get("added") or []) or "–"])
    if diff.get("truncated"):
        rows.append([f"… {diff['truncated']} more keys", "", ""])
    if rows:
        out.append(simple_table(["changed", "last good", "first bad"], rows, tid=DIFF))
    return out
