"""Training scalars beside performance: the run page's "Training scalars" panel (chosen scalars on the
step axis above the step time, with recompiles, checkpoints, evaluations and the first step of a
step-time alert marked) and the Compare
page's overlay of one scalar across runs. Data: ``reports.research.run_scalars`` (min/max-downsampled,
spikes kept), ``reports.run_series`` (step time), ``reports.run_compile``, ``reports.run_events``."""

from __future__ import annotations

from typing import Any

from dash import Input, Output, dcc, html
from fleetscope.server import reports
from fleetscope.server.analysis.goodput import CHECKPOINT_KINDS, EVAL_KINDS
from fleetscope.server.reports import research
from fleetscope.server.store import scalars as scalar_store

from . import _state
from .components import callback, graph, loading, section

__all__ = ["run_panel", "compare_panel", "scalars_figure", "overlay_figure"]

RUN = "run-id"  # the run page's store of the run id (pages/run.py)
PICK = "run-scalars-pick"
CHART = "run-scalars"
CMP_RUNS = "compare-runs"  # the compare page's run picker (pages/compare.py)
CMP_PICK = "compare-scalars-pick"
CMP_CHART = "compare-scalars"
MAX_POINTS = 1_500
MAX_MARKS = 200
_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
_DEFAULT = ("loss", "train/loss", "train_loss", "hf/loss", "lightning/loss", "lightning/train_loss")


def _default_pick(names: list[str]) -> list[str]:
    first = [n for n in _DEFAULT if n in names][:1]
    if first:
        return first
    return names[:1]


def run_panel(rid: int) -> Any:
    """The panel of a run with scalars (None without: no empty box on the page)."""
    try:
        names = scalar_store.scalar_names(_state.engine(), rid)
    except _state.NotReady:
        return None
    if not names:
        return None
    return section("Training scalars", [
        dcc.Dropdown(id=PICK, options=names, value=_default_pick(names), multi=True, className="fs-control",
                     placeholder="scalars to draw", style={"maxWidth": "640px"}),
        loading(graph(CHART, height=460)),
    ], sid="run-scalars-section")


def _marks(eng: Any, rid: int) -> list[tuple[str, list[int], str]]:
    """(label, steps, colour) of what the chart marks: recompiles, checkpoints, evaluations, alerts that
    name a step of the run (a step-time shift)."""
    out: list[tuple[str, list[int], str]] = []
    comp = reports.run_compile(eng, rid) or {}
    if comp.get("recompile_steps"):
        out.append(("recompile", [int(s) for s in comp["recompile_steps"]][:MAX_MARKS], "#CC79A7"))
    evs = reports.run_events(eng, rid) or []
    for label, kinds, colour in (("checkpoint", CHECKPOINT_KINDS, "#009E73"), ("evaluation", EVAL_KINDS, "#56B4E9")):
        steps = sorted({int(e["step"]) for e in evs if e.get("kind") in kinds and isinstance(e.get("step"), int)})
        if steps:
            out.append((label, steps[:MAX_MARKS], colour))
    alert_steps = sorted({int(fb["step"]) for a in reports.list_alerts(eng, run_id=rid, limit=100)
                          if isinstance(fb := a.get("first_bad"), dict) and isinstance(fb.get("step"), int)})
    if alert_steps:  # a step-time shift found inside the run: where it starts
        out.append(("alert", alert_steps[:MAX_MARKS], "#D55E00"))
    return out


