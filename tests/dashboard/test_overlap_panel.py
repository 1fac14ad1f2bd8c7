"""The run page's "Gradient communication vs backward" panel (id ``run-overlap``) through Dash's own
callback endpoint on the real server: a DDP-like run ingested over the wire with known answers shows
its representative rank-step (backward as a band, each bucket as a bar with its exposed part), the
tail after backward and the bucketing advice with its upper-bound gain; a run whose exposed
communication is minor says there is no suggestion; a run without collectives shows no panel."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import plotly.graph_objects as go
import pytest
from dash_util import find as _find
from dash_util import texts as _texts

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
STEPS = 5
# three 10 MB buckets issued at 25, 35 and 45 ms (backward: 15..45 ms), each 10 ms one after the other: the
# last one completes 10 ms after backward ends, and the step waits for it (exposed)
BUCKETS = [(0.025, 0.010, 0.0), (0.035, 0.010, 0.0), (0.045, 0.010, 0.010)]


def _row(rank: int, step: int, *, exposed: float, fwd: float = 0.010, bwd: float = 0.030, other: float = 0.0) -> tuple:
    vals = {"rank": rank, "step": step, "ts": T0 + step, "data_s": 0.005, "forward_s": fwd, "backward_s": bwd,
            "optimizer_s": 0.005, "compute_s": fwd + bwd + 0.005, "comm_exposed_s": exposed, "comm_total_s": 0.030,
            "other_s": other + 0.001 * rank, "step_s": 0.005 + fwd + bwd + 0.005 + exposed + other + 0.001 * rank}
    row: list[Any] = [None] * len(NAMES)
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _run(srv: Any, name: str, *, colls: bool = True, exposed: float = 0.010, **kw: Any) -> int:
    steps, cs = [], []
    for s in range(STEPS):
        for r in range(2):
            steps.append(_row(r, s, exposed=exposed, **kw))
            if colls:
                cs += [(r, s, i, "all_reduce", 2, 10_000_000, 1, tot, exp * exposed / 0.010, T0 + s + t, "dp")
                       for i, (t, tot, exp) in enumerate(BUCKETS)]
    # what the agent records of the DDP model: gradients of at most 1 MB (a smaller bucket cap is possible)
    facts = {"rank": 0, "seq": 0, "kind": "ddp", "ts": T0, "step": None,
             "data": {"bucket_cap_bytes": 10_000_000, "first_bucket_bytes": 10_000_000, "largest_grad_bytes": 1_000_000}}
    with srv.client() as c:
        rid = c.register_run({"name": name, "world_size": 2})
        c.ingest_rows(rid, steps, cs or None, events=[facts])
    srv.compact()
    return rid


def _panel(srv: Any, rid: int) -> Any:
    body = {"output": "run-overlap.children", "outputs": {"id": "run-overlap", "property": "children"},
            "inputs": [{"id": "run-id", "property": "data", "value": rid}], "changedPropIds": ["run-id.data"], "state": []}
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code in (200, 204), r.text[:500]
    return r.json()["response"]["run-overlap"]["children"] if r.status_code == 200 else None






def _num(a: Any) -> list[float]:
    if isinstance(a, dict) and "bdata" in a:
        return np.frombuffer(base64.b64decode(a["bdata"]), dtype={"f4": "<f4", "i4": "<i4"}[a["dtype"]]).tolist()
    return [float(v) for v in a]


def test_overlap_panel_draws_the_timeline_and_the_advice(live_server: Any) -> None:
    rid = _run(live_server, "ddp-tail")
    panel = _panel(live_server, rid)
    kpis = " | ".join(_texts(_find(panel, "run-overlap-kpis")))
    for s in ("step · rank | 4 · 0", "waited for after backward | 10.0 ms | 16.7 % of this step",
              "overlap | 66.7 %", "overlap in backward | 66.7 %"):
        assert s in kpis, (s, kpis)

    fig = _find(panel, "run-overlap-chart")["props"]["figure"]
    go.Figure(fig)
    bars, exposed = fig["data"]
    assert bars["y"] == exposed["y"] == [f"{i} · all-reduce · dp · 10 MB" for i in (1, 2, 3)]
    assert _num(bars["base"]) == pytest.approx([25.0, 35.0, 45.0], abs=1e-3)  # ms from the step's start
    assert _num(bars["x"]) == pytest.approx([10.0, 10.0, 10.0], abs=1e-3)
    assert _num(exposed["base"]) == pytest.approx([35.0, 45.0, 45.0], abs=1e-3)
    assert _num(exposed["x"]) == pytest.approx([0.0, 0.0, 10.0], abs=1e-3)
    band = next(s for s in fig["layout"]["shapes"] if s.get("name") == "backward")
    assert (band["x0"], band["x1"]) == pytest.approx((15.0, 45.0), abs=1e-3)  # data + forward .. the last issue
    assert "10 ms waited for after backward" in fig["layout"]["title"]["subtitle"]["text"]

    advice = "".join(_texts(_find(panel, "run-overlap-advice")))
    assert advice.startswith("bucket_cap_mb: Lower bucket_cap_mb to about 4.8 ")
    # of the run's median step (60.5 ms: the cross-rank median of 60 and 61 ms)
    assert "Expected gain at most 10.0 ms (16.5 % of the step) — an upper bound." in advice
    with live_server.client() as c:  # the panel shows the summary's advice
        assert [a["setting"] for a in c.summary(rid)["overlap_advice"]] == ["bucket_cap_mb"]


def test_minor_exposed_comm_gets_no_suggestion_and_no_collectives_no_panel(live_server: Any) -> None:
    # 0.5 ms exposed of a 70 ms step dominated by compute and other time: no advice, the timeline still drawn
    rid = _run(live_server, "compute-bound", exposed=0.0005, other=0.020)
    panel = _panel(live_server, rid)
    assert _find(panel, "run-overlap-chart") is not None
    assert " ".join(_texts(_find(panel, "run-overlap-advice"))).startswith("No bucketing or overlap suggestion")
    assert _panel(live_server, _run(live_server, "no-comm", colls=False)) is None
