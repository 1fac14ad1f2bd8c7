"""``analysis.compile.compile_health`` on its own (pure): a rank's figure is the larger of its events
and its final summary, the run's the maximum over ranks; reasons most frequent first, bounded."""

from __future__ import annotations

import pytest
from fleetscope.server.analysis.compile import compile_health


def test_no_compile_events_is_none() -> None:
    assert compile_health([], [], [], [], has_events=False) is None


def test_ranks_are_not_summed_and_a_summary_covers_what_events_missed() -> None:
    totals = [(0, "events", 3, 1, 4.0), (0, "summary", 5, 1, 4.5), (1, "events", 4, 2, 3.0), (2, "summary", None, None, None)]
    out = compile_health(totals, [], [9, 3, 3], [(0, 7), (1, 9)], has_events=True)
    assert out is not None
    assert (out["compiles"], out["recompiles"], out["compile_s"]) == (5, 2, pytest.approx(4.5))
    assert out["recompile_steps"] == [3, 9] and out["cudagraph_replays"] == 9 and out["ranks"] == 3
    assert out["graph_breaks"] == 0 and out["reasons"] == {"recompile": [], "graph_break": []}


def test_reasons_most_frequent_first_top_n_and_the_distinct_count_kept() -> None:
    reasons = [("graph_break", f"break {i}", i % 5, 1500) for i in range(30)] + [("recompile", "r", 2, 1), ("other", "x", 1, 1)]
    out = compile_health([(0, "events", 1, 0, 0.1)], reasons, [], [], has_events=True, top=4)
    assert out is not None
    assert [r["count"] for r in out["reasons"]["graph_break"]] == [4, 4, 4, 4]
    assert out["reasons"]["graph_break"][0]["reason"] == "break 14"  # ties by name
    assert out["graph_breaks"] == 1500  # the distinct count of all the run's reasons, not only those loaded
    assert out["reasons"]["recompile"] == [{"reason": "r", "count": 2}] and out["recompile_reasons"] == 1
