"""Compare (``/compare?runs=a,b,...``): runs overlaid, with a diff table of normalised metrics
(tokens/s/GPU, MFU, step time per 1k tokens, exposed comm per parallel dimension) and of the config,
and exposed comm per dimension side by side; the URL is the shareable state."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, clientside_callback, dcc, html
from fleetscope.server import reports

from .. import _state, scalars_panel
from .. import figures as F
from ..components import (
    URL_SYNC_JS,
    callback,
    contained,
    empty_state,
    graph,
    loading,
    page_header,
    section,
    simple_table,
)
from ..theme import fmt_bytes, fmt_num, fmt_pct, fmt_s

dash.register_page(__name__, path="/compare", name="Compare", title="fleetscope · compare", order=3)

RUNS = "compare-runs"
URL = "compare-url"
SERIES = "compare-series"
DECOMP = "compare-decomposition"
COMM_DIMS = "compare-comm-dims"
METRICS = "compare-metrics"
CONFIG = "compare-config"
ONLY_DIFF = "compare-only-diff"
NORM = "compare-norm"
NORMALISED = "compare-normalised"
MAX_RUNS = 8

#: the normalisation selector (``?norm=``): how throughput is made comparable across runs and families
NORM_OPTIONS = (("gpu", "per GPU"), ("param", "per active parameter"), ("sample", "per sample"),
                ("modality", "per modality"))

# (key, label, formatter, higher is better)
METRIC_ROWS = (
    ("tokens_per_s_per_gpu", "tokens/s/GPU", lambda v: f"{fmt_num(v)}", True),
    ("mfu", "MFU", fmt_pct, True),
    ("step_ms_per_1k_tokens", "step time per 1k tokens per GPU (ms)", lambda v: f"{v:.2f}" if v is not None else "–", False),
    ("tokens_per_s", "tokens/s (job)", lambda v: f"{fmt_num(v)}", True),
    ("step_s", "step time p50", fmt_s, False),
    ("step_s_p95", "step time p95 (slowest rank)", fmt_s, False),
    ("data_s", "data", fmt_s, False),
    ("compute_s", "compute", fmt_s, False),
    ("comm_exposed_s", "exposed comm", fmt_s, False),
    ("other_s", "other", fmt_s, False),
    ("packing_efficiency", "packing efficiency", fmt_pct, True),
    ("mem_peak_bytes", "peak memory", fmt_bytes, False),
)


def _ids(runs: str | None) -> list[int]:
    out = []
    for p in (runs or "").split(","):
        p = p.strip()
        if p.isdigit() and 0 < int(p) < 2**31 and int(p) not in out:
            out.append(int(p))
    return out[:MAX_RUNS]


def layout(runs: str | None = None, diff: str | None = None, norm: str | None = None, **_: Any) -> html.Div:
    try:
        opts = reports.run_options(_state.engine())
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    ids = _ids(runs)
    known = {o["id"] for o in opts}
    options = [{"label": f"{o['name']}  ·  {o['model_family'] or '–'} · {o['world_size']} GPUs", "value": o["id"]} for o in opts]
    # runs in the URL but older than the picker's window stay selectable
    options += [{"label": f"run {i}", "value": i} for i in ids if i not in known]
    return html.Div([
        page_header("Compare", "Two or more runs overlaid; the URL reproduces this view."),
        dcc.Store(id=URL),
        html.Div([dcc.Dropdown(id=RUNS, options=options, value=ids, multi=True, placeholder="pick runs to compare…",
                               className="fs-control fs-control-wide"),
                  dcc.Checklist(id=ONLY_DIFF, options=[{"label": " config: only differing keys", "value": "1"}],
                                value=["1"] if diff != "all" else [], className="fs-radio")], className="fs-controls"),
        loading(html.Div(id=METRICS)),
        section("Normalised throughput", [
            dcc.RadioItems(id=NORM, options=[{"label": f" {lbl}", "value": v} for v, lbl in NORM_OPTIONS],
                           value=norm if norm in dict(NORM_OPTIONS) else "gpu", inline=True, className="fs-radio"),
            loading(html.Div(id=NORMALISED))]),
        html.Div([section(None, loading(graph(SERIES)), cls="fs-col-7"),
                  section(None, loading(graph(DECOMP)), cls="fs-col-5")], className="fs-row"),
        section(None, loading(graph(COMM_DIMS))),
        scalars_panel.compare_panel(ids),  # one training scalar overlaid across the runs (dashboard/scalars_panel.py)
        section("Config", loading(html.Div(id=CONFIG))),
    ])


def _delta(v: Any, base: Any, better_high: bool, judged: bool = True) -> Any:
    """Δ vs the first run; coloured better/worse only when ``judged`` (the same family as the first run: a
    70B model is not "worse" than a ViT because it is slower), else neutral."""
    if v is None or base in (None, 0):
        return None
    ch = v / base - 1
    good = (ch > 0) == better_high
    if not judged:
        cls = "fs-delta fs-neutral"
    else:
        cls = "fs-delta " + ("fs-good" if good and abs(ch) > 0.005 else "fs-bad" if abs(ch) > 0.005 else "fs-muted")
    return html.Span(f" {ch * 100:+.1f} %", className=cls)


def _same_family(runs: list[dict[str, Any]]) -> list[bool]:
    """Per run: of the first run's family (its Δ is judged)."""
    fam = runs[0].get("model_family") if runs else None
    return [fam is not None and r.get("model_family") == fam for r in runs]


