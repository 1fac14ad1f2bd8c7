"""Run (``/runs/<id>``): what the run spends its step on and what to fix first.

Sections: bottleneck report (Amdahl ceilings + findings), step-time decomposition, per-rank × step
heatmap of any component (``?heat=step_s|work_s|data_s|compute_s|comm_exposed_s|other_s|straggler_wait_s&agg=max|mean``,
reduced server-side), stragglers by rank and node, the rank drill-down (``?rank=``: one rank's components
against the median rank, dashboard/rank_panel.py),
throughput/MFU, memory, collectives (busbw, efficiency), communication by parallel dimension and the
pipeline (when the job has one), modality tokens and packing, goodput and events, trace summaries when
present, and the config."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output, clientside_callback, dcc, html
from fleetscope.server import reports

from .. import _state, device_panel, memory_modules_panel, projection_panel, rank_panel, scalars_panel
from .. import figures as F
from ..components import (
    URL_SYNC_JS,
    callback,
    contained,
    empty_state,
    graph,
    kpi,
    kpi_strip,
    loading,
    mfu_kpi,
    page_header,
    render_error,
    section,
    simple_table,
    status_badge,
)
from ..health_panel import attempts_table, health_panel, run_health
from ..theme import COMPONENT_COLORS, fmt_bw, fmt_bytes, fmt_num, fmt_pct, fmt_s, fmt_time

dash.register_page(__name__, path_template="/runs/<run_id>", name="Run", title="fleetscope · run", order=1)

RUN = "run-id"
URL = "run-url"
KPIS = "run-kpis"
PHASES_KPI = "run-phases"
BOTTLENECK_TEXT = "run-bottleneck-text"
DECOMPOSITION = "run-decomposition"
HEAT_FIELD = "run-heat-field"
HEAT_AGG = "run-heat-agg"
HEATMAP = "run-heatmap"
STRAGGLERS = "run-stragglers"
STRAGGLER_TABLE = "run-straggler-table"
THROUGHPUT = "run-throughput"
MEMORY = "run-memory"
COLLECTIVES = "run-collectives"
COLLECTIVE_TABLE = "run-collective-table"
MODALITY = "run-modality"
EXTRAS = "run-extras"
CONFIG = "run-config"
COMPILE = "run-compile"
KERNELS = "run-kernels"
COMM_DIMS = "run-comm-dims"
PIPELINE = "run-pipeline"
OVERLAP = "run-overlap"
OVERLAP_BARS = 60  # collectives drawn in the overlap chart (the longest); the API lists up to MAX_PAGE_ROWS
DIAGNOSIS = "run-diagnosis"
BALANCE = "run-balance"

GRAPHS = (DECOMPOSITION, HEATMAP, STRAGGLERS, THROUGHPUT, MEMORY, COLLECTIVES, MODALITY)
#: the heatmap's fields (``rank_matrix.HEATMAP_FIELDS``) as the selector labels them
HEAT_OPTIONS = (("step_s", "step"), ("work_s", "work"), ("data_s", "data"), ("compute_s", "compute"),
                ("comm_exposed_s", "exposed comm"), ("other_s", "other"), ("straggler_wait_s", "straggler wait"))


def _run_id(run_id: Any) -> int | None:
    try:
        v = int(str(run_id))
    except (TypeError, ValueError):
        return None
    return v if 0 < v < 2**31 else None


def _rank_param(rank: Any, world: int) -> int | None:
    try:
        r = int(str(rank))
    except (TypeError, ValueError):
        return None
    return r if 0 <= r < world else None


def layout(run_id: str | None = None, heat: str | None = None, agg: str | None = None, rank: str | None = None,
           **_: Any) -> html.Div:
    rid = _run_id(run_id)
    try:
        eng = _state.engine()
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    run = reports.get_run(eng, rid) if rid else None
    if run is None:
        return html.Div([page_header("Run not found"),
                         empty_state(f"There is no run {run_id!r}", "Pick a run on the fleet page.",
                                     eid="run-not-found"),
                         dcc.Link("← fleet", href="/")])
    heat = heat if heat in dict(HEAT_OPTIONS) else "work_s"  # work time shows stragglers; step time is equal in sync jobs
    agg = agg if agg in ("max", "mean", "min") else "max"
    sub = [status_badge(run["status"]), f" {run.get('model_family') or 'no family'} · {run['world_size']:,} ranks",
           f" × {run.get('device_type') or 'unknown device'}", f" · started {fmt_time(run.get('started_at'))}"]
    if run.get("git_commit"):
        sub.append(f" · commit {run['git_commit']}")
    right = html.Div([dcc.Link("compare with…", href=f"/compare?runs={rid}", className="fs-btn"),
                      dcc.Link("scaling of family", href=f"/scaling?family={quote(run.get('model_family') or '', safe='')}",
                               className="fs-btn") if run.get("model_family") else None])
    return html.Div([
        dcc.Store(id=RUN, data=rid), dcc.Store(id=URL),
        page_header(run["name"], sub, right),
        *_health(rid),  # leads the page when the run is stalled, hung or failed (dashboard/health_panel.py)
        _thinned_note(run.get("thinned")),
        _folded_note(reports.run_folded(eng, rid)),
        loading(kpi_strip([], kid=KPIS)),
        section("Diagnosis", loading(html.Div(id=DIAGNOSIS))),
        section("Bottlenecks · Amdahl ceilings", loading(html.Div(id=BOTTLENECK_TEXT))),
        section(None, [loading(graph(DECOMPOSITION)), rank_panel.zero_code_note(run, "run-zero-code-data")]),
        scalars_panel.run_panel(rid),  # loss & co. on the step axis beside step time (dashboard/scalars_panel.py)
        loading(html.Div(id=COMPILE)),
        loading(html.Div(id=KERNELS)),
        section(None, loading(graph(HEATMAP)), right=html.Div([
            dcc.RadioItems(id=HEAT_FIELD, options=[{"label": label, "value": v} for v, label in HEAT_OPTIONS],
                           value=heat, inline=True, className="fs-radio"),
            dcc.RadioItems(id=HEAT_AGG, options=[{"label": a, "value": a} for a in ("max", "mean", "min")],
                           value=agg, inline=True, className="fs-radio"),
        ], className="fs-inline")),
        device_panel.device_section(rid),  # per-rank GPU telemetry beside the heatmap (dashboard/device_panel.py)
        section(None, [loading(graph(STRAGGLERS)), loading(html.Div(id=STRAGGLER_TABLE))]),
        rank_panel.rank_section(run, _rank_param(rank, int(run.get("world_size") or 1))),
        html.Div([section(None, loading(graph(THROUGHPUT)), cls="fs-col-6"),
                  section(None, loading(graph(MEMORY)), cls="fs-col-6")], className="fs-row"),
        memory_modules_panel.memory_modules_section(),  # memory per module, peak parts, checkpointing advice
        section(None, html.Div([html.Div(loading(graph(COLLECTIVES)), className="fs-col-6"),
                                         html.Div(loading(html.Div(id=COLLECTIVE_TABLE)), className="fs-col-6 fs-scroll")],
                                        className="fs-row")),
        loading(html.Div(id=COMM_DIMS)),
        loading(html.Div(id=PIPELINE)),
        loading(html.Div(id=OVERLAP)),
        projection_panel.what_if_section(rid, run, _),  # step / MFU / tokens/s at another layout (?ws=&tp=&pp=&mb=)
        section(None, loading(graph(MODALITY))),
        loading(html.Div(id=BALANCE)),
        loading(html.Div(id=EXTRAS)),
        section("Config", loading(html.Div(id=CONFIG))),
    ], className="fs-run")


@contained("health panel", fallback=lambda why, *a: [render_error(why)])
def _health(rid: int) -> list[Any]:
    """The health panel (stalled / hung / failed: where and why) and the job's attempts."""
    h = run_health(rid)
    return [health_panel(rid, h), attempts_table(h)]


