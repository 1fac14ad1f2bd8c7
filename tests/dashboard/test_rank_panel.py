"""The rank drill-down's pure parts, without a browser: the figure (valid Plotly, a small chart per
component with the rank's and the median rank's line, saying how it was reduced), which rank a click
picks, and the zero-code note."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
from dash.exceptions import PreventUpdate
from fleetscope.dashboard import figures as F
from fleetscope.dashboard import rank_panel


def _view(n: int = 50, **kw: object) -> dict:
    comps = ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "straggler_wait_s")
    rows = [{"step": s, **{k: 0.1 * (i + 1) for i, k in enumerate(comps)},
             **{f"median_{k}": 0.09 * (i + 1) for i, k in enumerate(comps)}} for s in range(n)]
    rows[3]["data_s"] = None  # not measured: a gap, not a zero
    return {"rank": 7, "steps": rows, "points": n, "reduced": False, "sampled_every_steps": 1, **kw}


def _title(fig: go.Figure) -> str:
    return (fig.layout.title.text or "") + " " + (fig.layout.title.subtitle.text or "")


def test_the_drilldown_draws_each_component_against_the_median_rank() -> None:
    fig = go.Figure(F.rank_drill_figure(_view()))  # raises on an invalid property
    assert [t.name for t in fig.data] == ["rank 7", "median rank"] * 6
    assert [t.showlegend for t in fig.data[:4]] == [True, True, False, False]
    assert {t.xaxis for t in fig.data} == {"x", "x2", "x3", "x4", "x5", "x6"}
    panels = [a.text for a in fig.layout.annotations]
    assert panels == ["step (ms)", "data (ms)", "compute (ms)", "exposed comm (ms)", "other (ms)", "straggler wait (ms)"]
    assert "every step read (50)" in _title(fig) and "cross-rank median" in _title(fig)
    red = go.Figure(F.rank_drill_figure(_view(20, points=5000, reduced=True, sampled_every_steps=4)))
    assert "20 of 5,000 steps" in _title(red) and "every 4th step" in _title(red)
    assert "No steps of this rank yet" in go.Figure(F.rank_drill_figure({"rank": 1, "steps": []})).layout.annotations[0].text


def test_a_click_picks_the_rank() -> None:
    assert rank_panel._rank_of_click({"points": [{"x": 12, "y": 40, "z": 0.3}]}, heatmap=True) == 40
    assert rank_panel._rank_of_click({"points": [{"x": 17, "y": 1.31}]}, heatmap=False) == 17
    for bad, heat in (({"points": [{"x": 1.2, "y": "node0003"}]}, False), (None, True), ({"points": []}, False)):
        with pytest.raises(PreventUpdate):
            rank_panel._rank_of_click(bad, heatmap=heat)


def test_the_zero_code_note_only_for_zero_code_runs() -> None:
    assert rank_panel.zero_code_note({"meta": {"instrumented_by": "fleetscope run"}}, "n") is not None
    assert rank_panel.zero_code_note({"meta": {}}, "n") is None and rank_panel.zero_code_note(None, "n") is None