def scalars_figure(scalars: dict[str, dict[str, Any]], step_x: list[int], step_y: list[float],
                   marks: list[tuple[str, list[int], str]]) -> dict[str, Any]:
    """Scalars (top, one line each; a second axis for the second one when its scale differs) over
    the step time (bottom), sharing the step axis; marks as dotted vertical lines and legend entries."""
    data: list[dict[str, Any]] = []
    names = list(scalars)
    for i, n in enumerate(names):
        d = scalars[n]
        data.append({"type": "scattergl" if len(d["step"]) > 2000 else "scatter", "x": d["step"], "y": d["value"],
                     "name": n + (" (downsampled)" if d.get("reduced") else ""), "mode": "lines",
                     "line": {"color": _PALETTE[i % len(_PALETTE)], "width": 1.5},
                     "yaxis": "y3" if i == 1 else "y", "hovertemplate": f"{n} %{{y:.4g}} at step %{{x}}<extra></extra>"})
    if step_x:
        data.append({"type": "scatter", "x": step_x, "y": step_y, "name": "step time (s)", "mode": "lines",
                     "line": {"color": "#555", "width": 1}, "yaxis": "y2",
                     "hovertemplate": "step %{x}: %{y:.3f} s<extra></extra>"})
    shapes = []
    for label, steps, colour in marks:
        shapes += [{"type": "line", "xref": "x", "x0": s, "x1": s, "yref": "paper", "y0": 0, "y1": 1,
                    "line": {"color": colour, "width": 1, "dash": "dot"}} for s in steps]
        data.append({"type": "scatter", "x": steps, "y": [None] * len(steps), "mode": "markers", "name": label,
                     "marker": {"color": colour, "symbol": "line-ns-open", "size": 10}, "yaxis": "y2",
                     "hovertemplate": f"{label} at step %{{x}}<extra></extra>"})
    layout: dict[str, Any] = {
        "margin": {"l": 60, "r": 60, "t": 30, "b": 40}, "hovermode": "x unified", "legend": {"orientation": "h", "y": 1.08},
        "xaxis": {"title": {"text": "step"}, "anchor": "y2"},
        "yaxis": {"domain": [0.36, 1.0], "title": {"text": names[0] if names else ""}},
        "yaxis2": {"domain": [0.0, 0.28], "title": {"text": "step time (s)"}, "rangemode": "tozero"},
        "shapes": shapes, "plot_bgcolor": "#fff",
    }
    if len(names) > 1:
        layout["yaxis3"] = {"overlaying": "y", "side": "right", "title": {"text": names[1]}, "showgrid": False}
    return {"data": data, "layout": layout}


@callback(Output(CHART, "figure"), Input(RUN, "data"), Input(PICK, "value"))
def _run_chart(rid: int, names: list[str] | None) -> Any:
    eng = _state.engine()
    names = list(names or [])[:8]
    sc = research.run_scalars(eng, rid, names, MAX_POINTS)["scalars"] if names else {}
    series = reports.run_series(eng, rid)
    st = series.get("step_s")
    sx = [int(x) for x in st.x] if st is not None else []
    sy = [float(y) for y in st.y] if st is not None else []
    return scalars_figure(sc, sx, sy, _marks(eng, rid))


# ------------------------------------------------------------------ compare: one scalar across runs


def compare_panel(ids: list[int]) -> Any:
    """The compare page's overlay section: a scalar the picked runs logged, one line per run."""
    try:
        eng = _state.engine()
    except _state.NotReady:
        return None
    names = sorted({n for i in ids for n in scalar_store.scalar_names(eng, i)})
    return section("Training scalars", [
        dcc.Dropdown(id=CMP_PICK, options=names, value=next(iter(_default_pick(names)), None), clearable=False,
                     className="fs-control", placeholder="a scalar to overlay", style={"maxWidth": "420px"}),
        loading(graph(CMP_CHART, height=340)),
        html.Div("Scalars appear here once the runs log them (run.log, or HF Trainer / Lightning under fleetscope run).",
                 className="fs-muted") if not names else None,
    ], sid="compare-scalars-section")


def overlay_figure(lines: list[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    data = [{"type": "scatter", "x": d["step"], "y": d["value"], "name": label, "mode": "lines",
             "line": {"color": _PALETTE[i % len(_PALETTE)], "width": 1.5}} for i, (label, d) in enumerate(lines)]
    return {"data": data, "layout": {"margin": {"l": 60, "r": 20, "t": 20, "b": 40}, "hovermode": "x unified",
                                     "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": name or ""}},
                                     "plot_bgcolor": "#fff"}}


@callback(Output(CMP_PICK, "options"), Output(CMP_CHART, "figure"), Input(CMP_RUNS, "value"), Input(CMP_PICK, "value"))
def _compare_chart(ids: list[Any] | None, name: str | None) -> Any:
    eng = _state.engine()
    ids = [int(i) for i in (ids or [])][:8]
    names = sorted({n for i in ids for n in scalar_store.scalar_names(eng, i)})
    lines = []
    if name:
        for i in ids:
            d = research.run_scalars(eng, i, [name], MAX_POINTS)["scalars"].get(name)
            if d:
                r = reports.get_run(eng, i) or {}
                lines.append((str(r.get("name") or f"run {i}"), d))
    return names, overlay_figure(lines, name or "")
