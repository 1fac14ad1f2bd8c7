"""Scaling (``/scaling?family=F``): throughput and scaling efficiency against world size per
configuration, the ideal line, which step-time component grows with scale, and exposed communication
per parallel dimension (dp, tp, pp, ...) against world size."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, clientside_callback, dcc, html
from fleetscope.server import reports

from .. import _state, projection_panel
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
from ..theme import SERIES_COLORS, fmt_num, fmt_pct, fmt_s

dash.register_page(__name__, path="/scaling", name="Scaling", title="fleetscope · scaling", order=2)

FAMILY = "scaling-family"
URL = "scaling-url"
THROUGHPUT = "scaling-throughput"
EFFICIENCY = "scaling-efficiency"
DECOMP = "scaling-decomposition"
COMM_DIMS = "scaling-comm-dims"
TABLE = "scaling-table"
EMPTY = "scaling-empty"
HAND = "scaling-hand"
APART = "scaling-apart"
TRACK = "scaling-track"
MAX_CONFIGS = 4


def _ids(text: str | None) -> list[int]:
    """Run ids from a URL parameter: ``exclude=12,15``."""
    return [int(x) for x in (text or "").split(",") if x.strip().isdigit()][:200]


def layout(family: str | None = None, exclude: str | None = None, include: str | None = None, **_: Any) -> html.Div:
    try:
        fams = reports.families(_state.engine())
    except _state.NotReady as e:
        return empty_state("Starting up", str(e))
    if not fams:
        return html.Div([page_header("Scaling"), empty_state(
            "No model families yet",
            "Runs of one model family at several world sizes show here as throughput and efficiency against GPUs, with "
            "the ideal line and the component that grows with scale.",
            ["fs.init(name=..., model_family='vla-7b', config={...})   # same family, different world sizes",
             "fleetscope demo   # a synthetic fleet at 8 … 4096 GPUs"], eid=EMPTY)])
    fam = family if family in fams else fams[0]
    return html.Div([
        page_header("Scaling", "Per model family: measured vs ideal throughput, efficiency, and where the loss comes from.",
                    dcc.Dropdown(id=FAMILY, options=[{"label": f, "value": f} for f in fams], value=fam, clearable=False,
                                 className="fs-control")),
        dcc.Store(id=URL),
        dcc.Store(id=HAND, data={"exclude": _ids(exclude), "include": _ids(include)}),
        html.Div([section(None, loading(graph(THROUGHPUT)), cls="fs-col-6"),
                  section(None, loading(graph(EFFICIENCY)), cls="fs-col-6")], className="fs-row"),
        loading(html.Div(id=DECOMP, className="fs-row")),
        section(None, loading(graph(COMM_DIMS))),
        section("Points", loading(html.Div(id=TABLE))),
        section("Set apart", loading(html.Div(id=APART))),
        section("Projection track record", loading(html.Div(id=TRACK))),
    ])


@callback(Output(APART, "children"), Input(FAMILY, "value"), State(HAND, "data"))
def _apart(family: str, hand: dict[str, Any] | None) -> Any:
    hand = hand or {}
    data = reports.scaling_view(_state.engine(), family, exclude=hand.get("exclude") or (),
                                include=hand.get("include") or ())
    rows = data.get("excluded") or []
    note = html.P("Runs that failed, hung or stalled, or had a straggler (straggler wait ≥ 10 % of the step), are "
                  "not on the curves. Keep one with ?include=ID in the URL, drop another with ?exclude=ID "
                  "(comma-separated ids).", className="fs-muted")
    if not rows:
        return [note, html.P("None.")]
    return [note, simple_table(["run", "id", "GPUs", "why"],
                               [[r["name"], str(r["run"]), str(r["world_size"]), r["reason"]] for r in rows[:200]])]


@callback(Output(THROUGHPUT, "figure"), Output(EFFICIENCY, "figure"), Output(DECOMP, "children"),
          Output(COMM_DIMS, "figure"), Output(TABLE, "children"), Input(FAMILY, "value"), State(HAND, "data"))
def _fill(family: str, hand: dict[str, Any] | None = None) -> tuple[Any, ...]:
    hand = hand or {}
    data = reports.scaling_view(_state.engine(), family, exclude=hand.get("exclude") or (),
                                include=hand.get("include") or ())
    cfgs = data["configs"][:MAX_CONFIGS]
    data = {**data, "configs": cfgs}
    if not cfgs:
        e = empty_state(f"No runs of {family} with throughput yet", "Runs need tokens per step to be placed on the curve.")
        return F.scaling_throughput_figure(data), F.scaling_efficiency_figure(data), [], F.scaling_comm_dims_figure(data), e
    # projected throughput from each configuration's smallest run, dashed with its error band (estimated)
    proj = reports.scaling_projections(_state.engine(), family, exclude=hand.get("exclude") or (),
                                       include=hand.get("include") or ())
    through = projection_panel.add_projected_traces(F.scaling_throughput_figure(data), proj,
                                                    [g["config"] for g in cfgs], list(SERIES_COLORS))
    width = 12 // max(1, min(len(cfgs), 2))
    decs = [section(None, graph(f"{DECOMP}-{i}", F.scaling_decomposition_figure(g)), cls=f"fs-col-{width}")
            for i, g in enumerate(cfgs)]
    return (through, F.scaling_efficiency_figure(data), decs, F.scaling_comm_dims_figure(data),
            _points_table(cfgs))


@callback(Output(TRACK, "children"), Input(FAMILY, "value"))
def _track(family: str) -> Any:
    note = html.P("Each projection asked of a run (the run page's what-if panel, GET /runs/{id}/projection) is checked "
                  "against the runs of the same configuration later measured at that size; the back-test projects "
                  "each configuration's smallest run to its other sizes without their measurements.",
                  className="fs-muted")
    return [note, projection_panel.track_record_table(reports.track_record(_state.engine(), family))]


@contained("scaling points")
def _points_table(cfgs: list[dict[str, Any]]) -> Any:
    rows = []
    for g in cfgs:
        for p in g["points"]:
            rows.append([g["config"], f"{p['world_size']:,}", len(p["runs"]), f"{fmt_num(p['tokens_per_s'])}",
                         fmt_num(p["tokens_per_s"] / p["world_size"]) if p["tokens_per_s"] is not None else "–", fmt_s(p["step_s"]), fmt_pct(p["mfu"]),
                         fmt_pct(p["efficiency"]), g["mode"],
                         html.Span([dcc.Link(n, href=f"/runs/{r}") for r, n in zip(p["runs"][:3], p["run_names"][:3], strict=True)],
                                   className="fs-links")])
    table = simple_table(["configuration", "GPUs", "runs", "tokens/s", "tokens/s/GPU", "step", "MFU", "efficiency", "mode",
                          "runs"], rows, numeric=(1, 2, 3, 4, 5, 6, 7), tid="scaling-points")
    return table


clientside_callback(f"function(f) {{ return ({URL_SYNC_JS})([['family', f]]); }}", Output(URL, "data"), Input(FAMILY, "value"))
