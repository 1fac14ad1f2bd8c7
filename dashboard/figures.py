"""Figure builders: pure functions from page data (fleetscope.server.reports) to Plotly figures.

No I/O and no Dash here, so every chart is unit-tested without a browser. Builders return plain
figure dicts (``{"data": [...], "layout": {...}}``) rather than ``plotly.graph_objects`` objects:
the dashboard sends them as they are, skipping plotly.py's per-property validation (about 10× the
cost of the data queries on the run page); the tests validate every figure with ``go.Figure``.
Numeric arrays go out as base64 typed arrays (float32), a quarter of the JSON size of number lists.

Conventions: durations arrive in seconds and are shown in ms or s (the axis says which), bytes as
GB, bandwidth as GB/s; the step-time components keep their colours (theme.COMPONENT_COLORS) on
every page; a chart built from reduced data says so in its title.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .theme import (
    COMPONENT_COLORS,
    COMPONENT_LABELS,
    FONT,
    SERIES_COLORS,
    fmt_bytes,
    fmt_s,
    time_unit,
    to_utc,
)

__all__ = [
    "plain",
    "reason",
    "guarded",
    "failed_figure",
    "empty_figure",
    "decomposition_figure",
    "heatmap_figure",
    "steady_colour_range",
    "basis_text",
    "slowdown_figure",
    "rank_drill_figure",
    "collectives_figure",
    "memory_figure",
    "throughput_figure",
    "modality_figure",
    "scaling_throughput_figure",
    "scaling_efficiency_figure",
    "scaling_decomposition_figure",
    "compare_series_figure",
    "compare_decomposition_figure",
    "alert_series_figure",
    "benchmark_figure",
    "busbw_by_size_figure",
    "comm_dims_figure",
    "pipeline_stages_figure",
    "compare_comm_dims_figure",
    "scaling_comm_dims_figure",
    "overlap_figure",
    "dim_color",
    "aggregation_note",
]

Fig = dict[str, Any]
log = logging.getLogger("fleetscope.dashboard")

#: what plotly.js reads as markup in any text it draws (titles, legends, tick labels, annotations, hover
#: labels: a subset of HTML — <a href>, <b>, <br>, <span style> … — and &entities;); quotes as numeric
#: entities (plotly.js decodes &#34; but not &quot;)
_PLAIN = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;", "'": "&#39;"})


def plain(s: Any, *, template: bool = False) -> str:
    """User text (a run name, family, dimension, modality, host, benchmark, phase, config value …) as
    Plotly text: ``&``, ``<``, ``>`` and quotes HTML-escaped, so plotly.js draws it literally instead of
    making an ``<a href>`` a live link or ``<b>`` bold. ``template``: the text goes into a
    ``hovertemplate`` literal, so ``%`` is escaped too (``%{…}`` would be substituted). Every place user
    text enters a figure goes through this: trace names, category values on axes, hover text and
    customdata, titles, annotations."""
    out = ("" if s is None else str(s)).translate(_PLAIN)
    return out.replace("%", "&#37;") if template else out


def reason(e: BaseException, limit: int = 160) -> str:
    """A short, one-line reason for a failure, as a "could not render" note shows it."""
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"
_COMPONENTS = ("data_s", "compute_s", "comm_exposed_s", "other_s")
_GRID = "#E6E8EB"
_MUTED = "#5b6370"
#: ticklabeloverflow "allow": plotly.js's default for numeric axes ("hide past div") measures every tick label
#: against every other after each draw (quadratic getBoundingClientRect calls, ~0.2 s of a run page's
#: rendering); automargin already keeps the labels inside the chart
_AXIS = {"gridcolor": _GRID, "zeroline": False, "linecolor": "#c9ced6", "ticks": "outside", "ticklen": 3,
         "automargin": True, "ticklabeloverflow": "allow"}


def _arr(a: Any) -> Any:
    """A numeric array as a plotly.js typed array (float32 / int32, base64); other values unchanged."""
    if not isinstance(a, np.ndarray) or a.size == 0 or a.dtype.kind not in "fiu":
        return a.tolist() if isinstance(a, np.ndarray) else a
    if a.dtype.kind == "f":
        v, code = np.ascontiguousarray(a, dtype="<f4"), "f4"
    elif a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        return a.astype(np.float64).tolist()
    else:
        v, code = np.ascontiguousarray(a, dtype="<i4"), "i4"
    spec: dict[str, Any] = {"dtype": code, "bdata": base64.b64encode(v.tobytes()).decode("ascii")}
    if v.ndim > 1:
        spec["shape"] = ", ".join(str(n) for n in v.shape)
    return spec


def _f(a: Any, mult: float = 1.0) -> Any:
    return _arr(np.asarray(a, dtype=np.float64) * mult)


def _axis(**kw: Any) -> dict[str, Any]:
    out = dict(_AXIS)
    title = kw.pop("title", None)
    if title is not None:
        out["title"] = {"text": plain(title)}
    out.update(kw)
    return out


def _layout(title: str, *, height: int = 300, legend: bool = True, note: str | None = None, x: Any = None,
            y: Any = None, hovermode: str = "x unified", **extra: Any) -> dict[str, Any]:
    # title and subtitle in the top margin; plotly.js places a title with a subtitle itself ("auto")
    # title, subtitle and axis titles are plain text (a benchmark's name, a configuration, a unit): escaped here
    head: dict[str, Any] = {"text": f"<b>{plain(title)}</b>", "x": 0.0, "xanchor": "left", "xref": "container",
                            "pad": {"l": 4}, "font": {"size": 13}}
    if note:
        head["subtitle"] = {"text": plain(note), "font": {"size": 11, "color": _MUTED}}
    lay: dict[str, Any] = {
        "title": head,
        "height": height,
        # margins that already hold the tick labels and axis titles: plotly.js's automargin then finds nothing
        # to push and draws once (a margin it has to grow makes it draw the chart again)
        "margin": {"l": 56, "r": 56 if any(isinstance(v, dict) and v.get("side") == "right" for v in extra.values()) else 16,
                   "t": 66 if note else 40, "b": 46},
        "font": {"family": FONT, "size": 11, "color": "#1f2328"},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "showlegend": legend,
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1.0, "xanchor": "right", "font": {"size": 10}},
        "hovermode": hovermode,
        "xaxis": x if x is not None else _axis(),
        "yaxis": y if y is not None else _axis(),
    }
    lay.update(extra)
    return lay


def _hline(y: float, color: str, *, xref: str = "x domain", yref: str = "y", dash: str = "dash") -> dict[str, Any]:
    return {"type": "line", "xref": xref, "x0": 0, "x1": 1, "yref": yref, "y0": y, "y1": y,
            "line": {"color": color, "width": 1, "dash": dash}}


def aggregation_note(factor: int, what: str = "steps", how: str = "min/max") -> str | None:
    """The sentence a reduced chart shows, or None when the data is raw."""
    if factor <= 1:
        return None
    return f"aggregated server-side: {how} of {factor} {what} per point"


def empty_figure(message: str, *, height: int = 260) -> Fig:
    """A blank chart with a centred explanation (never a silently empty axis)."""
    return {"data": [], "layout": {
        "annotations": [{"text": plain(message), "showarrow": False, "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper",
                         "font": {"size": 12, "color": _MUTED}}],
        "xaxis": {"visible": False}, "yaxis": {"visible": False}, "height": height,
        "margin": {"l": 10, "r": 10, "t": 10, "b": 10}, "plot_bgcolor": "white", "paper_bgcolor": "white",
        "font": {"family": FONT}}}


def failed_figure(why: str, *, height: int = 260) -> Fig:
    """What a chart shows when its builder failed: a small "could not render: <reason>" note in place
    of the chart (the failure is logged; the page's other charts and runs are unaffected)."""
    fig = empty_figure(f"could not render: {why}", height=height)
    fig["layout"]["annotations"][0]["font"]["color"] = "#b42318"
    return fig


def guarded(fn: Callable[..., Fig]) -> Callable[..., Fig]:
    """A figure builder that never raises: on any exception it logs it (``logging.exception``) and
    returns ``failed_figure`` with the reason, so one run's odd data costs one chart, never the page."""

    @functools.wraps(fn)
    def builder(*args: Any, **kwargs: Any) -> Fig:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            log.exception("dashboard: figure %s could not render", fn.__name__)
            return failed_figure(reason(e))

    return builder


@guarded
def decomposition_figure(series: dict[str, Any]) -> Fig:
    """Stacked step-time components of the median rank over steps, and the slowest rank's step time."""
    dec = series.get("decomposition")
    if not dec:
        return empty_figure("No steps recorded yet for this run.")
    mult, unit = time_unit(np.nansum([np.asarray(dec[k], dtype=float) for k in _COMPONENTS], axis=0).tolist())
    x = _arr(np.asarray(dec["step"]))
    data = [{"type": "scatter", "x": x, "y": _f(dec[k], mult), "name": COMPONENT_LABELS[k], "mode": "lines",
             "stackgroup": "dec", "line": {"width": 0.5, "color": COMPONENT_COLORS[k]}, "fillcolor": COMPONENT_COLORS[k],
             "hovertemplate": f"%{{y:.3g}} {unit}"} for k in _COMPONENTS]
    mx = series.get("step_s_max")
    if mx is not None and len(mx.x):
        data.append({"type": "scatter", "x": _arr(np.asarray(mx.x)), "y": _f(mx.y, mult), "name": "slowest rank",
                     "mode": "lines", "line": {"color": "#1f2328", "width": 1, "dash": "dot"},
                     "hovertemplate": f"%{{y:.3g}} {unit}"})
    note = aggregation_note(dec.get("factor", 1), "steps", "mean") or "per step, median rank"
    return {"data": data, "layout": _layout("Step-time decomposition", height=300, note=note, x=_axis(title="step"),
                                            y=_axis(title=f"time per step ({unit})", rangemode="tozero"))}


def basis_text(basis: dict[str, Any] | None) -> str | None:
    """The steady-state basis in words: "28 of 30 steps; 2 warm-up steps, 11.50 s, set apart" (None without one)."""
    if not basis or not basis.get("of"):
        return None
    parts = []
    for x in basis.get("set_apart") or []:
        n = int(x.get("n") or len(x.get("steps") or []))
        name = "outlier" if x["reason"] == "outlier" else f"{x['reason']} step"
        parts.append(f"{n:,} {name}{'s' if n != 1 else ''}, {fmt_s(x.get('seconds'))},")
    if not parts:
        return f"all {basis['of']:,} steps" + ("" if not basis.get("fallback") else f" ({basis['fallback']})")
    return f"{basis['steps']:,} of {basis['of']:,} steps; " + " and ".join(parts) + " set apart"


def steady_colour_range(z: np.ndarray, step_lo: np.ndarray, step_hi: np.ndarray,
                        set_apart: Sequence[int]) -> tuple[float, float] | None:
    """(min, max) of the heatmap's cells whose steps hold no set-apart step (compile, warm-up, ...: the
    summary's ``basis``), so those steps cannot swamp the colour scale; None when nothing is set apart
    or no other cell has a value."""
    if not len(set_apart) or not z.size:
        return None
    apart = np.sort(np.asarray(list(set_apart), dtype=np.int64))
    lo, hi = np.asarray(step_lo, dtype=np.int64), np.asarray(step_hi, dtype=np.int64)
    # a column [lo, hi] holds a set-apart step when the first one ≥ lo is ≤ hi
    i = np.searchsorted(apart, lo)
    holds = (i < apart.size) & (apart[np.minimum(i, apart.size - 1)] <= hi)
    if not holds.any() or holds.all():
        return None
    steady = z[:, ~holds]
    steady = steady[np.isfinite(steady)]
    return (float(steady.min()), float(steady.max())) if steady.size else None


@guarded
def heatmap_figure(hm: dict[str, Any] | None, set_apart: Sequence[int] = ()) -> Fig:
    """Ranks × steps heatmap; says how many steps and ranks each cell aggregates and how. The colour
    range is the steady steps' when ``set_apart`` steps (the summary's basis) would swamp it."""
    if not hm or hm["values"].size == 0:
        return empty_figure("No per-rank records yet: the heatmap fills in as steps are compacted.")
    z = np.asarray(hm["values"], dtype=np.float64)
    rng = steady_colour_range(z, np.asarray(hm["step_lo"]), np.asarray(hm["step_hi"]), set_apart)
    if rng is not None and np.nanmax(z) <= rng[1]:
        rng = None  # the set-apart steps are within the steady range: nothing to clip
    mult, unit = time_unit(z[~np.isnan(z)][:: max(1, z.size // 5000)].tolist() if rng is None else list(rng))
    rf, sf = hm["rank_factor"], hm["step_factor"]
    y = np.asarray(hm["rank_lo"])
    where = "step %{x}" + (f" (+{sf - 1})" if sf > 1 else "") + " · rank %{y}" + (f" (+{rf - 1})" if rf > 1 else "")
    trace = {"type": "heatmap", "z": _f(z, mult), "x": _arr(np.asarray(hm["step_lo"])), "y": _arr(y),
             "colorscale": "Viridis", "colorbar": {"title": {"text": unit, "side": "right"}, "thickness": 10, "ticklabeloverflow": "allow"},
             "hovertemplate": f"{where}<br>{plain(hm['how'], template=True) + ' ' if (rf > 1 or sf > 1) else ''}%{{z:.3g}} {unit}"
                              "<extra></extra>",
             "hoverongaps": False}
    if rng is not None:
        trace.update(zmin=rng[0] * mult, zmax=rng[1] * mult, zauto=False)
    if rf > 1 or sf > 1:
        note = (f"aggregated server-side: {hm['how']} of {sf} step{'s' if sf > 1 else ''} × {rf} rank{'s' if rf > 1 else ''} "
                f"per cell ({hm['n_ranks']:,} ranks × {hm['n_steps']:,} steps → {len(y)} × {z.shape[1]})")
    else:
        note = f"every rank and step ({hm['n_ranks']:,} × {hm['n_steps']:,})"
    if hm.get("sampled_every_steps", 1) > 1:
        note += f"; a sample: every {hm['sampled_every_steps']}th step of a run too large to hold whole"
    if rng is not None:
        note += "; colour range of the steady steps: set-apart (compile, warm-up …) steps above it are drawn at its top"
    lay = _layout(f"Per-rank {hm['label']}", height=max(260, min(520, 120 + 3 * len(y))), legend=False, note=note,
                  hovermode="closest", x=_axis(title="step", showgrid=False),
                  y=_axis(title="rank" + (f" (groups of {rf})" if rf > 1 else ""), autorange="reversed", showgrid=False))
    lay["margin"]["r"] = 96  # the colour bar
    return {"data": [trace], "layout": lay}


@guarded
def slowdown_figure(sd: dict[str, Any] | None, *, threshold: float = 1.05, top_nodes: int = 12) -> Fig:
    """Per-rank slowdown (work vs the step's median rank) and the slowest nodes."""
    if not sd or not np.asarray(sd["slowdown"]).size or np.all(np.isnan(sd["slowdown"])):
        return empty_figure("No per-rank work times yet (needs step_s and comm_exposed_s per rank).")
    slow = np.asarray(sd["slowdown"], dtype=float)
    ranks = np.asarray(sd["rank"])
    nodes = sd["nodes"][:top_nodes] if sd.get("known_hosts", True) else []
    split = 0.64 if nodes else 1.0
    # two traces (below / above the threshold) instead of per-point colour and text lists: typed arrays only,
    # so the payload and the browser's work stay flat in the number of ranks
    flag = slow > threshold
    size = 5 if ranks.size < 2000 else 3
    data: list[dict[str, Any]] = [
        {"type": "scatter", "x": _arr(ranks[sel]), "y": _f(slow[sel]), "mode": "markers", "name": name,
         "marker": {"size": size, "color": color}, "hovertemplate": "rank %{x}: %{y:.3f}×<extra>" + name + "</extra>"}
        for sel, name, color in ((~flag, "rank", "#0072B2"), (flag, "above threshold", "#D55E00")) if sel.any()]
    shapes = [{"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": threshold, "y1": threshold,
               "line": {"color": "#D55E00", "width": 1, "dash": "dash"}}]
    ann = [{"text": f"straggler threshold {threshold:.2f}×", "xref": "x domain", "x": 1, "xanchor": "right", "yref": "y",
            "y": threshold, "yanchor": "bottom", "showarrow": False, "font": {"size": 10, "color": "#D55E00"}},
           ]
    if nodes:
        ann.append({"text": "slowdown by rank", "xref": "paper", "x": split / 2, "xanchor": "center", "yref": "paper",
                    "y": 1.0, "yanchor": "bottom", "showarrow": False, "font": {"size": 11}})
    extra: dict[str, Any] = {}
    if nodes:
        nodes = nodes[::-1]
        data.append({"type": "bar", "x": [n["slowdown"] for n in nodes], "y": [plain(n["node"]) for n in nodes], "orientation": "h",
                     "name": "node", "xaxis": "x2", "yaxis": "y2",
                     "marker": {"color": ["#D55E00" if n["slowdown"] > threshold else "#56B4E9" for n in nodes]},
                     "hovertemplate": "%{y}: %{x:.3f}×<extra></extra>"})
        lo = min(0.95, min(n["slowdown"] for n in nodes) - 0.01)
        hi = max(threshold + 0.02, max(n["slowdown"] for n in nodes) + 0.02)
        extra["xaxis2"] = _axis(title="slowdown (×)", domain=[0.72, 1.0], anchor="y2", range=[lo, hi])
        extra["yaxis2"] = _axis(anchor="x2", type="category")
        ann.append({"text": "slowest nodes (median of their ranks)", "xref": "paper", "x": 0.86, "xanchor": "center",
                    "yref": "paper", "y": 1.0, "yanchor": "bottom", "showarrow": False, "font": {"size": 11}})
    lost = sd.get("time_lost_s")
    note = ("slowdown = median over steps of rank work ÷ median rank work (work = step − exposed comm)"
            + (f"; fleet time lost waiting for the slowest rank: {lost:,.1f} s" if lost is not None else "")
            + ("" if nodes else "; no host/node per rank recorded"))
    lay = _layout("Stragglers", height=320 if nodes else 300, legend=False, note=note, hovermode="closest",
                  x=_axis(title="rank", domain=[0.0, split]), y=_axis(title="slowdown (×)"), shapes=shapes, annotations=ann,
                  **extra)
    if nodes:
        lay["margin"]["t"] = 86  # room for the two panel titles under the subtitle
    return {"data": data, "layout": lay}


#: the rank drill-down's panels: (component, title, colour of the rank's line)
_DRILL = (("step_s", "step", "#009E73"), ("data_s", "data", COMPONENT_COLORS["data_s"]),
          ("compute_s", "compute", COMPONENT_COLORS["compute_s"]),
          ("comm_exposed_s", "exposed comm", COMPONENT_COLORS["comm_exposed_s"]),
          ("other_s", "other", "#6b7280"), ("straggler_wait_s", "straggler wait", COMPONENT_COLORS["straggler_wait_s"]))
_DRILL_COLS = ((0.0, 0.29), (0.355, 0.645), (0.71, 1.0))
_DRILL_ROWS = ((0.6, 1.0), (0.0, 0.4))


@guarded
def rank_drill_figure(view: dict[str, Any] | None) -> Fig:
    """One rank against the median rank, per step: a small chart per component (step, data, compute,
    exposed comm, other, straggler wait), the rank's line in the component's colour and the median
    rank's dotted; each chart in its own unit. ``view``: ``reports.rank_view.rank_steps``."""
    rows = (view or {}).get("steps") or []
    if not rows:
        return empty_figure("No steps of this rank yet: it appears once its steps are compacted.")
    rank = view["rank"] if view else "?"
    x = _arr(np.asarray([r["step"] for r in rows], dtype=np.int64))

    def col(k: str) -> np.ndarray:
        return np.asarray([np.nan if r.get(k) is None else r[k] for r in rows], dtype=np.float64)

    data: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    ann = []
    for i, (k, title, color) in enumerate(_DRILL):
        own, med = col(k), col(f"median_{k}")
        mult, unit = time_unit(np.concatenate([own, med])[:: max(1, 2 * len(rows) // 2000)].tolist())
        n = "" if i == 0 else str(i + 1)
        cx, ry = _DRILL_COLS[i % 3], _DRILL_ROWS[i // 3]
        for name, y, line, group in ((f"rank {rank}", own, {"color": color, "width": 1.4}, "rank"),
                                     ("median rank", med, {"color": "#1f2328", "width": 1, "dash": "dot"}, "median")):
            data.append({"type": "scatter", "x": x, "y": _f(y, mult), "name": plain(name), "mode": "lines", "line": line,
                         "legendgroup": group, "showlegend": i == 0, "xaxis": f"x{n}", "yaxis": f"y{n}",
                         "hovertemplate": f"{plain(title, template=True)}: %{{y:.3g}} {unit}<extra>{plain(name, template=True)}"
                                          "</extra>"})
        extra[f"xaxis{n}"] = _axis(domain=list(cx), anchor=f"y{n}", title="step" if i >= 3 else None,
                                   **({"matches": "x"} if i else {}))
        extra[f"yaxis{n}"] = _axis(domain=list(ry), anchor=f"x{n}", rangemode="tozero")
        ann.append({"text": f"{title} ({unit})", "xref": "paper", "x": cx[0], "xanchor": "left", "yref": "paper",
                    "y": ry[1], "yanchor": "bottom", "showarrow": False, "font": {"size": 11}})
    parts = []
    points = int((view or {}).get("points") or len(rows))
    if (view or {}).get("reduced"):
        parts.append(f"{len(rows):,} of {points:,} steps: per bucket of steps, those with each component's min and max")
    else:
        parts.append(f"every step read ({points:,})")
    k = int((view or {}).get("sampled_every_steps") or 1)
    if k > 1:
        parts.append(f"a sample: every {k}th step of a run too wide to read whole")
    parts.append("median rank = the step's cross-rank median of each component")
    lay = _layout(f"Rank {rank} against the median rank", height=440, note="; ".join(parts), hovermode="x unified",
                  annotations=ann, **extra)  # extra's xaxis / yaxis: the first panel's
    lay["margin"]["t"] = 90  # the subtitle and the panels' titles
    return {"data": data, "layout": lay}


@guarded
def collectives_figure(rows: Sequence[dict[str, Any]]) -> Fig:
    """Bus bandwidth (GB/s) against message size per collective op; marker area ∝ time spent."""
    pts = [r for r in rows if r.get("busbw_bytes_per_s") is not None and r.get("size_bucket_bytes", 0) > 1]
    if not pts:
        return empty_figure("No collectives with a message size recorded for this run.")
    tmax = max(r["total_s"] for r in pts) or 1.0
    data = []
    for i, op in enumerate(sorted({r["op"] for r in pts})):
        rs = sorted((r for r in pts if r["op"] == op), key=lambda r: r["size_bucket_bytes"])
        data.append({
            "type": "scatter", "x": [r["size_bucket_bytes"] for r in rs], "y": [r["busbw_bytes_per_s"] / 1e9 for r in rs],
            "name": plain(op), "mode": "lines+markers", "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)], "width": 1},
            "marker": {"size": [6 + 18 * (r["total_s"] / tmax) ** 0.5 for r in rs]},
            "text": [f"n={r['group_size']} · {r['calls']:,} calls · {r['total_s']:.2f} s total"
                     + (f" · {r['efficiency'] * 100:.0f} % of link peak" if r.get("efficiency") else "") for r in rs],
            "hovertemplate": "%{x:.3s}B: %{y:.3g} GB/s<br>%{text}<extra>" + plain(op, template=True) + "</extra>",
        })
    note = "busbw as NCCL-tests; size = ⌊log2 bytes per call⌋ bucket; marker area ∝ time spent"
    return {"data": data, "layout": _layout(
        "Collectives: bus bandwidth by message size", height=300, note=note, hovermode="closest",
        x=_axis(title="message size per call (bytes, log)", type="log"), y=_axis(title="busbw (GB/s)", rangemode="tozero"))}


@guarded
def memory_figure(series: dict[str, Any]) -> Fig:
    """Peak allocated and reserved device memory over steps (GB), allocator retries marked; for a CPU run
    (``series["mem_source"] == "rss"``) the process's peak resident set, labelled as such."""
    peak, res = series.get("mem_peak_bytes"), series.get("mem_reserved_bytes")
    rss = series.get("mem_source") == "rss"
    if peak is None:
        return empty_figure("No memory samples for this run: on CPU the agent records the process's RSS, on GPU "
                            "the CUDA caching allocator's counters (memory_every_steps=0 turns them off)."
                            if not rss else "No memory samples for this run (RSS of the CPU process: none reported).")
    title = "Memory: RSS (CPU process)" if rss else "Memory: CUDA caching allocator"
    name = "peak RSS (max over ranks)" if rss else "peak allocated (max over ranks)"
    note = ("per step: the high-water mark at its end (the step's own peak when it rose in the step, else an "
            "upper bound)" + (f" · {aggregation_note(peak.factor)}" if aggregation_note(peak.factor) else ""))
    data = [{"type": "scatter", "x": _arr(np.asarray(peak.x)), "y": _f(peak.y, 1e-9), "name": name,
             "mode": "lines", "line": {"color": "#0072B2", "width": 1.2}, "hovertemplate": "%{y:.2f} GB"}]
    if res is not None and len(res.x) and not rss:
        data.append({"type": "scatter", "x": _arr(np.asarray(res.x)), "y": _f(res.y, 1e-9), "name": "reserved (max over ranks)",
                     "mode": "lines", "line": {"color": "#9A9A9A", "width": 1.2, "dash": "dash"}, "hovertemplate": "%{y:.2f} GB"})
    retry = np.asarray(series.get("alloc_retry_steps", []))
    if retry.size:
        data.append({"type": "scatter", "x": _arr(retry), "y": _f(np.full(retry.size, float(np.nanmax(peak.y)) / 1e9)),
                     "mode": "markers", "name": "allocator retries", "marker": {"symbol": "x", "color": "#D55E00", "size": 8}})
    return {"data": data, "layout": _layout(title, height=260, note=note, x=_axis(title="step"),
                                            y=_axis(title="RSS (GB)" if rss else "memory (GB)", rangemode="tozero"))}


@guarded
def throughput_figure(series: dict[str, Any]) -> Fig:
    """MFU (%) and throughput (tokens/s) over steps on two axes."""
    mfu, tps = series.get("mfu"), series.get("tokens_per_s")
    if mfu is None and tps is None:
        return empty_figure("No tokens or FLOPs recorded, so no throughput or MFU.")
    data = []
    if tps is not None:
        data.append({"type": "scatter", "x": _arr(np.asarray(tps.x)), "y": _f(tps.y), "name": "tokens/s (job)", "mode": "lines",
                     "line": {"color": "#009E73", "width": 1.2}, "hovertemplate": "%{y:.4s} tokens/s"})
    if mfu is not None:
        data.append({"type": "scatter", "x": _arr(np.asarray(mfu.x)), "y": _f(mfu.y, 100.0), "name": "MFU", "mode": "lines",
                     "yaxis": "y2", "line": {"color": "#0072B2", "width": 1.2}, "hovertemplate": "%{y:.1f} %"})
    factor = max(getattr(mfu, "factor", 1), getattr(tps, "factor", 1))
    note = aggregation_note(factor) or ""
    if series.get("mfu_estimated"):
        note = (note + " · " if note else "") + "MFU estimated (FLOPs from the dense-transformer formula)"
    return {"data": data, "layout": _layout(
        "Throughput and MFU", height=260, note=note or None, x=_axis(title="step"),
        y=_axis(title="throughput (tokens/s)", rangemode="tozero"),
        yaxis2=_axis(title="MFU (%)", rangemode="tozero", overlaying="y", side="right", showgrid=False))}


@guarded
def modality_figure(mod: dict[str, Any] | None, packing: Any = None) -> Fig:
    """Tokens per modality per step (stacked) and packing efficiency (real ÷ padded tokens)."""
    if not mod and packing is None:
        return empty_figure("No per-modality token counts or padding recorded for this run.")
    data: list[dict[str, Any]] = []
    notes = []
    if mod:
        if mod.get("factor", 1) > 1:
            notes.append(f"tokens summed over {mod['factor']} steps per bar")
        x = _arr(np.asarray(mod["step"]))
        for i, (m, v) in enumerate(sorted(mod["tokens"].items())):
            data.append({"type": "bar", "x": x, "y": _f(v), "name": plain(m), "marker": {"color": SERIES_COLORS[(i + 2) % len(SERIES_COLORS)]},
                         "hovertemplate": "%{y:.4s} tokens"})
    if packing is not None:
        data.append({"type": "scatter", "x": _arr(np.asarray(packing.x)), "y": _f(packing.y, 100.0), "name": "packing efficiency",
                     "mode": "lines", "yaxis": "y2", "line": {"color": "#1f2328", "width": 1.2}, "hovertemplate": "%{y:.1f} %"})
        if packing.factor > 1:
            notes.append(f"packing: min/max of {packing.factor} steps per point")
    return {"data": data, "layout": _layout(
        "Tokens by modality and packing efficiency", height=260, note=" · ".join(notes) or None, barmode="stack", bargap=0.05,
        x=_axis(title="step"), y=_axis(title="tokens", rangemode="tozero"),
        yaxis2=_axis(title="packing efficiency (%)", range=[0, 100], overlaying="y", side="right", showgrid=False))}


def _log2_axis(sizes: Sequence[int], **kw: Any) -> dict[str, Any]:
    ticks = sorted(set(sizes))
    return _axis(type="log", tickvals=ticks, ticktext=[f"{n:,}" for n in ticks], **kw)


@guarded
def scaling_throughput_figure(data: dict[str, Any]) -> Fig:
    """Throughput against world size per configuration, with the ideal (linear) line."""
    cfgs = data.get("configs") or []
    if not cfgs:
        return empty_figure(f"No runs with throughput for family {data.get('family')!r}.")
    traces: list[dict[str, Any]] = []
    sizes: list[int] = []
    for i, g in enumerate(cfgs):
        c = SERIES_COLORS[i % len(SERIES_COLORS)]
        pts = g["points"]
        xs = [p["world_size"] for p in pts]
        sizes += xs
        traces.append({"type": "scatter", "x": xs, "y": [p["tokens_per_s"] for p in pts], "name": plain(f"measured · {g['config']}"),
                       "mode": "lines+markers", "line": {"color": c}, "legendgroup": str(i),
                       "hovertemplate": "n=%{x}: %{y:.4s} tokens/s<extra></extra>"})
        traces.append({"type": "scatter", "x": xs, "y": [p["ideal_tokens_per_s"] for p in pts], "name": "ideal (linear)",
                       "mode": "lines", "line": {"color": c, "dash": "dot", "width": 1}, "legendgroup": str(i),
                       "showlegend": i == 0, "hovertemplate": "ideal: %{y:.4s} tokens/s<extra></extra>"})
    return {"data": traces, "layout": _layout(
        "Throughput vs world size", height=320, note="median over runs per world size; ideal = smallest size × n/n₀",
        hovermode="closest", x=_log2_axis(sizes, title="world size (GPUs, log)"),
        y=_axis(title="throughput (tokens/s, log)", type="log"))}


@guarded
def scaling_efficiency_figure(data: dict[str, Any]) -> Fig:
    """Scaling efficiency (%) against world size per configuration."""
    cfgs = data.get("configs") or []
    if not cfgs:
        return empty_figure("No scaling data.")
    traces = []
    sizes: list[int] = []
    for i, g in enumerate(cfgs):
        pts = g["points"]
        xs = [p["world_size"] for p in pts]
        sizes += xs
        traces.append({"type": "scatter", "x": xs, "y": [p["efficiency"] * 100 if p.get("efficiency") is not None else None for p in pts],
                       "mode": "lines+markers", "name": plain(f"{g['mode']} · {g['config']}"),
                       "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)]}, "hovertemplate": "n=%{x}: %{y:.1f} %<extra></extra>"})
    return {"data": traces, "layout": _layout(
        "Scaling efficiency", height=320, note="weak: (tok/s ÷ n) ÷ (tok/s ÷ n)₀ · strong: (step₀·n₀) ÷ (step·n)",
        hovermode="closest", x=_log2_axis(sizes, title="world size (GPUs, log)"),
        y=_axis(title="efficiency (%)", rangemode="tozero"), shapes=[_hline(100, "#9A9A9A", dash="dot")])}


@guarded
def scaling_decomposition_figure(group: dict[str, Any] | None) -> Fig:
    """Step-time components per world size for one configuration: which one grows with scale."""
    if not group:
        return empty_figure("No scaling data.")
    pts = group["points"]
    xs = [f"{p['world_size']:,}" for p in pts]
    mult, unit = time_unit([p.get("step_s") for p in pts])
    keys = _COMPONENTS + (("straggler_wait_s",) if any(p.get("straggler_wait_s") for p in pts) else ())
    data = [{"type": "bar", "x": xs, "y": [(p.get(k) or 0) * mult for p in pts], "name": COMPONENT_LABELS[k],
             "marker": {"color": COMPONENT_COLORS[k]}, "hovertemplate": f"%{{y:.3g}} {unit}"} for k in keys]
    return {"data": data, "layout": _layout(
        f"Where the step time goes · {group['config']}", height=320, barmode="stack",
        note=group.get("growth") or "median rank, median step, per world size",
        x=_axis(title="world size (GPUs)", type="category"), y=_axis(title=f"time per step ({unit})"))}


@guarded
def compare_series_figure(series: dict[int, Any], names: dict[int, str]) -> Fig:
    """Step time of several runs overlaid, aligned by step."""
    if not series:
        return empty_figure("Pick two or more runs to compare.")
    allv = np.concatenate([np.asarray(s.y, dtype=float) for s in series.values()])
    mult, unit = time_unit(allv[~np.isnan(allv)][:: max(1, allv.size // 2000)].tolist())
    data = []
    factor = 1
    for i, (rid, s) in enumerate(series.items()):
        factor = max(factor, s.factor)
        data.append({"type": "scatter", "x": _arr(np.asarray(s.x)), "y": _f(s.y, mult), "name": plain(names.get(rid, rid)),
                     "mode": "lines", "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)], "width": 1.2},
                     "hovertemplate": f"%{{y:.3g}} {unit}"})
    return {"data": data, "layout": _layout("Step time (median rank)", height=300, note=aggregation_note(factor),
                                            x=_axis(title="step"), y=_axis(title=f"step time ({unit})", rangemode="tozero"))}


@guarded
def compare_decomposition_figure(metrics: dict[int, dict[str, Any]], names: dict[int, str]) -> Fig:
    """One stacked bar per run: the components of its median step."""
    if not metrics:
        return empty_figure("Pick two or more runs to compare.")
    ids = list(metrics)
    mult, unit = time_unit([metrics[i].get("step_s") for i in ids])
    # one bar per run: category values are the (escaped) names, made unique where two runs share a name
    raw = [str(names.get(i, i)) for i in ids]
    ys = [plain(n if raw.count(n) == 1 else f"{n} · {i}") for n, i in zip(raw, ids, strict=True)]
    data = [{"type": "bar", "y": ys, "x": [(metrics[i].get(k) or 0) * mult for i in ids], "name": COMPONENT_LABELS[k],
             "orientation": "h", "marker": {"color": COMPONENT_COLORS[k]}, "hovertemplate": f"%{{x:.3g}} {unit}"}
            for k in _COMPONENTS]
    return {"data": data, "layout": _layout("Where the step time goes", height=max(200, 80 + 36 * len(ids)), barmode="stack",
                                            hovermode="y unified", x=_axis(title=f"median step ({unit})"),
                                            y=_axis(autorange="reversed"))}


def _iso(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v


@guarded
def alert_series_figure(ser: dict[str, Any] | None, alert: dict[str, Any]) -> Fig:
    """The alert's series with the change point marked and the before/after levels."""
    if not ser or not ser.get("y"):
        return empty_figure("The series behind this alert is not available.")
    y = np.asarray([np.nan if v is None else v for v in ser["y"]], dtype=float)
    x = list(ser["x"])
    timed = ser.get("xlabel") in ("run start", "time")
    if timed:
        x = [_iso(to_utc(v)) for v in x]
    metric = ser.get("metric") or alert.get("metric") or "value"
    unit = ser.get("unit") or ""
    mult = 1.0
    if unit == "s" or (not unit and metric.endswith("_s") and not metric.startswith("tokens")):
        mult, unit = time_unit(y.tolist())
    elif metric == "mfu":
        mult, unit = 100.0, "%"
    suffix = f" {unit}" if unit else ""
    labels = ser.get("labels")
    data: list[dict[str, Any]] = [{
        "type": "scatter", "x": x, "y": _f(y, mult), "mode": "lines+markers", "name": plain(metric), "marker": {"size": 5},
        "line": {"color": "#0072B2", "width": 1.2}, "text": [plain(v) for v in labels] if labels else labels,
        "hovertemplate": "%{y:.4g}" + plain(suffix, template=True) + ("<br>%{text}" if labels else "") + "<extra></extra>"}]
    ci = ser.get("change_index")
    cx = ser.get("change_x")
    if cx is None and ci is not None and 0 <= ci < len(x):
        cx = x[ci]
    shapes, ann = [], []
    if cx is not None:
        shapes.append({"type": "line", "xref": "x", "x0": cx, "x1": cx, "yref": "y domain", "y0": 0, "y1": 1,
                       "line": {"color": "#D55E00", "width": 1.5, "dash": "dash"}})
        ann.append({"x": cx, "y": 1, "yref": "y domain", "text": "change point", "showarrow": False, "yanchor": "bottom",
                    "font": {"color": "#D55E00", "size": 11}})
    before, after = alert.get("before"), alert.get("after")
    if ci is not None and before is not None and after is not None and 0 < ci < len(x):
        data.append({"type": "scatter", "x": [x[0], x[ci - 1]], "y": [before * mult] * 2, "mode": "lines", "name": "before",
                     "line": {"color": "#009E73", "width": 2}})
        data.append({"type": "scatter", "x": [x[ci], x[-1]], "y": [after * mult] * 2, "mode": "lines", "name": "after",
                     "line": {"color": "#D55E00", "width": 2}})
    xt = ser.get("xlabel", "index") + (" (UTC)" if timed else "")
    return {"data": data, "layout": _layout(
        metric, height=300, note=aggregation_note(ser.get("factor", 1)) or f"series: {ser.get('source', '')}",
        hovermode="closest", x=_axis(title=xt, **({"type": "date"} if timed else {})),
        y=_axis(title=unit or metric), shapes=shapes, annotations=ann)}


def _params_label(params: dict[str, Any] | None) -> str:
    from .theme import fmt_bytes

    items = []
    for k, v in sorted((params or {}).items()):
        items.append(f"{k}={fmt_bytes(v)}" if k == "bytes" and isinstance(v, (int, float)) else f"{k}={v}")
    return ", ".join(items) or "default"


@guarded
def benchmark_figure(series: Sequence[dict[str, Any]], name: str) -> Fig:
    """One microbenchmark over time: a line per (cluster, parameters)."""
    ss = [s for s in series if s["name"] == name and s["value"]]
    if not ss:
        return empty_figure(f"No points for {name}.")
    unit = ss[0].get("unit") or ""
    data = [{"type": "scatter", "x": [_iso(to_utc(t)) for t in s["ts"]], "y": list(s["value"]), "mode": "lines+markers",
             "name": plain(f"{s['cluster']} · {_params_label(s.get('params'))}"), "marker": {"size": 4},
             "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)], "width": 1.2},
             "text": [plain(c or "") for c in s["git_commit"]],
             "hovertemplate": "%{y:.4g} " + plain(unit, template=True) + "<br>%{text}<extra></extra>"} for i, s in enumerate(ss)]
    return {"data": data, "layout": _layout(name, height=280, hovermode="closest", x=_axis(title="time (UTC)", type="date"),
                                            y=_axis(title=unit))}


@guarded
def busbw_by_size_figure(series: Sequence[dict[str, Any]]) -> Fig:
    """Latest collective busbw against message size, a line per (benchmark, cluster)."""
    pts: dict[tuple[str, str], list[tuple[float, float]]] = {}
    unit = ""
    for s in series:
        size = (s.get("params") or {}).get("bytes")
        if not isinstance(size, (int, float)) or isinstance(size, bool) or not s["value"]:
            continue  # no (numeric) message size: not a point on this chart
        unit = s.get("unit") or unit
        pts.setdefault((s["name"], s["cluster"]), []).append((float(size), float(s["value"][-1])))
    if not pts:
        return empty_figure("No collective benchmarks with a message size yet.")
    scale, yunit = (1e-9, "GB/s") if unit in ("B/s", "bytes/s") else (1.0, unit)
    data = []
    for i, ((name, cluster), v) in enumerate(sorted(pts.items())):
        v.sort()
        data.append({"type": "scatter", "x": [a for a, _ in v], "y": [b * scale for _, b in v], "mode": "lines+markers",
                     "name": plain(f"{name} · {cluster}"), "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)]},
                     "hovertemplate": "%{x:.3s}B: %{y:.4g} " + plain(yunit, template=True) + "<extra></extra>"})
    return {"data": data, "layout": _layout("Collective busbw by message size (latest)", height=300, hovermode="closest",
                                            x=_axis(title="message size (bytes, log)", type="log"),
                                            y=_axis(title=f"busbw ({yunit})"))}


#: a parallel dimension keeps its colour on every page (run, compare, scaling); other names by order
_DIM_COLORS = {"dp": "#0072B2", "dp_shard": "#0072B2", "dp_replicate": "#56B4E9", "tp": "#D55E00", "pp": "#009E73",
               "cp": "#CC79A7", "ep": "#E69F00", "sp": "#8c564b", "world": "#000000", "unknown": "#9A9A9A"}
_DIM_SPARE = ("#F0E442", "#7f7f7f", "#56B4E9", "#CC79A7", "#E69F00", "#8c564b")


def dim_color(dim: str, order: Sequence[str] = ()) -> str:
    """The colour of a parallel dimension (DeviceMesh name): fixed for the usual names, else by its
    place in ``order``."""
    if dim in _DIM_COLORS:
        return _DIM_COLORS[dim]
    others = [d for d in order if d not in _DIM_COLORS]
    i = others.index(dim) if dim in others else len(others)
    return _DIM_SPARE[i % len(_DIM_SPARE)]


@guarded
def comm_dims_figure(series: dict[str, Any] | None, order: Sequence[str] = (), *, note: str | None = None) -> Fig:
    """Exposed communication per parallel dimension over steps (``reports.comm_dim_series``), a line
    per dimension; ``order``: dimensions first in this order (the summary's, most exposed first)."""
    dims = (series or {}).get("dims") or {}
    steps = (series or {}).get("steps") or []
    used = [d for d in dims if any(v for v in dims[d].get("exposed_s") or [])]
    names = [d for d in order if d in used] + sorted(d for d in used if d not in order)
    if not steps or not names:
        return empty_figure("No exposed communication recorded by dimension for this run.")
    mult, unit = time_unit([v for d in names for v in dims[d]["exposed_s"][:: max(1, len(steps) // 500)] if v])
    x = _arr(np.asarray(steps))
    data = [{"type": "scatter", "x": x, "y": _f(dims[d]["exposed_s"], mult), "name": plain(d), "mode": "lines",
             "line": {"color": dim_color(d, names), "width": 1.2}, "hovertemplate": f"%{{y:.3g}} {unit}"} for d in names]
    return {"data": data, "layout": _layout(
        "Exposed communication by dimension", height=260,
        note=note or "per step: cross-rank median of each rank's exposed comm in the dimension",
        x=_axis(title="step"), y=_axis(title=f"exposed comm per step ({unit})", rangemode="tozero"))}


@guarded
def pipeline_stages_figure(pipeline: dict[str, Any] | None) -> Fig:
    """Per pipeline stage: busy time (step − exposed comm) and bubble (send/recv wait) side by side."""
    per = (pipeline or {}).get("per_stage") or []
    if not per:
        return empty_figure("No per-stage figures: no rank reported its stage with step records.")
    mult, unit = time_unit([p.get("busy_s") for p in per] + [p.get("bubble_s") for p in per])
    xs = [f"stage {p['stage']}" for p in per]
    slow = (pipeline or {}).get("slowest_stage")
    data = [{"type": "bar", "x": xs, "y": [(p.get(k) or 0) * mult for p in per], "name": label, "marker": {"color": color},
             "hovertemplate": f"%{{y:.3g}} {unit}"}
            for k, label, color in (("busy_s", "busy (step − exposed comm)", COMPONENT_COLORS["compute_s"]),
                                    ("bubble_s", "bubble (send/recv wait)", COMPONENT_COLORS["comm_exposed_s"]))]
    ann = ([{"text": "slowest", "x": f"stage {slow}", "y": 1, "yref": "y domain", "showarrow": False, "yanchor": "bottom",
             "font": {"size": 10, "color": _MUTED}}] if slow is not None and len(per) > 1 else [])
    return {"data": data, "layout": _layout(
        "Pipeline stages: busy time and bubble", height=260, barmode="group",
        note="median of each stage's ranks over recent steps", x=_axis(title="pipeline stage", type="category"),
        y=_axis(title=f"time per step ({unit})", rangemode="tozero"), annotations=ann)}


@guarded
def compare_comm_dims_figure(by_run: dict[int, dict[str, dict[str, float]]], names: dict[int, str]) -> Fig:
    """Exposed communication per dimension, one bar per run in each dimension group (per step)."""
    if not by_run:
        return empty_figure("Pick two or more runs to compare.")
    dims: list[str] = []
    for by in by_run.values():
        dims += [d for d in by if d not in dims]
    if not dims:
        return empty_figure("No collectives recorded for these runs.")
    mult, unit = time_unit([v.get("exposed_s") for by in by_run.values() for v in by.values()])
    # a run with collectives but none in a dimension: 0 there; a run without collectives: no bars
    data = [{"type": "bar", "x": [plain(d) for d in dims],
             "y": [((by.get(d) or {}).get("exposed_s") or 0) * mult if by else None for d in dims],
             "name": plain(names.get(rid, rid)), "marker": {"color": SERIES_COLORS[i % len(SERIES_COLORS)]},
             "hovertemplate": f"%{{x}}: %{{y:.3g}} {unit}"}
            for i, (rid, by) in enumerate(by_run.items())]
    return {"data": data, "layout": _layout(
        "Exposed communication by dimension", height=260, barmode="group", hovermode="x unified",
        note="per step: median over steps of the cross-rank median", x=_axis(title="parallel dimension", type="category"),
        y=_axis(title=f"exposed comm per step ({unit})", rangemode="tozero"))}


_DASHES = ("solid", "dash", "dot", "dashdot")


@guarded
def scaling_comm_dims_figure(data: dict[str, Any]) -> Fig:
    """Exposed communication per dimension against world size: a line per dimension (colour), per
    configuration (dash)."""
    cfgs = data.get("configs") or []
    series: list[tuple[int, str, list[int], list[float | None]]] = []
    for ci, g in enumerate(cfgs):
        pts = g["points"]
        dims: list[str] = []
        for p in pts:
            dims += [d for d in (p.get("comm_by_dim") or {}) if d not in dims]
        for d in dims:
            ys = [((p.get("comm_by_dim") or {}).get(d) or {}).get("exposed_s") for p in pts]
            series.append((ci, d, [p["world_size"] for p in pts], ys))
    if not series:
        return empty_figure("No collectives recorded by dimension for these runs.")
    mult, unit = time_unit([y for *_, ys in series for y in ys])
    order = list(dict.fromkeys(d for _, d, _, _ in series))
    traces = []
    for ci, d, xs, ys in series:
        label = cfgs[ci]["config"]
        name = d if len(cfgs) == 1 else f"{d} · {label if len(label) <= 32 else label[:31] + '…'}"
        traces.append({"type": "scatter", "x": xs, "y": [None if y is None else y * mult for y in ys], "name": plain(name),
                       "mode": "lines+markers", "line": {"color": dim_color(d, order), "dash": _DASHES[ci % len(_DASHES)]},
                       "text": [plain(cfgs[ci]["config"])] * len(xs),
                       "hovertemplate": f"n=%{{x}}: %{{y:.3g}} {unit}<br>%{{text}}<extra>{plain(d, template=True)}</extra>"})
    sizes = [x for _, _, xs, _ in series for x in xs]
    return {"data": traces, "layout": _layout(
        "Exposed communication by dimension vs world size", height=300, hovermode="closest",
        note="per step, median over the runs at each size" + ("; line style = configuration" if len(cfgs) > 1 else ""),
        x=_log2_axis(sizes, title="world size (GPUs, log)"), y=_axis(title=f"exposed comm per step ({unit})",
                                                                    rangemode="tozero"))}


@guarded
def overlap_figure(view: dict[str, Any] | None) -> Fig:
    """One rank-step's collectives against backward (``reports.run_overlap``): backward as a band, each
    collective a bar from its issue to its completion (gradient reductions in blue), the part the step
    waited for (exposed) on top in the exposed-comm colour; time from the step's start."""
    v = view or {}
    colls = v.get("collectives") or []
    bwd = v.get("backward")
    if not colls:
        return empty_figure("No collectives recorded for this step.")
    ends = [c["end_s"] for c in colls] + [v.get("step_s") or 0.0]
    mult, unit = time_unit([max(ends) - min(0.0, *(c["start_s"] for c in colls))])
    labels = [plain(f"{i + 1} · {c['op'].replace('_', '-')} · {c['dim']} · {fmt_bytes(c['bytes'])}"
                    + (f" ×{c['calls']}" if c.get("calls", 1) > 1 else "")) for i, c in enumerate(colls)]
    start = np.array([c["start_s"] for c in colls])
    end = np.array([c["end_s"] for c in colls])
    exp = np.array([c["exposed_s"] for c in colls])
    text = [plain(f"{c['phase'].replace('_', ' ')}{' · gradient reduction' if c.get('gradient') else ''}") for c in colls]
    data = [
        {"type": "bar", "orientation": "h", "y": labels, "base": _f(start, mult), "x": _f(end - start, mult),
         "name": "collective (issue → completion)", "text": text, "textposition": "none",
         "marker": {"color": ["#56B4E9" if c.get("gradient") else "#B8BEC6" for c in colls]},
         "hovertemplate": f"%{{base:.3g}} → +%{{x:.3g}} {unit}<br>%{{text}}<extra>%{{y}}</extra>"},
        {"type": "bar", "orientation": "h", "y": labels, "base": _f(end - exp, mult), "x": _f(exp, mult),
         "name": "exposed (the step waited)", "marker": {"color": COMPONENT_COLORS["comm_exposed_s"]},
         "hovertemplate": f"exposed %{{x:.3g}} {unit}<extra>%{{y}}</extra>"},
    ]
    shapes: list[dict[str, Any]] = []
    ann: list[dict[str, Any]] = []
    if bwd:
        shapes.append({"type": "rect", "xref": "x", "x0": bwd["start_s"] * mult, "x1": bwd["end_s"] * mult,
                       "yref": "y domain", "y0": 0, "y1": 1, "layer": "below", "line": {"width": 0},
                       "fillcolor": COMPONENT_COLORS["compute_s"], "opacity": 0.12, "name": "backward",
                       "showlegend": True})
        ann.append({"text": "backward", "x": (bwd["start_s"] + bwd["end_s"]) / 2 * mult, "xref": "x", "y": 1,
                    "yref": "y domain", "yanchor": "bottom", "showarrow": False, "font": {"size": 10, "color": _MUTED}})
    if v.get("step_s"):
        shapes.append({"type": "line", "xref": "x", "x0": v["step_s"] * mult, "x1": v["step_s"] * mult,
                       "yref": "y domain", "y0": 0, "y1": 1, "line": {"color": _MUTED, "width": 1, "dash": "dot"}})
        ann.append({"text": "step end", "x": v["step_s"] * mult, "xref": "x", "y": 1, "yref": "y domain",
                    "yanchor": "bottom", "showarrow": False, "font": {"size": 10, "color": _MUTED}})
    tail = v.get("tail_s")
    note = ("backward's start estimated; its end = the last gradient reduction's issue"
            if bwd and bwd.get("end") != "estimated" else "backward estimated from the phase times" if bwd else
            "no backward measured in this step")
    if tail is not None:
        note += f"; {tail * mult:.3g} {unit} waited for after backward"
    lay = _layout(f"Step {v.get('step')}, rank {v.get('rank')}: communication against backward",
                  height=max(220, 90 + 22 * len(colls)), note=note, hovermode="closest", barmode="overlay",
                  x=_axis(title=f"time from the step's start ({unit})"),
                  y=_axis(type="category", autorange="reversed", automargin=True), shapes=shapes, annotations=ann)
    lay["margin"]["l"] = min(320, 20 + 5 * max(len(x) for x in labels))  # about the labels' width: drawn once
    return {"data": data, "layout": lay}
