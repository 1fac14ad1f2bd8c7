"""Figure builders are pure: page data in, Plotly figure out — checked here without a browser."""

from __future__ import annotations

import base64

import numpy as np
import plotly.graph_objects as go
import pytest
from fleetscope.dashboard import figures as F
from fleetscope.dashboard.theme import COMPONENT_COLORS, fmt_s, fmt_time, time_unit
from fleetscope.server.downsample import mean_buckets, minmax_series, reduce_matrix
from plotly.io.json import to_json_plotly


def _series(n: int = 2000, step: float = 0.4) -> dict:
    rng = np.random.default_rng(0)
    steps = np.arange(n)
    comp = {"data_s": np.full(n, 0.01 * step), "compute_s": np.full(n, 0.7 * step), "comm_exposed_s": np.full(n, 0.2 * step),
            "other_s": np.full(n, 0.09 * step)}
    x, dec, f = mean_buckets(steps, comp, 600)
    total = sum(comp.values()) * rng.lognormal(0, 0.02, n)
    return {
        "decomposition": {"step": x, **dec, "factor": f},
        "step_s_max": minmax_series(steps, total * 1.05, 1200),
        "mfu": minmax_series(steps, np.full(n, 0.41), 1200),
        "tokens_per_s": minmax_series(steps, np.full(n, 2e6), 1200),
        "mem_peak_bytes": minmax_series(steps, np.full(n, 66e9), 1200),
        "mem_reserved_bytes": minmax_series(steps, np.full(n, 72e9), 1200),
        "alloc_retry_steps": np.array([17, 900]),
        "packing": minmax_series(steps, np.full(n, 0.9), 1200),
    }


def G(d: dict) -> go.Figure:
    """Validate a figure dict with plotly.py (raises on any invalid property) and wrap it for inspection."""
    return go.Figure(d)