@contained("thinned-run note")
def _thinned_note(thinned: dict[str, Any] | None) -> html.Div | None:
    """What retention removed from this run (docs/architecture.md, "Retention"), above everything."""
    if not thinned:
        return None
    parts = []
    if "rollups" in thinned:
        parts.append(f"its per-step rows on {fmt_time(thinned['rollups'])}: the per-step charts and heatmap are empty")
    if "blocks" in thinned:
        parts.append(f"its per-rank data on {fmt_time(thinned['blocks'])}: the heatmap and per-rank collectives are empty")
    return html.Div("Retention removed " + "; and ".join(parts) + ". The run's figures and summary are kept.",
                    id="run-thinned", className="fs-thinned")


#: the bounds of server/limits.py a run can exceed, as the note says them
_FOLDED_WHAT = {
    "phase_names": "phase records beyond the run's 32 custom phase names (added to other_phases)",
    "collectives": "collective records beyond a rank-step's 8,192",
    "node_names": "host / node names beyond the run's 32,768 (those ranks are kept without a name)",
    "kernels": "named kernels beyond a trace's 1,000 (summed into others)",
}


@contained("bounds note")
def _folded_note(folded: dict[str, Any] | None) -> html.Div | None:
    """What the server folded or dropped to keep this run within its bounds (docs/security.md,
    "Bounds on what a run stores"), above everything; None when nothing was."""
    if not folded:
        return None
    parts = [f"{int(n):,} {_FOLDED_WHAT.get(k, k)}" for k, n in folded.items()
             if k in _FOLDED_WHAT and isinstance(n, int) and n > 0]
    dropped = folded.get("events_dropped") or {}
    if dropped:
        parts.append("events beyond the run's caps: " + ", ".join(f"{int(n):,} {k}" for k, n in list(dropped.items())[:8]))
    cut = folded.get("events_folded") or {}
    if cut:
        parts.append("events stored shortened: " + ", ".join(f"{int(n):,} {k}" for k, n in list(cut.items())[:8]))
    if not parts:
        return None
    return html.Div("To keep this run within the server's bounds it folded or left out: " + "; ".join(parts) + ".",
                    id="run-folded", className="fs-thinned")


def _findings(summary: dict[str, Any], ranking: list[dict[str, Any]]) -> list[str]:
    """Findings from the summary alone (used when the analysis layer has none for this run)."""
    out = []
    ov = summary.get("overlap_ratio")
    if ov is not None and ov < 0.5 and (summary.get("comm_total_s") or 0) > 0:
        out.append(f"low overlap: only {ov * 100:.0f} % of communication is hidden behind compute.")
    if summary.get("alloc_retries"):
        out.append(f"{summary['alloc_retries']:.0f} allocator retries: memory pressure on the hot path.")
    if (summary.get("memory") or {}).get("ooms"):
        out.append(f"{summary['memory']['ooms']:.0f} CUDA out-of-memory errors caught by the job (num_ooms).")
    if summary.get("negative_residual_steps"):
        out.append(f"{summary['negative_residual_steps']} steps with a negative residual (timing error), reported not clamped.")
    pk = summary.get("packing_efficiency")
    if pk is not None and pk < 0.9:
        out.append(f"packing efficiency {pk * 100:.0f} %: {100 - pk * 100:.0f} % of tokens are padding.")
    return out


@contained("what to fix first")
def _bottleneck_panel(summary: dict[str, Any], report: dict[str, Any]) -> html.Div:
    """Components ranked by Amdahl ceiling as bars (plain HTML: no chart to initialise), with findings."""
    ranking = report["ranking"]
    if not ranking:
        return empty_state("No decomposition yet", "The report appears once steps with data/compute/comm timings arrive.")
    top = ranking[0]
    rows = []
    for r in ranking[:5]:
        ceiling = f"≤ {r['max_speedup']:.2f}×" if r.get("max_speedup") else "–"  # only a ranked, physical one
        rows.append(html.Div([
            html.Div(r["component"], className="fs-bn-name"),
            html.Div(html.Div(style={"width": f"{max(r['share'], 0.002) * 100:.1f}%",
                                     "background": COMPONENT_COLORS.get(r.get("key", ""), "#56B4E9")}), className="fs-bn-track"),
            html.Div(f"{r['share'] * 100:.1f} %", className="fs-bn-num"),
            html.Div(ceiling, className="fs-bn-num", title="Amdahl ceiling: removing this component entirely"),
            html.Div([html.Div(f, className="fs-finding") for f in r.get("findings") or []], className="fs-bn-findings"),
        ], className="fs-bn-row"))
    findings = [] if report["source"] == "analysis" else (report["findings"] or _findings(summary, ranking))
    src = ("shares of step time summed over steps; straggler wait (waiting for the slowest rank) carved out of exposed "
           "comm — analysis layer" if report["source"] == "analysis" else
           "shares of the median step; straggler wait = median (max − median) rank work")
    return html.Div([
        html.Div([html.Span("Fix first: ", className="fs-muted"), html.B(top["component"]),
                  f" — at most {top['max_speedup']:.2f}× faster steps if it were gone" if top.get("max_speedup") else ""],
                 className="fs-fixfirst"),
        html.Div([html.Div("component", className="fs-bn-name fs-muted"), html.Div("share of step time", className="fs-muted"),
                  html.Div("share", className="fs-bn-num fs-muted"), html.Div("ceiling", className="fs-bn-num fs-muted"),
                  html.Div("findings", className="fs-muted")], className="fs-bn-row fs-bn-head"),
        *rows,
        html.Ul([html.Li(f) for f in findings], className="fs-list") if findings else None,
        html.Div(src, className="fs-footnote"),
    ], id="run-bottleneck-report")


