"""The steady-state basis on the run page: the words ("30 of 32 steps; 1 compile step, 3.5 s and 1 warm-up
step, 8.2 s set apart") under the diagnosis, and a heatmap whose colour range is the steady steps' — the
set-apart steps still drawn — through Dash's callback endpoint on the real server; and the pure parts."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
from dash_util import find as _find
from dash_util import texts as _texts
from fleetscope.dashboard import figures as F

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
WARM = (8.1, 3.4)


def _row(rank: int, step: int, ts: float, extra: float) -> tuple:
    vals = {"rank": rank, "step": step, "ts": ts, "data_s": 0.005, "forward_s": 0.030 + extra, "backward_s": 0.060,
            "optimizer_s": 0.010, "compute_s": 0.100 + extra, "comm_exposed_s": 0.010, "comm_total_s": 0.030,
            "other_s": 0.002, "step_s": 0.117 + extra + 0.001 * rank}
    row: list[Any] = [None] * len(NAMES)
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _run(srv: Any) -> int:
    rows, t = [], 1.7e9
    for s in range(32):
        extra = WARM[s] if s < len(WARM) else 0.0
        rows += [_row(r, s, t, extra) for r in range(4)]
        t += 0.12 + extra
    ev = [{"rank": 0, "seq": 1, "kind": "compile", "ts": 1.7e9 + 8.3, "step": 1, "data": {"compile_s": 3.3}}]
    with srv.client() as c:
        rid = c.register_run({"name": "warm-page", "world_size": 4})
        c.ingest_rows(rid, rows, events=ev)
    srv.compact()
    return rid


def _post(srv: Any, outputs: list[tuple[str, str]], inputs: list[tuple[str, str, Any]]) -> dict[str, Any]:
    outs = [{"id": i, "property": p} for i, p in outputs]
    key = "...".join(f"{i}.{p}" for i, p in outputs)
    body = {"output": f"..{key}.." if len(outputs) > 1 else key, "outputs": outs if len(outputs) > 1 else outs[0],
            "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
            "changedPropIds": [f"{inputs[0][0]}.{inputs[0][1]}"], "state": []}
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()["response"]  # type: ignore[no-any-return]


def test_the_page_says_which_steps_are_set_apart_and_the_heatmap_is_not_swamped(live_server: Any) -> None:
    rid = _run(live_server)
    resp = _post(live_server, [("run-diagnosis", "children"), ("run-balance", "children")],
                 [("run-id", "data", rid)])
    notes = " ".join(_texts(_find(resp["run-diagnosis"]["children"], "run-diagnosis-notes")))
    assert "On the steady-state basis: 30 of 32 steps; 1 compile step, 3.52 s, and 1 warm-up step, 8.22 s, set apart." \
        in notes, notes

    fig = _post(live_server, [("run-heatmap", "figure")],
                [("run-id", "data", rid), ("run-heat-field", "value", "step_s"), ("run-heat-agg", "value", "max")])
    trace = fig["run-heatmap"]["figure"]["data"][0]
    # the steady steps take ~0.12 s: the colour scale ends there, not at the 8 s compile step
    assert trace["zauto"] is False and trace["zmax"] < 0.2 * 1e3  # ms
    assert "colour range of the steady steps" in fig["run-heatmap"]["figure"]["layout"]["title"]["subtitle"]["text"]


def test_the_colour_range_leaves_out_only_columns_holding_a_set_apart_step() -> None:
    z = np.ones((4, 10)) * 0.1
    z[:, 0] = 8.0  # step 0: compile
    z[2, 5] = 0.3  # a slow rank in a steady step stays in the range
    lo = np.arange(10) * 2  # each column two steps: [0, 1], [2, 3], ...
    assert F.steady_colour_range(z, lo, lo + 1, [1]) == (0.1, 0.3)
    assert F.steady_colour_range(z, lo, lo + 1, []) is None
    assert F.steady_colour_range(z, lo, lo + 1, [100]) is None  # not on the chart
    hm = {"label": "step time", "how": "max", "values": z, "rank_lo": np.arange(4), "rank_hi": np.arange(4),
          "step_lo": lo, "step_hi": lo + 1, "rank_factor": 1, "step_factor": 2, "n_ranks": 4, "n_steps": 20}
    plain = F.heatmap_figure(hm)
    assert "zmax" not in plain["data"][0]
    clipped = F.heatmap_figure(hm, set_apart=[0, 1])
    assert clipped["data"][0]["zmax"] == 300.0 and clipped["data"][0]["zmin"] == 100.0  # ms


def test_basis_text_names_each_reason_with_its_count_and_seconds() -> None:
    assert F.basis_text({"steps": 28, "of": 30, "set_apart": [{"reason": "warm-up", "steps": [0, 1], "n": 2,
                                                             "seconds": 11.5}]}) == \
        "28 of 30 steps; 2 warm-up steps, 11.50 s, set apart"
    assert F.basis_text({"steps": 30, "of": 30, "set_apart": [], "fallback": None}) == "all 30 steps"
    assert F.basis_text(None) is None