def vals(v) -> np.ndarray:
    """Values of a trace array, decoding base64 typed arrays."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype={"f4": "<f4", "i4": "<i4"}[v["dtype"]])
        return a.reshape([int(n) for n in v["shape"].split(",")]) if "shape" in v else a
    return np.asarray(v)


def _titles(fig) -> str:
    t = fig.layout.title
    return (t.text or "") + " " + (t.subtitle.text or "")


def _axis_titles(fig) -> list[str]:
    d = fig.to_dict()["layout"]
    return [v["title"]["text"] for k, v in d.items() if k.startswith(("xaxis", "yaxis")) and v.get("title")]


def _empty_message(fig) -> str:
    return " ".join(a.text for a in fig.layout.annotations)


def test_decomposition_stacks_the_four_components_in_their_colours_and_says_it_is_aggregated() -> None:
    fig = G(F.decomposition_figure(_series()))
    names = [t.name for t in fig.data]
    assert names == ["data", "compute", "exposed comm", "other", "slowest rank"]
    for t, key in zip(fig.data[:4], ("data_s", "compute_s", "comm_exposed_s", "other_s"), strict=True):
        assert t.stackgroup == "dec" and t.line.color == COMPONENT_COLORS[key]
    assert "aggregated server-side: mean of 4 steps per point" in _titles(fig)
    assert "time per step (ms)" in _axis_titles(fig) and "step" in _axis_titles(fig)


def test_seconds_become_ms_below_one_second_and_stay_s_above() -> None:
    assert time_unit([0.2, 0.3]) == (1e3, "ms") and time_unit([2.0, 3.0]) == (1.0, "s")
    fig = G(F.decomposition_figure(_series(step=3.0)))
    assert "time per step (s)" in _axis_titles(fig)
    assert fmt_s(0.0123) == "12.3 ms" and fmt_s(2.5) == "2.50 s" and fmt_s(None) == "–" and fmt_s(0) == "0 s"


def test_heatmap_says_how_many_steps_and_ranks_each_cell_holds_and_stays_small() -> None:
    rng = np.random.default_rng(1)
    mat = rng.lognormal(0, 0.02, (1024, 5000)) * 0.5
    red = reduce_matrix(mat, max_rows=256, max_cols=400, how="max")
    steps = np.arange(5000)
    hm = {"field": "step_s", "label": "step time", "how": "max", "values": red.values, "rank_lo": red.row_lo,
          "rank_hi": red.row_hi, "step_lo": steps[red.col_lo], "step_hi": steps[red.col_hi], "rank_factor": red.row_factor,
          "step_factor": red.col_factor, "n_ranks": 1024, "n_steps": 5000, "cells": mat.size}
    fig = G(F.heatmap_figure(hm))
    title = _titles(fig)
    assert "aggregated server-side: max of 13 steps × 4 ranks per cell" in title and "1,024 ranks × 5,000 steps" in title
    assert fig.data[0].colorbar.title.text == "ms"
    z = vals(fig.data[0].z)  # float32 typed array, in ms
    assert z.shape == (256, 385) and np.allclose(z, red.values * 1e3, rtol=1e-6)
    assert len(to_json_plotly(F.heatmap_figure(hm))) < 2_000_000  # the per-chart payload target (as sent)


def test_raw_heatmap_says_it_is_every_rank_and_step() -> None:
    hm = {"label": "work time", "how": "max", "values": np.ones((8, 20)), "rank_lo": np.arange(8), "rank_hi": np.arange(8),
          "step_lo": np.arange(20), "step_hi": np.arange(20), "rank_factor": 1, "step_factor": 1, "n_ranks": 8, "n_steps": 20}
    assert "every rank and step (8 × 20)" in _titles(G(F.heatmap_figure(hm)))


def test_throughput_memory_and_modality_charts_carry_units() -> None:
    s = _series()
    assert {"throughput (tokens/s)", "MFU (%)", "step"} <= set(_axis_titles(G(F.throughput_figure(s))))
    mem = G(F.memory_figure(s))
    assert "memory (GB)" in _axis_titles(mem) and np.isclose(vals(mem.data[0].y).max(), 66.0)
    assert any(t.name == "allocator retries" for t in mem.data)
    mod = {"step": np.arange(10), "tokens": {"vision": np.ones(10) * 5, "text": np.ones(10)}, "factor": 3, "totals": {}}
    fig = G(F.modality_figure(mod, s["packing"]))
    assert {"tokens", "packing efficiency (%)"} <= set(_axis_titles(fig)) and fig.layout.barmode == "stack"
    assert "tokens summed over 3 steps per bar" in _titles(fig)


def test_collectives_plot_busbw_in_gb_per_s_against_log_message_size() -> None:
    rows = [{"op": "all_reduce", "group_size": 8, "size_bucket_bytes": 2**26, "calls": 10, "total_s": 1.0,
             "busbw_bytes_per_s": 300e9, "efficiency": 0.66},
            {"op": "all_gather", "group_size": 8, "size_bucket_bytes": 2**22, "calls": 4, "total_s": 0.1,
             "busbw_bytes_per_s": 50e9, "efficiency": None}]
    fig = G(F.collectives_figure(rows))
    assert fig.layout.xaxis.type == "log" and "busbw (GB/s)" in _axis_titles(fig)
    assert {t.name for t in fig.data} == {"all_reduce", "all_gather"}
    ar = next(t for t in fig.data if t.name == "all_reduce")
    assert ar.y[0] == pytest.approx(300.0) and "66 % of link peak" in ar.text[0]


def test_slowdown_marks_ranks_above_the_threshold() -> None:
    slow = np.ones(64)
    slow[9] = 1.3
    sd = {"rank": np.arange(64), "slowdown": slow, "node_of": [f"n{r // 8}" for r in range(64)],
          "nodes": [{"node": "n1", "slowdown": 1.0, "ranks": 8}, {"node": "n0", "slowdown": 1.0, "ranks": 8}],
          "time_lost_s": 12.5, "known_hosts": True}
    fig = G(F.slowdown_figure(sd))
    above = next(t for t in fig.data if t.name == "above threshold")
    assert list(vals(above.x)) == [9] and above.marker.color == "#D55E00" and len(vals(fig.data[0].x)) == 63
    assert "12.5 s" in _titles(fig) and fig.data[-1].type == "bar"


def test_the_four_components_keep_their_colours_on_every_page() -> None:
    s = _series()
    pts = [{"world_size": n, "step_s": 0.5, "data_s": 0.01, "compute_s": 0.4, "comm_exposed_s": 0.05, "other_s": 0.04}
           for n in (8, 16)]
    metrics = {1: {"step_s": 0.5, "data_s": 0.01, "compute_s": 0.4, "comm_exposed_s": 0.05, "other_s": 0.04}}
    figs = [G(F.decomposition_figure(s)), G(F.scaling_decomposition_figure({"config": "c", "points": pts})),
            G(F.compare_decomposition_figure(metrics, {1: "a"}))]
    for fig in figs:
        colors = {t.name: (t.marker.color if t.type == "bar" else t.line.color) for t in fig.data if t.name in
                  ("data", "compute", "exposed comm", "other")}
        assert colors == {"data": COMPONENT_COLORS["data_s"], "compute": COMPONENT_COLORS["compute_s"],
                          "exposed comm": COMPONENT_COLORS["comm_exposed_s"], "other": COMPONENT_COLORS["other_s"]}


def test_scaling_charts_show_ideal_line_and_efficiency_in_percent() -> None:
    data = {"family": "f", "configs": [{"config": "H100", "mode": "weak", "points": [
        {"world_size": 8, "tokens_per_s": 1e5, "ideal_tokens_per_s": 1e5, "efficiency": 1.0},
        {"world_size": 64, "tokens_per_s": 6e5, "ideal_tokens_per_s": 8e5, "efficiency": 0.75}]}]}
    thr = G(F.scaling_throughput_figure(data))
    assert [t.name for t in thr.data] == ["measured · H100", "ideal (linear)"] and list(thr.data[1].y) == [1e5, 8e5]
    eff = G(F.scaling_efficiency_figure(data))
    assert list(eff.data[0].y) == [100.0, 75.0] and "efficiency (%)" in _axis_titles(eff)


def test_alert_chart_marks_the_change_point_and_the_two_levels() -> None:
    y = [100.0] * 10 + [80.0] * 10
    ser = {"x": [1.7e9 + 86400 * i for i in range(20)], "y": y, "labels": [f"r{i}" for i in range(20)],
           "change_index": 10, "xlabel": "run start", "metric": "tokens_per_s_per_gpu", "unit": "tokens/s/GPU"}
    alert = {"metric": "tokens_per_s_per_gpu", "before": 100.0, "after": 80.0}
    fig = G(F.alert_series_figure(ser, alert))
    assert len(fig.layout.shapes) == 1 and any(a.text == "change point" for a in fig.layout.annotations)
    assert {t.name for t in fig.data} >= {"before", "after"}
    assert "run start (UTC)" in _axis_titles(fig) and "tokens/s/GPU" in _axis_titles(fig)


def test_benchmark_charts() -> None:
    series = [{"name": "all_reduce_busbw", "cluster": "a", "params_key": "{}", "params": {"bytes": b}, "unit": "GB/s",
               "ts": [1.7e9, 1.7e9 + 60], "value": [b / 1e7, b / 1e7 + 1], "git_commit": ["c1", "c2"]}
              for b in (2**20, 2**24)]
    assert len(G(F.benchmark_figure(series, "all_reduce_busbw")).data) == 2
    size = G(F.busbw_by_size_figure(series))
    assert list(size.data[0].x) == [2**20, 2**24] and "busbw (GB/s)" in _axis_titles(size)


@pytest.mark.parametrize("build", [
    lambda: G(F.decomposition_figure({})), lambda: G(F.heatmap_figure(None)), lambda: G(F.slowdown_figure(None)),
    lambda: G(F.collectives_figure([])), lambda: G(F.memory_figure({})), lambda: G(F.throughput_figure({})),
    lambda: G(F.modality_figure(None, None)),
    lambda: G(F.scaling_throughput_figure({"family": "x", "configs": []})), lambda: G(F.compare_series_figure({}, {})),
    lambda: G(F.alert_series_figure(None, {})), lambda: G(F.busbw_by_size_figure([])),
])
def test_every_chart_explains_itself_when_there_is_no_data(build) -> None:
    fig = build()
    assert len(fig.data) == 0 and len(_empty_message(fig)) > 10


def test_timestamps_always_carry_their_zone() -> None:
    assert fmt_time("2026-12-03T05:51:00+02:00") == "2026-12-03 03:51 UTC"
    assert fmt_time(0) == "1970-01-01 00:00 UTC" and fmt_time(None) == "–"


def test_markdown_in_run_names_is_escaped_in_the_fleet_table() -> None:
    from fleetscope.dashboard.app import build_dash
    from fleetscope.dashboard.components import md_escape

    build_dash()  # pages register themselves with the app
    from fleetscope.dashboard.pages.fleet import _row

    name = "![pixel](http://evil.example/p.png) [click](http://evil.example) **bold**"
    cell = _row({"name": name, "id": 7, "status": "running", "started_at": None})["name"]
    assert cell.startswith("[") and cell.endswith("](/runs/7)")
    inner = cell[1 : -len("](/runs/7)")]
    assert inner == md_escape(name)
    # no unescaped markdown syntax survives inside the link text
    unescaped = [ch for i, ch in enumerate(inner) if ch in "![]()*" and (i == 0 or inner[i - 1] != "\\")]
    assert not unescaped, inner