#: diagnosis cause -> bar colour (the decomposition's colours where the cause is one of its components)
_CAUSE_COLORS = {"data": "data_s", "compute": "compute_s", "comm_bandwidth": "comm_exposed_s", "other": "other_s"}


@contained("diagnosis")
def _diagnosis_panel(summary: dict[str, Any]) -> Any:
    """The summary's ``diagnosis``: where the median step goes, ranked, each second counted once (the
    parts sum to the step, shown), and the advice whose cause is ranked (docs/analysis.md, "Diagnosis")."""
    d = summary.get("diagnosis")
    if not d or not d.get("parts"):
        return empty_state("No diagnosis yet", "It appears once steps with data/compute/comm timings arrive.",
                           eid=f"{DIAGNOSIS}-empty")
    rows = []
    for p in d["parts"]:
        color = COMPONENT_COLORS.get(_CAUSE_COLORS.get(p["cause"], ""), "#CC79A7" if "straggler" in p["cause"] else "#56B4E9")
        rows.append(html.Div([
            html.Div(p.get("label") or p["cause"], className="fs-bn-name"),
            html.Div(html.Div(style={"width": f"{min(max(p['share'], 0.002), 1.0) * 100:.1f}%", "background": color}),
                     className="fs-bn-track"),
            html.Div(fmt_s(p["seconds"]), className="fs-bn-num"),
            html.Div(f"{p['share'] * 100:.1f} %", className="fs-bn-num"),
            html.Div([html.Div(e, className="fs-finding") for e in p.get("evidence") or []], className="fs-bn-findings"),
        ], className="fs-bn-row", id=f"{DIAGNOSIS}-part-{p['cause']}"))
    total = d.get("sum_s") if d.get("sum_s") is not None else sum(p["seconds"] for p in d["parts"])
    labels = {p["cause"]: p.get("label") or p["cause"] for p in d["parts"]}
    advice = [html.Li([html.B(labels.get(a["cause"], a["cause"])), ": ", _sentence(str(a["text"])), " ",
                       html.Span(_sentence(str(a["why"])), className="fs-muted")]) for a in d.get("advice") or []]
    return html.Div([
        html.Div([html.Div("cause", className="fs-bn-name fs-muted"), html.Div("share of the median step", className="fs-muted"),
                  html.Div("seconds", className="fs-bn-num fs-muted"), html.Div("share", className="fs-bn-num fs-muted"),
                  html.Div("evidence", className="fs-muted")], className="fs-bn-row fs-bn-head"),
        *rows,
        html.Div([html.Div("sum", className="fs-bn-name"), html.Div(f"= median step {fmt_s(d.get('step_s'))}",
                                                                 className="fs-muted"),
                  html.Div(fmt_s(total), className="fs-bn-num"),
                  html.Div(f"{total / d['step_s'] * 100:.1f} %" if d.get("step_s") else "–", className="fs-bn-num"),
                  html.Div()], className="fs-bn-row", id=f"{DIAGNOSIS}-sum"),
        html.Ul(advice, className="fs-list", id=f"{DIAGNOSIS}-advice") if advice else
        html.Div("No advice: no ranked cause has a change that the data supports.", className="fs-muted",
                 id=f"{DIAGNOSIS}-advice"),
        html.Div([html.Div(n) for n in [*([f"On the steady-state basis: {F.basis_text(summary.get('basis'))}."]
                                           if F.basis_text(summary.get("basis")) else []), *(d.get("notes") or [])]],
                 className="fs-footnote", id=f"{DIAGNOSIS}-notes"),
    ], id=f"{DIAGNOSIS}-panel")


@contained("token balance")
def _balance_panel(summary: dict[str, Any]) -> Any:
    """Token balance across ranks, the sequence-length histogram and the network finding, each when the
    summary has it; nothing otherwise."""
    tb = summary.get("token_balance")
    hist = summary.get("seq_len_hist")
    net = summary.get("network") or {}
    parts: list[Any] = []
    if tb:
        heavy = tb.get("heaviest_rank") or {}
        corr = tb.get("work_correlation")
        parts.append(kpi_strip([
            kpi("token imbalance", f"{tb['imbalance']:.2f}×" if tb.get("imbalance") is not None else "–",
                f"p95 {tb['imbalance_p95']:.2f}× · max/median rank tokens per step" if tb.get("imbalance_p95") is not None
                else None),
            kpi("heaviest rank", f"rank {heavy['rank']}" if heavy.get("rank") is not None else "–",
                f"{heavy['tokens_ratio']:.2f}× the median rank's tokens" if heavy.get("tokens_ratio") is not None else None),
            kpi("work follows tokens", f"r = {corr:.2f}" if corr is not None else "–", "Pearson, tokens vs work time"),
        ], kid=f"{BALANCE}-kpis"))
        if tb.get("finding"):
            parts.append(html.Div(_sentence(str(tb["finding"])), className="fs-finding", id=f"{BALANCE}-finding"))
    if hist and hist.get("bins"):
        top = max(b["count"] for b in hist["bins"]) or 1
        bars = [html.Div([
            html.Div(f"{b['lo']:,}–{b['hi']:,}", className="fs-bn-name"),
            html.Div(html.Div(style={"width": f"{max(b['count'] / top, 0.002) * 100:.1f}%", "background": "#56B4E9"}),
                     className="fs-bn-track"),
            html.Div(f"{b['count']:,}", className="fs-bn-num"),
            html.Div(f"{b['count'] / max(hist['sequences'], 1) * 100:.1f} %", className="fs-bn-num"),
            html.Div(),
        ], className="fs-bn-row") for b in hist["bins"]]
        parts.append(html.Div([
            html.Div(f"Sequence lengths: {hist['sequences']:,} sequences; median in [{hist['p50_bin_lo']:,}, …), "
                     f"p95 in [{hist['p95_bin_lo']:,}, …)", className="fs-muted"), *bars,
        ], id=f"{BALANCE}-seq-len"))
    bad = net.get("slow_nodes") or net.get("slow_ranks") or []
    if bad:
        kind = "node" if net.get("slow_nodes") else "rank"
        names = ", ".join(str(x.get("node") or x.get("host") or f"rank {x.get('rank')}") for x in bad[:5])
        ratio = bad[0].get("busbw_ratio")
        parts.append(html.Div(
            f"Network: slow {kind}{'s' if len(bad) > 1 else ''} {names}"
            + (f" (bus bandwidth {ratio:.2f}× their peers')" if ratio is not None else "")
            + ": a link or NIC, not the job's settings.", className="fs-finding", id=f"{BALANCE}-network"))
    elif net.get("ranks_measured"):
        parts.append(html.Div(f"Network: no slow rank or node among {net['ranks_measured']:,} ranks measured.",
                              className="fs-muted", id=f"{BALANCE}-network"))
    if not parts:
        return None
    return section("Token balance · sequence lengths · network", parts, sid=f"{BALANCE}-section")


