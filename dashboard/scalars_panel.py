"""Training scalars beside performance: the run page's "Training scalars" panel (chosen scalars on the
step axis above the step time, with recompiles, checkpoints, evaluations, the steps where each
straggler rank was slow and the first step of an alert marked; at most MAX_MARKS lines per kind and
MAX_BANDS straggler ranges, the chart saying when it left some out) and the Compare page's overlay of
one scalar across runs. Data: ``reports.research.run_scalars`` (min/max-downsampled, spikes kept),
``reports.run_series`` (step time), ``reports.run_compile``, ``reports.run_events``,
``reports.straggler_view`` (the straggler report the page's straggler table reads: each straggler's
flagged windows as step ranges), ``reports.list_alerts``. Scalar names and node names are user text:
escaped (``figures.plain``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dash import Input, Output, dcc, html
from fleetscope.server import reports
from fleetscope.server.reports import research
from fleetscope.server.reports.research import CHECKPOINT_KINDS, EVAL_KINDS

from . import _state
from .components import callback, graph, loading, section
from .figures import _axis, plain

__all__ = ["run_panel", "compare_panel", "scalars_figure", "overlay_figure", "Mark"]

RUN = "run-id"  # the run page's store of the run id (pages/run.py)
PICK = "run-scalars-pick"
CHART = "run-scalars"
CMP_RUNS = "compare-runs"  # the compare page's run picker (pages/compare.py)
CMP_PICK = "compare-scalars-pick"
CMP_CHART = "compare-scalars"
MAX_POINTS = 1_500
MAX_MARKS = 100  # dotted lines drawn per kind of mark (the first ones; the chart says when it left some out)
MAX_STRAGGLER_RANKS = 8  # straggler ranks shaded (the worst first)
MAX_BANDS = 64  # shaded straggler step ranges in all
STRAGGLER_COLOUR = "#E69F00"
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
        names = research.scalar_names(_state.engine(), rid)
    except _state.NotReady:
        return None
    if not names:
        return None
    return section("Training scalars", [
        dcc.Dropdown(id=PICK, options=names, value=_default_pick(names), multi=True, className="fs-control",
                     placeholder="scalars to draw", style={"maxWidth": "640px"}),
        loading(graph(CHART, height=460)),
    ], sid="run-scalars-section")


@dataclass
class Mark:
    """What the chart marks at some steps: a dotted line at each of ``steps`` (at most MAX_MARKS drawn,
    of ``total``), or, with ``bands``, shaded step ranges ``[first, end)`` (stragglers)."""

    label: str  # legend text: plain text (escaped when drawn)
    steps: list[int]
    colour: str
    total: int = 0  # steps there were before the cap (0: as many as drawn)
    bands: list[tuple[int, int, str]] = field(default_factory=list)  # (first, end, hover text: plain)


def _capped(label: str, steps: list[int], colour: str) -> Mark:
    return Mark(label, steps[:MAX_MARKS], colour, total=len(steps))


def _straggler_marks(eng: Any, rid: int) -> list[Mark]:
    """The run's stragglers (the straggler report the page's straggler table reads, cached per run): the
    step ranges where each was slow (its flagged windows), the worst MAX_STRAGGLER_RANKS ranks, at most
    MAX_BANDS ranges; a persistent straggler without flagged windows is shaded over the whole run."""
    items = list((reports.straggler_view(eng, rid) or {}).get("stragglers") or [])
    bands: list[tuple[int, int, str]] = []
    shown: list[str] = []
    total = 0
    for it in items[:MAX_STRAGGLER_RANKS]:
        ranges = [(int(a), int(b)) for a, b in it.get("slow_ranges") or []]
        if not ranges and it.get("kind") == "persistent":
            ranges = [(-1, -1)]  # the whole run: the figure knows its step range
        if not ranges:
            continue
        where = f"rank {it['rank']}" + (f" ({it.get('node') or it.get('host')})" if it.get("node") or it.get("host") else "")
        how = f"{it['slowdown']:.2f}× the median rank's work over the run" if it.get("slowdown") else "slow"
        shown.append(where)
        total += len(ranges)
        bands += [(a, b, f"straggler {where}, {it.get('kind') or ''}: {how}") for a, b in ranges][:MAX_BANDS - len(bands)]
    if not bands:
        return []
    label = (f"straggler {shown[0]}" if len(items) == 1
             else f"stragglers ({len(shown)} of {len(items)} ranks)" if len(items) > len(shown)
             else f"stragglers ({len(shown)} ranks)")
    return [Mark(label, [b[0] for b in bands], STRAGGLER_COLOUR, total=total, bands=bands)]


def _marks(eng: Any, rid: int) -> list[Mark]:
    """What the chart marks: recompiles, checkpoints, evaluations, stragglers (where each was slow) and
    the alerts that name a step of the run (a step-time shift; a straggler's first slow window)."""
    out: list[Mark] = []
    comp = reports.run_compile(eng, rid) or {}
    if comp.get("recompile_steps"):
        out.append(_capped("recompile", sorted({int(s) for s in comp["recompile_steps"]}), "#CC79A7"))
    evs = reports.run_events(eng, rid) or []
    for label, kinds, colour in (("checkpoint", CHECKPOINT_KINDS, "#009E73"), ("evaluation", EVAL_KINDS, "#56B4E9")):
        steps = sorted({int(e["step"]) for e in evs if e.get("kind") in kinds and isinstance(e.get("step"), int)})
        if steps:
            out.append(_capped(label, steps, colour))
    out += _straggler_marks(eng, rid)
    by_kind: dict[str, set[int]] = {}
    for a in reports.list_alerts(eng, run_id=rid, limit=100):
        if isinstance(fb := a.get("first_bad"), dict) and isinstance(fb.get("step"), int):
            by_kind.setdefault(str(a.get("kind") or ""), set()).add(int(fb["step"]))
    for kind, steps in sorted(by_kind.items()):  # where a step-time shift starts; a straggler's first slow window
        label = "straggler alert" if kind == "straggler" else "alert" if kind == "step_time_shift" else f"{kind} alert"
        out.append(_capped(label, sorted(steps), STRAGGLER_COLOUR if kind == "straggler" else "#D55E00"))
    return out


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def scalars_figure(scalars: dict[str, dict[str, Any]], step_x: list[int], step_y: list[float],
                   marks: list[Mark]) -> dict[str, Any]:
    """Scalars (top, one line each; a second axis for the second one when its scale differs) over
    the step time (bottom), sharing the step axis; marks as dotted vertical lines (stragglers as shaded
    step ranges) with a legend entry each; a note when marks were capped."""
    data: list[dict[str, Any]] = []
    names = list(scalars)
    for i, n in enumerate(names):
        d = scalars[n]
        data.append({"type": "scattergl" if len(d["step"]) > 2000 else "scatter", "x": d["step"], "y": d["value"],
                     "name": plain(n) + (" (downsampled)" if d.get("reduced") else ""), "mode": "lines",
                     "line": {"color": _PALETTE[i % len(_PALETTE)], "width": 1.5},
                     "yaxis": "y3" if i == 1 else "y",
                     "hovertemplate": f"{plain(n, template=True)} %{{y:.4g}} at step %{{x}}<extra></extra>"})
    if step_x:
        data.append({"type": "scatter", "x": step_x, "y": step_y, "name": "step time (s)", "mode": "lines",
                     "line": {"color": "#555", "width": 1}, "yaxis": "y2",
                     "hovertemplate": "step %{x}: %{y:.3f} s<extra></extra>"})
    xs = [x for d in scalars.values() for x in d["step"][:1] + d["step"][-1:]] + step_x[:1] + step_x[-1:]
    first, last = (min(xs), max(xs) + 1) if xs else (0, 1)
    shapes: list[dict[str, Any]] = []
    capped: list[str] = []
    layout_extra: dict[str, Any] = {}
    for m in marks:
        if m.bands:
            spans = [(first, last, h) if a < 0 else (a, min(b, last), h) for a, b, h in m.bands]
            shapes += [{"type": "rect", "xref": "x", "x0": a, "x1": b, "yref": "paper", "y0": 0, "y1": 1,
                        "fillcolor": m.colour, "opacity": 0.14, "line": {"width": 0}, "layer": "below"}
                       for a, b in _union([(a, b) for a, b, _ in spans])]  # ranks slow at the same steps: shaded once
            # a marker at the top of the chart where each range starts, naming the rank, its node and slowdown
            data.append({"type": "scatter", "x": [a for a, _, _ in spans], "y": [1.0] * len(spans), "mode": "markers",
                         "name": plain(m.label), "marker": {"color": m.colour, "symbol": "triangle-down", "size": 9},
                         "yaxis": "y4", "cliponaxis": False,
                         "text": [plain(f"{h}; slow at steps {a:,}–{b - 1:,}") for a, b, h in spans],
                         "hovertemplate": "%{text}<extra></extra>"})
            # on the scalars' panel, at its top (an overlaying axis: no background of its own over the other panels)
            layout_extra["yaxis4"] = {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True}
        else:
            shapes += [{"type": "line", "xref": "x", "x0": s, "x1": s, "yref": "paper", "y0": 0, "y1": 1,
                        "line": {"color": m.colour, "width": 1, "dash": "dot"}} for s in m.steps]
            data.append({"type": "scatter", "x": m.steps, "y": [None] * len(m.steps), "mode": "markers",
                         "name": plain(m.label), "marker": {"color": m.colour, "symbol": "line-ns-open", "size": 10},
                         "yaxis": "y2", "hovertemplate": f"{plain(m.label, template=True)} at step %{{x}}<extra></extra>"})
        if m.total > (len(m.bands) or len(m.steps)):
            capped.append(f"{len(m.bands) or len(m.steps):,} of {m.total:,} {m.label}")
    layout: dict[str, Any] = {
        "margin": {"l": 60, "r": 60, "t": 44, "b": 48}, "hovermode": "x unified", "legend": {"orientation": "h", "y": 1.08},
        "xaxis": _axis(title="step", anchor="y2"),
        "yaxis": _axis(title=names[0] if names else "", domain=[0.36, 1.0]),
        "yaxis2": _axis(title="step time (s)", domain=[0.0, 0.28], rangemode="tozero"),
        "shapes": shapes, "plot_bgcolor": "rgba(0,0,0,0)",  # see-through: the straggler ranges are shaded below it
    }
    layout.update(layout_extra)
    if len(names) > 1:
        layout["yaxis3"] = _axis(title=names[1], overlaying="y", side="right", showgrid=False)
    if capped:  # bounded: say what was left out
        layout["annotations"] = [{"text": plain("marks capped: " + "; ".join(capped) + " drawn"), "xref": "paper",
                                  "x": 1, "xanchor": "right", "yref": "paper", "y": 0.31, "yanchor": "bottom",
                                  "showarrow": False, "font": {"size": 10, "color": "#5b6370"}}]
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
    names = sorted({n for i in ids for n in research.scalar_names(eng, i)})
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
    names = sorted({n for i in ids for n in research.scalar_names(eng, i)})
    lines = []
    if name:
        for i in ids:
            d = research.run_scalars(eng, i, [name], MAX_POINTS)["scalars"].get(name)
            if d:
                r = reports.get_run(eng, i) or {}
                lines.append((str(r.get("name") or f"run {i}"), d))
    return names, overlay_figure(lines, name or "")
