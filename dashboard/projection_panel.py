"""Projections on the dashboard: the run page's "what if" panel (world size, tp, pp, micro-batches → the
projected step, MFU, tokens/s and parts, with the error band and what the projection rests on; the inputs
live in the page's query string: ``?ws=64&tp=2&pp=1&mb=8``) and the scaling page's projected curves and
track record (pure figure / table builders). Reads only through ``reports`` (run_projection,
scaling_projections, track_record)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dash import Input, Output, State, dcc, html
from fleetscope.server import reports

from . import _state
from .components import callback, kpi, kpi_strip, section, simple_table
from .theme import fmt_num, fmt_pct, fmt_s

__all__ = ["WS", "TP", "PP", "MB", "OUT", "URL_KEYS", "what_if_section", "url_inputs", "what_if_body",
           "add_projected_traces", "track_record_table"]

WS = "run-whatif-ws"
TP = "run-whatif-tp"
PP = "run-whatif-pp"
MB = "run-whatif-mb"
OUT = "run-whatif-out"
RUN = "run-whatif-run"
#: query-string key of each input (the run page's URL sync writes them)
URL_KEYS = (("ws", WS), ("tp", TP), ("pp", PP), ("mb", MB))
_PARTS = (("data", "data"), ("compute", "compute"), ("comm_exposed", "exposed comm"), ("bubble", "pipeline bubble"),
          ("other", "other"), ("straggler_wait", "straggler wait"))


def _pos_int(v: Any) -> int | None:
    try:
        i = int(str(v))
    except (TypeError, ValueError):
        return None
    return i if 1 <= i <= 1 << 20 else None


def url_inputs() -> list[Input]:
    """The panel's inputs, for the page's one URL-sync callback (``ws``, ``tp``, ``pp``, ``mb``)."""
    return [Input(cid, "value") for _, cid in URL_KEYS]


def what_if_section(run_id: int | None, run: Mapping[str, Any], query: Mapping[str, Any]) -> html.Section:
    """The "what if" panel: number inputs seeded from the query string (empty: not asked yet)."""
    vals = {cid: _pos_int(query.get(key)) for key, cid in URL_KEYS}

    def field(label: str, cid: str, placeholder: str) -> html.Label:
        return html.Label([html.Span(label, className="fs-muted"), " ",
                           dcc.Input(id=cid, type="number", min=1, step=1, value=vals[cid], placeholder=placeholder,
                                     debounce=True, className="fs-input", style={"width": "7em"})],
                          className="fs-inline")

    return section("What if · projected from this run's measurements", [
        dcc.Store(id=RUN, data=run_id),
        html.Div([field("world size", WS, f"{int(run.get('world_size') or 1):,}"), field("tp", TP, "as run"),
                  field("pp", PP, "as run"), field("micro-batches", MB, "as run")], className="fs-inline"),
        html.Div(id=OUT),
    ], sid="run-whatif")


def _fmt_band(band: Any, fmt: Any) -> str | None:
    if not isinstance(band, list) or len(band) != 2:
        return None
    return f"{fmt(band[0])} – {fmt(band[1])}"


def what_if_body(out: dict[str, Any] | None, error: str | None = None) -> Any:
    """The panel's answer: figures with their band, the parts measured → projected, the basis."""
    if error:
        return html.P(error, className="fs-error", id=f"{OUT}-error")
    if out is None:
        return html.P("Enter a world size (and tp / pp / micro-batches) to project this run's step there.",
                      className="fs-muted")
    if out.get("status") != "ok":
        return html.Div([html.P("Not enough data to project:", className="fs-muted"),
                         html.Ul([html.Li(m) for m in out.get("missing") or []], className="fs-list")],
                        id=f"{OUT}-missing")
    band = out.get("error_band") or {}
    t = out.get("target") or {}
    basis = out.get("basis") or {}
    measured = basis.get("measured_parts") or {}
    rows = [[label, fmt_s(measured.get(k)), fmt_s((out.get("parts") or {}).get(k))] for k, label in _PARTS
            if measured.get(k) or (out.get("parts") or {}).get(k)]
    layout = f"{t.get('world_size', 0):,} GPUs = dp {t.get('dp')} × tp {t.get('tp')} × pp {t.get('pp')}" + (
        f", {t['micro_batches']} micro-batches" if t.get("micro_batches") else "")
    src = ", ".join(basis.get("sources") or []) or "the run's own measurements"
    return html.Div([
        kpi_strip([
            kpi("projected step (estimated)", fmt_s(out.get("step_s")), _fmt_band(band.get("step_s"), fmt_s),
                kid=f"{OUT}-step"),
            kpi("MFU (estimated)", fmt_pct(out.get("mfu")), _fmt_band(band.get("mfu"), fmt_pct)),
            kpi("tokens/s (estimated)", fmt_num(out.get("tokens_per_s")), _fmt_band(band.get("tokens_per_s"), fmt_num)),
        ]),
        html.P(layout, className="fs-muted", id=f"{OUT}-layout"),
        simple_table(["part", "measured", "projected"], rows, numeric=(1, 2), tid=f"{OUT}-parts"),
        html.Div(f"Error band ±{100 * (band.get('relative') or 0):.0f} % (spread of the measurements used"
                 + (f", this family's track record {100 * band['from']['track_record']:.0f} %"
                    if (band.get("from") or {}).get("track_record") is not None else "") + f"). Bus bandwidth: "
                 f"{basis.get('sizes')}; from {src}. Compute: the run's achieved FLOP/s on the new per-rank work; "
                 "data, other and straggler wait as measured.", className="fs-footnote"),
    ])