@callback(Output(METRICS, "children"), Output(SERIES, "figure"), Output(DECOMP, "figure"), Output(COMM_DIMS, "figure"),
          Output(CONFIG, "children"), Input(RUNS, "value"), Input(ONLY_DIFF, "value"))
def _fill(ids: list[int] | None, only_diff: list[str] | None) -> tuple[Any, ...]:
    ids = [int(i) for i in (ids or [])][:MAX_RUNS]
    if len(ids) < 1:
        e = empty_state("Pick runs to compare", "Choose two or more runs above (or open /compare?runs=12,15). The overlay, "
                        "a diff of normalised metrics (tokens/s/GPU, MFU, step time per 1k tokens) and the config diff "
                        "appear here; copy the URL to share exactly this view.")
        return e, F.compare_series_figure({}, {}), F.compare_decomposition_figure({}, {}), F.compare_comm_dims_figure({}, {}), None
    data = reports.compare_view(_state.engine(), ids)
    names = {r["id"]: r["name"] for r in data["runs"]}
    runs = data["runs"]
    by_dim = {r["id"]: data["comm_by_dim"].get(r["id"]) or {} for r in runs}
    return (_metrics(data, by_dim), F.compare_series_figure(data["series"], names),
            F.compare_decomposition_figure(data["metrics"], names),
            F.compare_comm_dims_figure({r["id"]: by_dim[r["id"]] for r in runs}, names), _config(data, only_diff))


@contained("metrics diff")
def _metrics(data: dict[str, Any], by_dim: dict[int, dict[str, Any]]) -> Any:
    runs = data["runs"]
    same = _same_family(runs)
    names = {r["id"]: r["name"] for r in runs}
    head = ["metric"] + [html.A(names[r["id"]], href=f"/runs/{r['id']}") for r in runs]
    rows = []
    for key, label, fmt, hib in METRIC_ROWS:
        vals = [data["metrics"][r["id"]].get(key) for r in runs]
        if all(v is None for v in vals):
            continue
        b = vals[0]
        rows.append([label] + [html.Span([fmt(v), _delta(v, b, hib, same[i]) if i else None]) for i, v in enumerate(vals)])
    for dim in dict.fromkeys(d for by in by_dim.values() for d in by):
        # a run with collectives but none in this dimension spends 0 s in it; one with none at all: not measured
        vals = [((by_dim[r["id"]].get(dim) or {}).get("exposed_s") or 0.0) if by_dim[r["id"]] else None for r in runs]
        rows.append([f"exposed comm · {dim} (per step)"]
                    + [html.Span([fmt_s(v), _delta(v, vals[0], False, same[i]) if i else None]) for i, v in enumerate(vals)])
    info = [["family"] + [r.get("model_family") or "–" for r in runs], ["GPUs"] + [f"{r['world_size']:,}" for r in runs],
            ["device"] + [r.get("device_type") or "–" for r in runs], ["commit"] + [r.get("git_commit") or "–" for r in runs]]
    missing = (html.Div(f"Unknown run ids ignored: {', '.join(map(str, data['missing']))}", className="fs-footnote")
               if data["missing"] else None)
    return html.Div([simple_table(head, info + rows, numeric=tuple(range(1, len(runs) + 1)), tid="compare-diff"),
                     html.Div("Δ is relative to the first run; green = better, red = worse — only for runs of the "
                              "first run's family: across families Δ is shown uncoloured (compare them normalised, "
                              "below).", className="fs-footnote"), missing])


