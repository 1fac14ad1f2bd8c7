"""The run page's rank drill-down: pick a rank (or click a cell of the per-rank heatmap, or a rank of the
stragglers chart) and see its step-time components per step against the median rank — step, data,
compute, exposed comm, other, straggler wait —, its node, and what its straggler rollups hold (slowdown,
excess work by component, lateness at collectives where the collectives carry start times).

Data: ``reports.rank_view.rank_steps`` (the rank's records picked from the stored per-rank blocks, the
medians from the step rollups; a series of at most ``MAX_POINTS`` steps, min/max-downsampled, cached per
run version). The rank is kept in the URL (``?rank=``) by the page's URL sync."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, dcc, html
from dash.exceptions import PreventUpdate
from fleetscope.server import reports
from fleetscope.server.reports import rank_view

from . import _state
from . import figures as F
from .components import callback, contained, empty_state, graph, kpi, kpi_strip, loading, section
from .theme import fmt_s

__all__ = ["rank_section", "zero_code_note", "is_zero_code", "RANK_PICK", "PANEL", "CHART", "MAX_POINTS"]

RUN = "run-id"  # the run page's store of the run id (pages/run.py)
HEATMAP = "run-heatmap"  # the run page's charts a click on picks a rank (pages/run.py)
STRAGGLERS = "run-stragglers"
RANK_PICK = "run-rank-pick"
PANEL = "run-rank-panel"
CHART = "run-rank-chart"
MAX_POINTS = 600

#: what ``fleetscope run`` records in the run's meta (agent/auto.py)
_ZERO_CODE = "fleetscope run"


def is_zero_code(run: dict[str, Any] | None) -> bool:
    """Whether the run was instrumented zero-code (``fleetscope run``: ``meta.instrumented_by``)."""
    return ((run or {}).get("meta") or {}).get("instrumented_by") == _ZERO_CODE


def zero_code_note(run: dict[str, Any] | None, nid: str) -> html.Div | None:
    """What ``data_s`` holds in a zero-code run (docs/agent.md, "What zero-code mode cannot see"); None
    for a run instrumented otherwise."""
    if not is_zero_code(run):
        return None
    return html.Div(["Zero-code run (", html.Code("fleetscope run"), "): ", html.B("data"), " is everything between "
                     "one optimizer.step() and the next forward — fetching the batch, host-to-device copies, logging and "
                     "whatever else the loop does there — not only the data loader."], className="fs-footnote", id=nid)


def rank_section(run: dict[str, Any], rank: int | None) -> html.Section:
    """The drill-down section: the rank picker and the panel the callback fills."""
    world = max(1, int(run.get("world_size") or 1))
    picker = html.Div([
        html.Span("rank ", className="fs-muted"),
        dcc.Input(id=RANK_PICK, type="number", min=0, max=world - 1, step=1, value=rank, debounce=True,
                  placeholder=f"0–{world - 1:,}", className="fs-control", style={"width": "120px"}),
    ], className="fs-inline")
    return section("Rank drill-down", [
        html.Div("Pick a rank, or click a cell of the heatmap or a rank of the stragglers chart: its step-time "
                 "components per step against the median rank.", className="fs-muted"),
        loading(html.Div(id=PANEL)),
    ], sid="run-rank-section", right=picker)


def _rank_of_click(data: dict[str, Any] | None, *, heatmap: bool) -> int:
    pts = (data or {}).get("points") or []
    if not pts:
        raise PreventUpdate
    p = pts[0]
    if not heatmap and isinstance(p.get("y"), str):
        raise PreventUpdate  # the slowest-nodes bars: a node, not a rank
    v = p.get("y") if heatmap else p.get("x")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise PreventUpdate from None


@callback(Output(RANK_PICK, "value"), Input(HEATMAP, "clickData"), Input(STRAGGLERS, "clickData"),
          prevent_initial_call=True)
def _clicked(heat: dict[str, Any] | None, strag: dict[str, Any] | None) -> int:
    """A click on the heatmap (its row's first rank) or on a rank of the stragglers chart picks it."""
    if dash.ctx.triggered_id == HEATMAP:
        return _rank_of_click(heat, heatmap=True)
    return _rank_of_click(strag, heatmap=False)


@callback(Output(PANEL, "children"), Input(RUN, "data"), Input(RANK_PICK, "value"))
def _panel(rid: int, rank: Any) -> Any:
    if rank is None or rank == "":
        return empty_state("No rank picked", "Pick a rank above, or click a cell of the heatmap or a rank of the "
                           "stragglers chart.", eid=f"{PANEL}-empty")
    try:
        r = int(rank)
    except (TypeError, ValueError):
        return html.Div(f"Not a rank: {str(rank)[:40]!r}", className="fs-muted", id=f"{PANEL}-error")
    eng = _state.engine()
    try:
        view = rank_view.rank_steps(eng, rid, r, max_points=MAX_POINTS)
    except rank_view.RankOutsideRun as e:
        return html.Div(str(e)[:1].upper() + str(e)[1:] + ".", className="fs-muted", id=f"{PANEL}-error")
    if view is None:
        return empty_state("Run not found", "It may have been deleted.", eid=f"{PANEL}-empty")
    return _body(view, reports.get_run(eng, rid))


def _per_step(v: float | None, steps: int) -> float | None:
    return None if v is None or not steps else v / steps


@contained("rank drill-down")
def _body(view: dict[str, Any], run: dict[str, Any] | None) -> html.Div:
    rank = view["rank"]
    roll = view.get("rollups")
    where = " · ".join(x for x in (view.get("host") and view.get("host") != view.get("node") and f"host {view['host']}",
                                   view.get("local_rank") is not None and f"local rank {view['local_rank']}",
                                   view.get("device")) if x)
    tiles = [kpi(f"rank {rank:,}", view.get("node") or "node not reported",
                 where or ("its node" if view.get("node") else "no host / node reported"), kid=f"{PANEL}-where")]
    foot = ["Per step: the rank's own record (from the stored per-rank blocks) against the step's cross-rank median "
            "of each component; straggler wait = the slowest rank's work − this rank's (work = step − exposed comm)."]
    if roll:
        steps = int(roll.get("steps") or 0)
        slow = roll.get("slowdown")
        tiles.append(kpi("slowdown", f"{slow:.3f}×" if slow is not None else "–",
                         "median over steps of its work ÷ the median rank's", tone="bad" if slow and slow > 1.05 else None,
                         kid=f"{PANEL}-slowdown"))
        excess = {c: _per_step(roll.get(f"{c}_excess_s"), steps) for c in ("compute", "data", "other")}
        top = max(excess, key=lambda c: excess[c] if excess[c] is not None else float("-inf"))
        tiles.append(kpi("excess work per step", f"{top} {_signed(excess[top])}",
                         " · ".join(f"{c} {_signed(v)}" for c, v in excess.items() if c != top) + " (mean, vs the median rank)",
                         kid=f"{PANEL}-excess"))
        late_n = int(roll.get("late_collectives") or 0)
        if late_n and roll.get("lateness_s") is not None:
            tiles.append(kpi("lateness at collectives", fmt_s(roll["lateness_s"]),
                             f"mean over {late_n:,} collectives: its enqueue time − the earliest rank's",
                             kid=f"{PANEL}-lateness"))
        else:
            tiles.append(kpi("lateness at collectives", "not stored",
                             "the run's collectives carry no start times (start_ts)", kid=f"{PANEL}-lateness"))
        tiles.append(kpi("time lost while slowest", fmt_s(roll.get("lost_s")),
                         f"slowest rank in {int(roll.get('slowest_steps') or 0):,} of {steps:,} steps", kid=f"{PANEL}-lost"))
    else:
        foot.append("No straggler rollups for this rank (the run was compacted before they existed, or the rank has no "
                    "compacted step): slowdown, excess work and lateness at collectives are not available.")
    return html.Div([
        kpi_strip(tiles, kid=f"{PANEL}-kpis"),
        graph(CHART, F.rank_drill_figure(view)),
        zero_code_note(run, f"{PANEL}-zero-code"),
        *(html.Div(f, className="fs-footnote") for f in foot),
    ], id=f"{PANEL}-body")


def _signed(v: float | None) -> str:
    if v is None:
        return "–"
    return ("+" if v >= 0 else "−") + fmt_s(abs(v))