@callback(Output(OUT, "children"), *url_inputs(), State(RUN, "data"))
def _project(ws: Any, tp: Any, pp: Any, mb: Any, run_id: Any) -> Any:
    w = _pos_int(ws)
    if w is None or run_id is None:
        return what_if_body(None)
    try:
        out = reports.run_projection(_state.engine(), int(run_id), world_size=w, tp=_pos_int(tp), pp=_pos_int(pp),
                                     micro_batches=_pos_int(mb))
    except ValueError as e:
        return what_if_body(None, str(e))
    return what_if_body(out)


def add_projected_traces(fig: dict[str, Any], proj: dict[str, Any], labels: list[str], colors: list[str]) -> dict[str, Any]:
    """The throughput figure with, per configuration shown, the projected throughput from its smallest run
    (dashed) and its error band (shaded); ``labels``: the configurations in the figure's order."""
    by_label = {c["config"]: c for c in proj.get("configs") or []}
    extra: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        c = by_label.get(label)
        pts = [p for p in (c or {}).get("points") or [] if p.get("status") == "ok" and p.get("tokens_per_s")]
        if c is None or not pts:
            continue
        color = colors[i % len(colors)]
        xs = [c["from_world_size"], *[p["world_size"] for p in pts]]
        first = next((t for t in fig.get("data") or [] if t.get("legendgroup") == str(i)), None)
        y0 = None
        if first is not None and first.get("x"):
            y0 = dict(zip(first["x"], first["y"], strict=False)).get(c["from_world_size"])
        ys = [y0, *[p["tokens_per_s"] for p in pts]]
        lo = [y0, *[p["tokens_per_s_band"][0] for p in pts]]
        hi = [y0, *[p["tokens_per_s_band"][1] for p in pts]]
        extra.append({"type": "scatter", "x": xs, "y": hi, "mode": "lines", "line": {"width": 0, "color": color},
                      "hoverinfo": "skip", "showlegend": False, "legendgroup": str(i)})
        extra.append({"type": "scatter", "x": xs, "y": lo, "mode": "lines", "line": {"width": 0, "color": color},
                      "fill": "tonexty", "fillcolor": "rgba(128,128,128,0.15)", "hoverinfo": "skip",
                      "showlegend": False, "legendgroup": str(i), "name": "error band"})
        extra.append({"type": "scatter", "x": xs, "y": ys, "mode": "lines+markers", "legendgroup": str(i),
                      "name": f"projected from {c['from_world_size']:,} GPUs (estimated)",
                      "line": {"color": color, "dash": "dash", "width": 1.5}, "marker": {"symbol": "circle-open"},
                      "hovertemplate": "projected n=%{x}: %{y:.4s} tokens/s<extra></extra>"})
    if extra:
        fig = {**fig, "data": [*(fig.get("data") or []), *extra]}
    return fig


def track_record_table(rec: dict[str, Any]) -> Any:
    """The family's projections against the runs that followed, and the scaling back-test."""
    rows = [[f"{c['from_world_size']:,} → {c['world_size']:,}", str(c["from_run"]), str(c["measured_run"]),
             fmt_s(c["projected_step_s"]), fmt_s(c["measured_step_s"]), f"{100 * c['error']:+.1f} %",
             "yes" if c.get("blind") else "no"] for c in rec.get("checked") or []]
    rows += [[f"{b['from_world_size']:,} → {b['world_size']:,}", str(b["from_run"]),
              ",".join(str(r) for r in b["measured_runs"][:3]), fmt_s(b["projected_step_s"]), fmt_s(b["measured_step_s"]),
              f"{100 * b['error']:+.1f} %", "back-test"] for b in rec.get("backtest") or []]
    s, bs = rec.get("summary") or {}, rec.get("backtest_summary") or {}

    def line(name: str, d: dict[str, Any]) -> str:
        if not d.get("n"):
            return f"{name}: none yet"
        return (f"{name}: {d['n']} checked, median |error| {100 * d['median_abs_error']:.1f} %, "
                f"worst {100 * d['worst_abs_error']:.1f} %")

    return html.Div([
        html.P(f"{line('Recorded projections', s)} · {line('Back-test', bs)} · {len(rec.get('pending') or [])} "
               "recorded projection(s) not yet checked.", className="fs-muted", id="scaling-track-summary"),
        simple_table(["sizes", "from run", "measured run(s)", "projected step", "measured step", "error", "blind"],
                     rows, numeric=(3, 4, 5), tid="scaling-track-record") if rows else None,
    ])