@contained("config diff")
def _config(data: dict[str, Any], only_diff: list[str] | None) -> Any:
    runs = data["runs"]
    names = {r["id"]: r["name"] for r in runs}
    cfg_rows = [c for c in data["config"] if c["differs"] or not only_diff]
    if cfg_rows:
        cfg = simple_table(["key"] + [names[r["id"]] for r in runs],
                           [[c["key"]] + ["–" if v is None else str(v) for v in c["values"]] for c in cfg_rows],
                           row_classes=["fs-differs" if c["differs"] else "" for c in cfg_rows], tid="compare-config-table")
    else:
        cfg = html.Div("The configs are identical." if data["config"] else "No config recorded for these runs.",
                       className="fs-muted")
    return cfg


def _fmt_params(v: Any) -> str:
    return fmt_num(v) if v is not None else "not recorded"


#: per basis: (key, label, formatter, higher is better) rows of the normalised table
NORM_ROWS: dict[str, tuple[tuple[str, str, Any, bool], ...]] = {
    "gpu": (("tokens_per_s_per_gpu", "tokens/s/GPU", fmt_num, True),
            ("step_s_per_1k_tokens", "GPU-seconds per 1k tokens", fmt_s, False)),
    "param": (("param_tokens_per_s_per_gpu", "tokens/s/GPU × active params", fmt_num, True),
              ("active_params", "active parameters", _fmt_params, True),
              ("params", "parameters", _fmt_params, True)),
    "sample": (("samples_per_s_per_gpu", "samples/s/GPU", lambda v: fmt_num(v) if v is not None else "–", True),),
}


@callback(Output(NORMALISED, "children"), Input(RUNS, "value"), Input(NORM, "value"))
def _fill_normalised(ids: list[int] | None, norm: str | None) -> Any:
    ids = [int(i) for i in (ids or [])][:MAX_RUNS]
    if not ids:
        return None
    return _normalised(reports.compare_runs(_state.engine(), ids), norm if norm in dict(NORM_OPTIONS) else "gpu")


@contained("normalised throughput")
def _normalised(data: dict[str, Any], norm: str) -> Any:
    """The runs' throughput on the chosen basis, Δ vs the first run (coloured within its family only)."""
    runs = data["runs"]
    if not runs:
        return None
    same = _same_family(runs)
    head = ["metric"] + [html.A(r["name"], href=f"/runs/{r['id']}") for r in runs]
    rows: list[list[Any]] = []
    if norm == "modality":
        mods = list(dict.fromkeys(m for r in runs for m in (r.get("modality_tokens_per_s") or {})))
        for m in mods:
            vals = [(r.get("modality_tokens_per_s") or {}).get(m) for r in runs]
            rows.append([f"{m} tokens/s"] + [html.Span([fmt_num(v), _delta(v, vals[0], True, same[i]) if i else None])
                                             for i, v in enumerate(vals)])
        if not rows:
            return html.Div("None of these runs recorded tokens per modality (counts returning "
                            "{modality: tokens}, docs/agent.md).", className="fs-muted")
    else:
        for key, label, fmt, hib in NORM_ROWS[norm]:
            vals = [r.get(key) for r in runs]
            rows.append([label] + [html.Span([fmt(v), _delta(v, vals[0], hib, same[i]) if i and key not in
                                              ("params", "active_params") else None]) for i, v in enumerate(vals)])
    note = {"gpu": "Tokens per second per GPU: comparable between runs of one model.",
            "param": "Tokens/s/GPU × active parameters (docs/metrics.md, \"Normalised comparison\"): proportional to "
                     "model FLOP/s per GPU, so runs of models of different sizes compare; parameters as recorded "
                     "(fs.init(params=, active_params=), else counted by the agent from the model).",
            "sample": "Samples per second per GPU (where the run counted samples).",
            "modality": "Tokens per second of each modality (the run's tokens/s split by its per-modality counts)."}[norm]
    return html.Div([simple_table(head, rows, numeric=tuple(range(1, len(runs) + 1)), tid="compare-normalised-table"),
                     html.Div(note, className="fs-footnote")])


clientside_callback(
    f"function(r, d, n) {{ return ({URL_SYNC_JS})([['runs', r], ['diff', (d && d.length) ? null : 'all'], "
    f"['norm', n === 'gpu' ? null : n]]); }}",
    Output(URL, "data"), Input(RUNS, "value"), Input(ONLY_DIFF, "value"), Input(NORM, "value"),
)