@callback(Output(DIAGNOSIS, "children"), Output(BALANCE, "children"), Input(RUN, "data"))
def _diagnosis(rid: int) -> tuple[Any, Any]:
    summary = reports.run_page_summary(_state.engine(), rid) or {}
    return _diagnosis_panel(summary), _balance_panel(summary)


_MAX_PHASE_ROWS = 6  # phases listed in the tile; the rest are summed into one row


@contained("compute phases")
def _phases_kpi(phases: dict[str, float], step_s: float | None) -> Any:
    """Compute split into the phases the agent measured (median step): forward / backward / optimizer
    and the job's own ``run.phase(name)`` phases, biggest first, each with its seconds and share of the
    median step."""
    items = sorted(((str(k), float(v)) for k, v in phases.items() if isinstance(v, (int, float)) and v == v),
                   key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return kpi("compute phases", "–", "not measured (manual steps without phases)", kid=PHASES_KPI)
    shown = items if len(items) <= _MAX_PHASE_ROWS else items[:_MAX_PHASE_ROWS - 1]
    rest = items[len(shown):]
    rows = [(name, v, name) for name, v in shown]
    if rest:
        rows.append((f"{len(rest)} more", sum(v for _, v in rest), ", ".join(n for n, _ in rest)))
    name_style = {"padding": "0 8px 0 0", "whiteSpace": "nowrap", "maxWidth": "150px", "overflow": "hidden",
                  "textOverflow": "ellipsis"}
    body = html.Table(html.Tbody([html.Tr([
        html.Td(name, title=title, style=name_style),
        html.Td(fmt_s(v), className="fs-num", style={"padding": "0 8px 0 0"}),
        html.Td(fmt_pct(v / step_s, 0) if step_s else "–", className="fs-num fs-muted", style={"padding": "0"}),
    ]) for name, v, title in rows]), className="fs-table", style={"width": "auto", "marginTop": "2px"})
    return html.Div([html.Div("compute phases · median step", className="fs-kpi-label"), body],
                    className="fs-kpi", id=PHASES_KPI, style={"flex": "2 1 250px"},
                    title="median over steps of the cross-rank mean; share = of the median step; custom phases "
                          "(run.phase) are part of compute")


@callback(
    Output(KPIS, "children"), Output(BOTTLENECK_TEXT, "children"),
    Output(DECOMPOSITION, "figure"), Output(THROUGHPUT, "figure"), Output(MEMORY, "figure"), Output(MODALITY, "figure"),
    Input(RUN, "data"),
)
def _series(rid: int) -> tuple[Any, ...]:
    eng = _state.engine()
    summary = reports.run_page_summary(eng, rid) or {}
    series = dict(reports.run_series(eng, rid))
    series["mfu_estimated"] = summary.get("mfu_estimated")
    series["mem_source"] = (summary.get("memory") or {}).get("source")  # "rss" on CPU: the panel says so
    report = reports.bottleneck_report(eng, rid, summary) if summary else {"ranking": [], "findings": [], "source": "none"}
    return (_kpis(summary), _bottleneck_panel(summary, report),
            _mark_recompiles(F.decomposition_figure(series), reports.run_compile(eng, rid)),
            F.throughput_figure(series), F.memory_figure(series),
            F.modality_figure(reports.modality_series(eng, rid),
                              series.get("packing")))


@contained("run KPIs")
def _kpis(summary: dict[str, Any]) -> list[Any]:
    d = summary.get("decomposition") or {}
    ws = (summary.get("run") or {}).get("world_size") or 1
    return [
        kpi("step p50", fmt_s(d.get("step_s")), f"p95 slowest rank {fmt_s(summary.get('step_s_p95'))}"),
        mfu_kpi(summary),  # flagged / no peak for this device / not measured / the figure (components.mfu_kpi)
        kpi("HFU", "flagged", summary["hfu_flag"], tone="bad", kid="run-hfu") if summary.get("hfu_flag") else
        kpi("HFU", fmt_pct(summary.get("hfu")),
            (f"recompute +{fmt_pct(summary['recompute_overhead'], 0)} FLOPs" if summary.get("recompute_overhead")
             else "hardware FLOPs: padding + recompute") if summary.get("hfu") is not None else "not measured",
            kid="run-hfu"),
        kpi("throughput", f"{fmt_num(summary.get('tokens_per_s'))} tokens/s",
            f"{fmt_num(summary.get('tokens_per_s_per_gpu'))} tokens/s/GPU" if summary.get("tokens_per_s") else None),
        kpi("exposed comm", fmt_s(d.get("comm_exposed_s")),
            f"overlap {fmt_pct(summary.get('overlap_ratio'))}" if summary.get("overlap_ratio") is not None else None),
        kpi("data wait", fmt_s(d.get("data_s"))),
        _phases_kpi(summary.get("phases") or {}, d.get("step_s")),
        _memory_kpi(summary),
        kpi("packing", fmt_pct(summary.get("packing_efficiency")), "real ÷ padded tokens"),
        kpi("records", f"{fmt_num(summary.get('rank_steps'))} rank-steps",
            f"{summary.get('steps') or 0:,} steps × {ws:,} ranks"),
        _basis_kpi(summary.get("basis")),
    ]


def _basis_kpi(basis: dict[str, Any] | None) -> Any:
    """The tile saying which steps every figure of the page is over, and what was set apart."""
    text = F.basis_text(basis)
    head, _, rest = (text or "–").partition("; ")
    return html.Div([html.Div("steady-state basis", className="fs-kpi-label"), html.Div(head, className="fs-kpi-value"),
                     html.Div(rest or ("none set apart" if text else "no steps yet"), className="fs-kpi-sub")],
                    className="fs-kpi", id="run-basis",
                    title="KPIs, shares, bottlenecks and the diagnosis are over these steps; set-apart time is lost "
                          f"time in goodput. {(basis or {}).get('rule') or ''}")


def _memory_kpi(summary: dict[str, Any]) -> Any:
    """Peak memory, max over ranks: the CUDA allocator's peak allocated, or on CPU the process's RSS
    (said so: no device-allocator claim), with imbalance, fragmentation and OOMs when known."""
    mem = summary.get("memory") or {}
    rss = mem.get("source") == "rss"
    value = mem.get("peak_allocated_max") if mem.get("peak_allocated_max") is not None else summary.get("mem_peak_bytes")
    sub = ["RSS (CPU process), max over ranks" if rss else "peak allocated, max over ranks"]
    if mem.get("imbalance") is not None and (mem.get("ranks") or 0) > 1:
        sub.append(f"max/median {mem['imbalance']:.2f}×")
    if not rss and mem.get("fragmentation_bytes"):
        sub.append(f"reserved−allocated {fmt_bytes(mem['fragmentation_bytes'])}")
    if mem.get("ooms"):
        sub.append(f"{mem['ooms']:.0f} OOM{'' if mem['ooms'] == 1 else 's'}")
    return kpi("peak RSS" if rss else "peak memory", fmt_bytes(value), " · ".join(sub), kid="run-memory-kpi",
               tone="bad" if mem.get("ooms") else None)


_MAX_MARKS = 200  # recompile markers drawn on the step-time chart


@contained("recompile marks", fallback=lambda why, fig, comp: fig)
def _mark_recompiles(fig: dict[str, Any], comp: dict[str, Any] | None) -> dict[str, Any]:
    """Steps that recompiled as vertical dotted lines on the step-time decomposition (the first
    ``_MAX_MARKS``), with a hoverable "recompile" legend entry."""
    steps = (comp or {}).get("recompile_steps") or []
    if not steps or not fig.get("data"):
        return fig
    steps = steps[:_MAX_MARKS]
    color = "#CC79A7"
    lay = fig.setdefault("layout", {})
    lay["shapes"] = [*lay.get("shapes", []), *({"type": "line", "xref": "x", "x0": s, "x1": s, "yref": "y domain",
                                                "y0": 0, "y1": 1, "line": {"color": color, "width": 1, "dash": "dot"}}
                                               for s in steps)]
    fig["data"] = [*fig["data"], {"type": "scatter", "x": steps, "y": [0] * len(steps), "mode": "markers",
                                  "name": "recompile", "marker": {"symbol": "triangle-up", "size": 8, "color": color},
                                  "hovertemplate": "recompiled at step %{x}<extra></extra>"}]
    return fig


def _at_steps(n: int) -> str:
    return f"at {n:,} step{'' if n == 1 else 's'}"


def _reason_rows(items: list[dict[str, Any]], n: int = 8) -> list[list[Any]]:
    return [[html.Span(r["reason"][:160] + ("…" if len(r["reason"]) > 160 else ""), title=r["reason"]),
             f"{r['count']:,}"] for r in items[:n]]


@callback(Output(COMPILE, "children"), Input(RUN, "data"))
def _compile(rid: int) -> Any:
    """torch.compile health: compiles, recompiles, graph breaks, compile time and the top reasons
    (nothing for a run without compile events)."""
    comp = reports.run_compile(_state.engine(), rid)
    if comp is None:
        return None
    tiles = [kpi("compiles", f"{comp['compiles']:,}", f"max over {comp['ranks']:,} ranks"),
             kpi("recompiles", f"{comp['recompiles']:,}", _at_steps(len(comp["recompile_steps"])),
                 tone="bad" if comp["recompiles"] else None),
             kpi("graph breaks", f"{comp['graph_breaks']:,}", "distinct reasons"),
             kpi("compile time", fmt_s(comp["compile_s"]), "max over ranks")]
    if comp.get("cudagraph_replays"):
        tiles.append(kpi("CUDA-graph replays", fmt_num(comp["cudagraph_replays"])))
    graph = reports.run_graph_collectives(_state.engine(), rid)
    if graph:
        tiles.append(kpi("collectives in graphs", fmt_num(graph["calls"]),
                         "counted by the Flight Recorder, not timed: "
                         + ", ".join(f"{b['op']} on {b['dim']}" for b in graph["by"][:3]), kid="run-graph-collectives"))
    reasons = comp.get("reasons") or {}
    tables = [html.Div(simple_table([title, "count"], _reason_rows(reasons.get(kind) or []), numeric=(1,),
                                    tid=f"run-compile-{kind.replace('_', '-')}"), className="fs-col-6 fs-scroll")
              for kind, title in (("recompile", "recompile reason (guard that failed)"), ("graph_break", "graph break"))
              if reasons.get(kind)]
    return section("Compile", [kpi_strip(tiles), html.Div(tables, className="fs-row") if tables else None,
                               html.Div("Steps that recompiled are marked on the step-time chart.", className="fs-footnote")
                               if comp["recompile_steps"] else None], sid="run-compile-section")


@callback(Output(HEATMAP, "figure"), Input(RUN, "data"), Input(HEAT_FIELD, "value"), Input(HEAT_AGG, "value"))
def _heatmap(rid: int, field: str, agg: str) -> Any:
    eng = _state.engine()
    basis = (reports.run_page_summary(eng, rid) or {}).get("basis") or {}
    apart = [s for x in basis.get("set_apart") or [] for s in x.get("steps") or []]
    # the colour range is the steady steps': compile and warm-up steps are drawn, clipped at its top
    return F.heatmap_figure(reports.rank_heatmap(eng, rid, field=field or "work_s", how=agg or "max"), set_apart=apart)


@callback(Output(STRAGGLERS, "figure"), Output(STRAGGLER_TABLE, "children"), Input(RUN, "data"))
def _stragglers(rid: int) -> tuple[Any, Any]:
    eng = _state.engine()
    sd = reports.rank_slowdown(eng, rid)
    return F.slowdown_figure(sd), _straggler_table(reports.straggler_view(eng, rid), sd)


@contained("straggler table")
def _straggler_table(rep: dict[str, Any] | None, sd: dict[str, Any] | None) -> Any:
    if rep is not None:
        items = rep.get("stragglers") or []
        nodes = rep.get("nodes") or []
        if not items:
            table = html.Div(f"No straggler: no rank's work stays above {rep.get('threshold', 1.05):.2f}× the median rank "
                             f"(source: {rep.get('source') or 'no data'}).", className="fs-muted")
        else:
            rows = [[it["rank"], it.get("host") or "–", it.get("node") or "–",
                     f"{it['slowdown']:.3f}×" if it.get("slowdown") else "–", it.get("kind") or "–",
                     it.get("component") or "–", fmt_s(it.get("lost_s")),
                     fmt_s(it.get("lateness_s")) if it.get("lateness_s") is not None else "–"] for it in items[:12]]
            head = [html.Div([html.B("Straggler node: "), ", ".join(
                f"{n['node']} ({len(n['ranks'])} ranks, {n['slowdown']:.2f}×)" for n in nodes[:3])], className="fs-fixfirst")
                    ] if nodes else []
            table = html.Div(head + [simple_table(
                ["rank", "host", "node", "slowdown", "kind", "late in", "fleet time lost", "lateness at collectives"],
                rows, numeric=(0, 3, 6, 7), tid="run-straggler-rows")])
    elif sd is not None and len(sd["slowdown"]):
        top = sorted(((float(v), int(r)) for r, v in zip(sd["rank"], sd["slowdown"], strict=True) if v == v), reverse=True)[:5]
        table = html.Div(["Slowest ranks: "] + [html.Span(f"rank {r}{'' if sd['node_of'][r] == '?' else ' (' + sd['node_of'][r] + ')'} {v:.3f}×",
                                                          className="fs-chip")
                                                for v, r in top], className="fs-muted")
    else:
        table = None
    return table


@callback(Output(COLLECTIVES, "figure"), Output(COLLECTIVE_TABLE, "children"), Input(RUN, "data"))
def _collectives(rid: int) -> tuple[Any, Any]:
    eng = _state.engine()
    view = reports.collectives_view(eng, rid)
    rows = view["rows"]
    return F.collectives_figure(rows), _collective_table(view)


@contained("collectives table")
def _collective_table(view: dict[str, Any]) -> Any:
    rows = view["rows"]
    if not rows:
        return empty_state(
            "No collectives recorded", "torch.distributed collectives appear here once the agent is initialised in the job.")
    body = [[r["op"], r["group_size"], fmt_bytes(r["size_bucket_bytes"]), f"{r['calls']:,}", fmt_s(r["total_s"]),
             fmt_s(r.get("exposed_s")),
             fmt_bw(r.get("busbw_bytes_per_s")),
             r.get("link") or "–",
             fmt_pct(r.get("efficiency"), 0) if r.get("efficiency") is not None else "n/a"] for r in rows[:40]]
    table = simple_table(["op", "n", "size/call ≥", "calls", "total", "exposed", "busbw", "link", "eff. vs peak"],
                         body, numeric=(1, 2, 3, 4, 5, 6, 8), tid="run-collective-rows")
    eff = view.get("efficiency_large_messages")
    foot = [f"Time-weighted efficiency of messages ≥ 1 MiB: {eff * 100:.0f} % of link peak." if eff is not None else None,
            view.get("note")]
    return html.Div([table] + [html.Div(f, className="fs-footnote") for f in foot if f])


def _per_step(v: float) -> str:
    """A count per step (a median: may be fractional)."""
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def _ms(v: Any) -> str:
    return f"{v * 1e3:,.2f}" if isinstance(v, (int, float)) else "–"


def _sentence(text: str) -> str:
    return (text[:1].upper() + text[1:]).rstrip(".") + "."


@contained("communication by dimension")
def _comm_dims_panel(summary: dict[str, Any], series: dict[str, Any]) -> Any:
    """Communication per parallel dimension: exposed comm per step by dimension (chart), the per-step
    figures of each dimension (table) and the findings in words; nothing without collectives."""
    by = summary.get("comm_by_dim") or {}
    if not by:
        return None
    step_s = (summary.get("decomposition") or {}).get("step_s")
    rows = [[html.B(dim), _per_step(v.get("calls") or 0), fmt_bytes(v.get("bytes")), _ms(v.get("total_s")),
             _ms(v.get("exposed_s")), fmt_pct(v["exposed_s"] / step_s) if step_s and v.get("exposed_s") is not None else "–",
             f"{v['nodes']:,}" if v.get("nodes") else "–"] for dim, v in by.items()]
    table = simple_table(["dimension", "calls/step", "bytes/step", "total (ms/step)", "exposed (ms/step)",
                          "exposed share of step", "nodes spanned"], rows, numeric=(1, 2, 3, 4, 5, 6), tid=f"{COMM_DIMS}-table")
    n_steps = summary.get("steps") or 0
    shown = len(series.get("steps") or [])
    note = (f"per step: cross-rank median; {shown:,} of {n_steps:,} steps shown (evenly spaced)"
            if n_steps and 0 < shown < n_steps else None)
    findings = [_sentence(f["finding"]) for f in summary.get("parallel_findings") or [] if f.get("finding")]
    foot = ("Per step: the median over steps of the cross-rank median of a rank's calls, bytes and seconds in the "
            "dimension (its DeviceMesh name; 'world' = all ranks)"
            + ("; pipeline send/recv are in the Pipeline panel" if summary.get("pipeline") else "") + ".")
    return section("Communication by dimension", [
        html.Div([html.Div(graph(f"{COMM_DIMS}-chart", F.comm_dims_figure(series, list(by), note=note)), className="fs-col-6"),
                  html.Div(table, className="fs-col-6 fs-scroll")], className="fs-row"),
        html.Ul([html.Li(f) for f in findings], className="fs-list", id=f"{COMM_DIMS}-findings") if findings else None,
        html.Div(foot, className="fs-footnote"),
    ], sid=f"{COMM_DIMS}-section")


@contained("pipeline panel")
def _pipeline_panel(summary: dict[str, Any]) -> Any:
    """The pipeline: stages, schedule, micro-batches, bubble (send/recv wait) and the slowest stage,
    with busy time and bubble per stage; nothing for a job without pipeline stages."""
    p = summary.get("pipeline")
    if not p:
        return None
    frac = p.get("bubble_fraction")
    per = {x["stage"]: x for x in p.get("per_stage") or []}
    slow = p.get("slowest_stage")
    tiles = [kpi("stages", f"{p.get('stages') or 0:,}"),
             kpi("schedule", p.get("schedule") or "–", None if p.get("schedule") else "not reported"),
             kpi("micro-batches", f"{p['microbatches']:,}" if p.get("microbatches") else "–",
                 None if p.get("microbatches") else "not reported"),
             kpi("bubble", fmt_s(p.get("bubble_s")), f"{fmt_pct(frac)} of the step" if frac is not None else None,
                 tone="bad" if frac is not None and frac >= 0.05 else None),
             kpi("slowest stage", f"stage {slow}" if slow is not None else "–",
                 f"busy {fmt_s(per[slow]['busy_s'])}" if slow in per else None)]
    return section("Pipeline", [
        kpi_strip(tiles, kid=f"{PIPELINE}-kpis"),
        graph(f"{PIPELINE}-chart", F.pipeline_stages_figure(p)),
        html.Div("Bubble = time a rank waits in point-to-point send/recv (cross-rank median per step, median over "
                 "steps); it is part of exposed communication. Busy = step − exposed communication.",
                 className="fs-footnote"),
    ], sid=f"{PIPELINE}-section")


@callback(Output(COMM_DIMS, "children"), Output(PIPELINE, "children"), Input(RUN, "data"))
def _parallelism(rid: int) -> tuple[Any, Any]:
    eng = _state.engine()
    summary = reports.run_page_summary(eng, rid) or {}
    series = reports.comm_dim_series(eng, rid) if summary.get("comm_by_dim") else {}
    return _comm_dims_panel(summary, series), _pipeline_panel(summary)


@contained("gradient communication panel")
def _overlap_panel(view: dict[str, Any] | None, summary: dict[str, Any]) -> Any:
    """Gradient communication against backward: one representative rank-step's collectives on its
    timeline (backward as a band, exposed parts highlighted) and the summary's bucketing / overlap
    advice with each upper-bound gain; nothing for a run without collectives."""
    if not view or not view.get("collectives"):
        return None
    tail = view.get("tail_s")
    step_s = view.get("step_s")
    tiles = [kpi("step · rank", f"{view['step']:,} · {view['rank']:,}", "recent median step, its median rank"),
             kpi("waited for after backward", fmt_s(tail) if tail is not None else "–",
                 f"{fmt_pct(tail / step_s)} of this step" if tail is not None and step_s else "no backward measured",
                 tone="bad" if tail and step_s and tail / step_s >= 0.05 else None),
             kpi("overlap", fmt_pct(view.get("overlap_ratio")), "of this step's communication hidden"),
             kpi("overlap in backward", fmt_pct(view.get("backward_overlap_ratio")), "collectives issued in backward")]
    advice = summary.get("overlap_advice") or []
    items = [html.Li([html.B(a["setting"]), f": {_sentence(a['suggestion'])} Expected gain at most {fmt_s(a['expected_gain_s'])}"
                      + (f" ({fmt_pct(a['expected_gain_share'])} of the step)" if a.get("expected_gain_share") is not None else "")
                      + " — an upper bound. ", html.Span(a["why"], className="fs-muted")]) for a in advice]
    return section("Gradient communication vs backward", [
        kpi_strip(tiles, kid=f"{OVERLAP}-kpis"),
        graph(f"{OVERLAP}-chart", F.overlap_figure(view)),
        html.Ul(items, className="fs-list", id=f"{OVERLAP}-advice") if items else
        html.Div("No bucketing or overlap suggestion: exposed communication is not a top bottleneck of this run, the "
                 "Diagnosis finds it is waiting or small synchronisation rather than bandwidth (or not the job's "
                 "DDP / FSDP pattern), or no change could remove 1 % of its step.", className="fs-muted",
                 id=f"{OVERLAP}-advice"),
        html.Div(_sentence(view.get("note") or ""), className="fs-footnote"),
        html.Div(f"Showing the {len(view['collectives']):,} longest of {view['collectives_total']:,} collectives of this "
                 "rank-step; the figures above count all of them.",
                 className="fs-footnote", id=f"{OVERLAP}-shown")
        if view.get("collectives_total", 0) > len(view["collectives"]) else None,
    ], sid=f"{OVERLAP}-section")


@callback(Output(OVERLAP, "children"), Input(RUN, "data"))
def _overlap(rid: int) -> Any:
    eng = _state.engine()
    return _overlap_panel(reports.run_overlap(eng, rid, limit=OVERLAP_BARS), reports.run_page_summary(eng, rid) or {})


def _num_cell(v: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "–"


@contained("profiler traces")
def _traces_section(traces: Any) -> Any:
    """Exact figures from imported profiler traces (``fleetscope import-trace``): per rank, the cross-rank
    kernel-type totals (the ``rank = -1`` row) and the top kernels of the first rank."""
    items = [t for t in (traces or []) if isinstance(t, dict) and isinstance(t.get("summary"), dict)]
    ranks = [t for t in items if (t.get("rank") or 0) >= 0]
    if not ranks:
        return None
    rows = [[t["rank"], t.get("source") or "–",
             *(_num_cell(t["summary"].get(k)) for k in ("compute_pct", "non_compute_pct", "idle_pct", "comm_overlap_pct")),
             _num_cell((t["summary"].get("kernel_time_us") or 0) / 1e3 if t["summary"].get("kernel_time_us") is not None
                       else None, "{:,.1f}")] for t in ranks[:64]]
    parts: list[Any] = [html.Div(simple_table(
        ["rank", "trace", "compute %", "non-compute %", "idle %", "comm overlap %", "kernel time (ms)"], rows,
        numeric=(0, 2, 3, 4, 5, 6), tid="run-trace-ranks"), className="fs-col-7 fs-scroll")]
    side: list[Any] = []
    totals = next((t["summary"].get("kernel_types") for t in items if t.get("rank") == -1), None)
    if totals:
        side.append(simple_table(["kernel type (all ranks)", "time (ms)", "%"],
                                 [[k.get("kernel_type"), _num_cell((k.get("time_us") or 0) / 1e3, "{:,.1f}"),
                                   _num_cell(k.get("percentage"), "{:.1f}")] for k in totals], numeric=(1, 2)))
    top = sorted(ranks[0]["summary"].get("top_kernels") or [], key=lambda k: -(k.get("sum_us") or 0))[:10]
    if top:
        side.append(simple_table([f"top kernels, rank {ranks[0]['rank']}", "type", "calls", "total (ms)"],
                                 [[(k.get("name") or "")[:80], k.get("kernel_type"), f"{k.get('count', 0):,}",
                                   _num_cell((k.get("sum_us") or 0) / 1e3, "{:,.2f}")] for k in top], numeric=(2, 3)))
    parts.append(html.Div(side, className="fs-col-5 fs-scroll"))
    return section(f"Profiler traces ({len(ranks)} ranks, exact decomposition)", html.Div(parts, className="fs-row"),
                   sid="run-traces")


@callback(Output(EXTRAS, "children"), Output(CONFIG, "children"), Input(RUN, "data"))
def _extras(rid: int) -> tuple[Any, Any]:
    eng = _state.engine()
    run = reports.get_run(eng, rid) or {}
    parts = [p for p in (_goodput_section(reports.goodput(eng, rid)), _events_section(reports.run_events(eng, rid)),
                         _traces_section(reports.run_traces(eng, rid))) if p is not None]
    return parts, _config_section(run)


@contained("goodput")
def _goodput_section(good: dict[str, Any] | None) -> Any:
    if good is not None and good.get("goodput") is not None:
        shares = good.get("badput_share") or {}
        tiles = [kpi("goodput", fmt_pct(good.get("goodput")), f"productive of {fmt_s(good.get('wall_s'))} wall"
                     + (" · estimated (no run events)" if good.get("estimated") else ""))]
        for k, v in (good.get("badput") or {}).items():
            tiles.append(kpi(str(k).removesuffix("_s").replace("_", " "), fmt_s(v), fmt_pct(shares.get(k)) + " of wall"))
        return section("Goodput", kpi_strip(tiles, kid="run-goodput"))
    return None


@contained("events")
def _events_section(events: list[dict[str, Any]] | None) -> Any:
    if events:
        rows = [[fmt_time(e["ts"]), e["kind"], e["rank"], e["step"] if e["step"] is not None else "–",
                 json.dumps(e["data"], default=str)[:120]] for e in events[:100]]
        return section(f"Events ({len(events)})", html.Div(
            simple_table(["time (UTC)", "kind", "rank", "step", "data"], rows, numeric=(2, 3)), className="fs-scroll"))
    return None


@contained("config")
def _config_section(run: dict[str, Any]) -> Any:
    cfg = run.get("config") or {}
    meta = run.get("meta") or {}
    info = [["name", run.get("name")], ["id", run.get("id")], ["family", run.get("model_family") or "–"],
            ["world size", run.get("world_size")], ["model-parallel size", run.get("mp_size")],
            ["device", f"{run.get('device_type') or '–'} × {run.get('device_count') or '–'}"],
            ["peak FLOP/s per device", fmt_num(run.get("peak_flops"))], ["commit", run.get("git_commit") or "–"],
            ["started", fmt_time(run.get("started_at"))], ["finished", fmt_time(run.get("finished_at"))],
            ["last seen", fmt_time(run.get("last_seen_at"))], ["config signature", run.get("config_signature") or "–"]]
    cfg_rows = [[k, json.dumps(v, default=str)] for k, v in sorted(cfg.items())]
    meta_rows = [[k, json.dumps(v, default=str)] for k, v in sorted(meta.items())]
    config = html.Div([
        html.Div(simple_table(["run", ""], info), className="fs-col-4"),
        html.Div(simple_table(["config key", "value"], cfg_rows) if cfg_rows else
                 empty_state("No config", "Pass config={...} to fs.init to see (and compare) it here."), className="fs-col-4"),
        html.Div(simple_table(["meta", "value"], meta_rows) if meta_rows else None, className="fs-col-4"),
    ], className="fs-row")
    return config


def _spread(sp: dict[str, Any] | None) -> str:
    if not sp:
        return "–"
    return f"{sp['min_us']:,.0f} / {sp['median_us']:,.0f} / {sp['max_us']:,.0f} (rank {sp['max_rank']})"


@callback(Output(KERNELS, "children"), Input(RUN, "data"))
def _kernels(rid: int) -> Any:
    """Kernel hotspots over the run's sampled trace windows (nothing for a run without GPU kernels in
    its windows): top kernels by time across ranks, category, share, trend and rank spread."""
    rep = reports.run_kernels(_state.engine(), rid, top=15)
    if not rep["kernels"]:
        return None
    rows = [[html.Span(k["name"][:90] + ("…" if len(k["name"]) > 90 else ""), title=k["name"]), k["category"],
             fmt_pct(k["share"]), f"{k['us_per_step']:,.0f}" if k.get("us_per_step") is not None else "–",
             f"{k['trend']['ratio']:.2f}×" if (k.get("trend") or {}).get("ratio") is not None else "–",
             _spread(k.get("rank_spread"))] for k in rep["kernels"]]
    table = simple_table(["kernel", "category", "share of kernel time", "µs per rank-step", "trend (last ÷ first)",
                          "per rank µs/step min / median / max"], rows, numeric=(2, 3, 4), tid=f"{KERNELS}-table")
    cats = " · ".join(f"{c['category']} {fmt_pct(c['share'], 0)}" for c in rep["categories"][:8])
    return section("Kernel hotspots", [
        html.Div([html.B("By category: "), cats], className="fs-muted", id=f"{KERNELS}-categories"),
        html.Div(table, className="fs-scroll"),
        html.Ul([html.Li(f[:1].upper() + f[1:] + ".") for f in rep["findings"]], className="fs-list", id=f"{KERNELS}-findings")
        if rep["findings"] else None,
        html.Div(f"Sampled profiler windows: {rep['windows']:,} windows on {rep['ranks']:,} ranks, steps "
                 f"{rep['first_step']:,}–{rep['last_step']:,}; kernel time summed over streams (overlapping kernels "
                 "both count). Trend: median over ranks of the µs per step in their last window ÷ their first.",
                 className="fs-footnote"),
    ], sid=f"{KERNELS}-section")


clientside_callback(
    f"function(h, a, r, ws, tp, pp, mb) {{ return ({URL_SYNC_JS})([['heat', h], ['agg', a], ['rank', r], "
    "['ws', ws], ['tp', tp], ['pp', pp], ['mb', mb]]); }",
    Output(URL, "data"), Input(HEAT_FIELD, "value"), Input(HEAT_AGG, "value"), Input(rank_panel.RANK_PICK, "value"),
    *projection_panel.url_inputs(),
)
