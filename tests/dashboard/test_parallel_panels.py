"""Communication by parallel dimension, the pipeline and custom phases on the dashboard
(dashboard/pages/run.py, compare.py, scaling.py), through Dash's own callback endpoint on the real
server: a 2-stage × 2-rank pipeline job with dp/tp/pp collectives, comm groups, a schedule and custom
phases, ingested over the wire with known answers, shows its numbers in the run page's
"Communication by dimension" and "Pipeline" panels and its phases biggest first; a run without a
pipeline shows no Pipeline panel; compare and scaling split exposed comm per dimension with the
summaries' figures. One headless-chromium check that the new run-page panels draw."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pytest
from dash_util import find as _find
from dash_util import load
from dash_util import texts as _texts
from fleetscope.dashboard import figures as F
from fleetscope.dashboard.theme import fmt_s

from fleetscope.client import columnar
from fleetscope.synthetic import RunSpec
from fleetscope.wire import PHASE_FIELDS, RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
STEP_S = 0.130
DP = (2, 2_000_000, 0.020, 0.013)  # calls, bytes, total_s, exposed_s per rank per step
TP = (4, 512_000, 0.003, 0.001)
WAIT = {0: 0.010, 1: 0.030}  # pipeline stage → send/recv wait per step (stage 1 waits for stage 0)
PHASES = {"forward": 0.020, "backward": 0.040, "optimizer": 0.005}
CUSTOM = {"vision_encoder": 0.015, "loss": 0.002}
STEPS = 6


def _step(rank: int, step: int) -> tuple:
    wait = WAIT[rank // 2]
    exposed = DP[3] + TP[3] + wait
    compute = sum(PHASES.values()) + sum(CUSTOM.values())
    row: list[Any] = [None] * len(NAMES)
    vals = {"rank": rank, "step": step, "ts": 1.7e9 + step, "step_s": STEP_S, "data_s": 0.0, "compute_s": compute,
            "comm_exposed_s": exposed, "comm_total_s": DP[2] + TP[2] + wait + 0.001,
            "other_s": STEP_S - compute - exposed, **{f"{k}_s": v for k, v in PHASES.items()}}
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _pipeline_run(srv: Any, family: str = "pp-7b") -> int:
    """4 ranks on 2 nodes: pipeline stage = rank // 2, dp pairs {0, 2} and {1, 3} span both nodes,
    tp pairs {0, 1} and {2, 3} stay inside one."""
    hosts = [{"rank": r, "host": f"node{r // 2}", "node": f"node{r // 2}", "local_rank": r % 2} for r in range(4)]
    steps, colls, phases = [], [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_step(r, s))
            colls.append((r, s, 0, "all_reduce", 2, DP[1], DP[0], DP[2], DP[3], 1.7e9 + s, "dp"))
            colls.append((r, s, 1, "all_gather", 2, TP[1], TP[0], TP[2], TP[3], 1.7e9 + s, "tp"))
            w = WAIT[r // 2]
            colls.append((r, s, 2, "send" if r < 2 else "recv", 2, 8192, 1, w + 0.001, w, 1.7e9 + s, "pp"))
            phases += [(r, s, name, sec) for name, sec in CUSTOM.items()]
    events = []
    for r in range(4):
        events += [
            {"rank": r, "seq": 0, "kind": "pp_stage", "ts": 1.7e9, "step": 0, "data": {"stage": r // 2, "num_stages": 2}},
            {"rank": r, "seq": 1, "kind": "pp_schedule", "ts": 1.7e9, "step": 0,
             "data": {"schedule": "Interleaved1F1B", "n_microbatches": 8}},
            {"rank": r, "seq": 2, "kind": "comm_group", "ts": 1.7e9, "step": 0, "data": {"dim": "dp", "ranks": [r % 2, r % 2 + 2]}},
            {"rank": r, "seq": 3, "kind": "comm_group", "ts": 1.7e9, "step": 0,
             "data": {"dim": "tp", "ranks": [r // 2 * 2, r // 2 * 2 + 1]}},
        ]
    with srv.client() as c:
        rid = c.register_run({"name": "pp-dp-tp", "model_family": family, "world_size": 4})
        c.ingest_rows(rid, steps, colls, ranks=hosts, events=events, phases=columnar(phases, PHASE_FIELDS))
    srv.compact()
    return rid


def _callback(srv: Any, outputs: list[tuple[str, str]], inputs: list[tuple[str, str, Any]],
              state: list[tuple[str, str, Any]] | None = None) -> dict[str, Any]:
    """POST /_dash-update-component as the page does when its inputs are set."""
    import httpx

    out = [{"id": i, "property": p} for i, p in outputs]
    body = {
        "output": out[0]["id"] + "." + out[0]["property"] if len(out) == 1
        else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": out[0] if len(out) == 1 else out,
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [f"{i}.{p}" for i, p, _ in inputs],
        "state": [{"id": i, "property": p, "value": v} for i, p, v in state or ()],
    }
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code in (200, 204), r.text[:500]
    return r.json()["response"] if r.status_code == 200 else {}


def _run_cb(srv: Any, outputs: list[tuple[str, str]], rid: int) -> dict[str, Any]:
    return _callback(srv, outputs, [("run-id", "data", rid)])






def _rows(table: Any) -> list[list[str]]:
    """A simple_table's body rows as the text of each cell."""
    body = table["props"]["children"][1]["props"]["children"]
    return [[" ".join(_texts(td["props"].get("children"))) for td in tr["props"]["children"]] for tr in body]


def _num(a: Any) -> list[float]:
    """A figure array (list or base64 typed array) as floats."""
    if isinstance(a, dict) and "bdata" in a:
        return np.frombuffer(base64.b64decode(a["bdata"]), dtype={"f4": "<f4", "i4": "<i4"}[a["dtype"]]).tolist()
    return [float("nan") if v is None else float(v) for v in a]


RUN_SUMMARY_OUT = [("run-kpis", "children"), ("run-bottleneck-text", "children"), ("run-decomposition", "figure"),
                   ("run-throughput", "figure"), ("run-memory", "figure"), ("run-modality", "figure")]


def test_run_page_comm_by_dimension_pipeline_and_custom_phases(live_server: Any) -> None:
    rid = _pipeline_run(live_server)
    plain = load(live_server, RunSpec(name="dp-only", family="vla-7b", world_size=2, steps=8, seed=5))
    with live_server.client() as c:
        summary = c.summary(rid)
    assert set(summary["comm_by_dim"]) == {"dp", "tp", "pp"}  # the fixture is what the test thinks it is

    got = _run_cb(live_server, [("run-comm-dims", "children"), ("run-pipeline", "children")], rid)
    comm, pipe = got["run-comm-dims"]["children"], got["run-pipeline"]["children"]

    # the table: per step, most exposed first (pp 20 ms = cross-rank median of 10, 10, 30, 30 ms)
    rows = {r[0]: r[1:] for r in _rows(_find(comm, "run-comm-dims-table"))}
    assert list(rows) == ["pp", "dp", "tp"]
    assert rows["dp"] == ["2", "2 MB", "20.00", "13.00", "10.0 %", "2"]  # dp pairs {0, 2}, {1, 3} span both nodes
    assert rows["tp"] == ["4", "512 kB", "3.00", "1.00", "0.8 %", "1"]
    assert rows["pp"][3:5] == ["20.00", "15.4 %"]
    # the chart: exposed comm per step, one line per dimension, in ms
    fig = _find(comm, "run-comm-dims-chart")["props"]["figure"]
    go.Figure(fig)
    lines = {t["name"]: t for t in fig["data"]}
    assert list(lines) == ["pp", "dp", "tp"]
    assert _num(lines["dp"]["x"]) == list(range(STEPS))
    assert _num(lines["dp"]["y"]) == pytest.approx([13.0] * STEPS, rel=1e-5)
    assert _num(lines["pp"]["y"]) == pytest.approx([20.0] * STEPS, rel=1e-5)
    assert "(ms)" in fig["layout"]["yaxis"]["title"]["text"]
    # the findings as sentences
    findings = _texts(_find(comm, "run-comm-dims-findings"))
    assert any(f.startswith("Data-parallel all-reduce exposes 10 % of the step; the data-parallel group spans 2 nodes")
               for f in findings), findings
    assert any(f.startswith("Pipeline bubble 15 % with 2 stages and 8 micro-batches") and "stage 0 is the slowest" in f
               for f in findings), findings

    # the pipeline: stages, schedule, micro-batches, bubble ms and %, slowest stage, per-stage bars
    kpis = " | ".join(_texts(_find(pipe, "run-pipeline-kpis")))
    for s in ("stages | 2", "schedule | Interleaved1F1B", "micro-batches | 8", "bubble | 20.0 ms | 15.4 % of the step",
              "slowest stage | stage 0 | busy 106.0 ms"):
        assert s in kpis, (s, kpis)
    fig = _find(pipe, "run-pipeline-chart")["props"]["figure"]
    go.Figure(fig)
    bars = {t["name"].split()[0]: t for t in fig["data"]}
    assert bars["busy"]["x"] == ["stage 0", "stage 1"] == bars["bubble"]["x"]
    assert bars["busy"]["y"] == pytest.approx([106.0, 86.0]) and bars["bubble"]["y"] == pytest.approx([10.0, 30.0])

    # phases: forward/backward/optimizer and the custom ones, biggest first, seconds and share of the 130 ms step
    kpis = _run_cb(live_server, RUN_SUMMARY_OUT, rid)["run-kpis"]["children"]
    tile = _find(kpis, "run-phases")
    body = tile["props"]["children"][1]["props"]["children"]["props"]["children"]
    phases = [[" ".join(_texts(td["props"]["children"])) for td in tr["props"]["children"]] for tr in body]
    assert phases == [["backward", "40.0 ms", "31 %"], ["forward", "20.0 ms", "15 %"], ["vision_encoder", "15.0 ms", "12 %"],
                      ["optimizer", "5.0 ms", "4 %"], ["loss", "2.0 ms", "2 %"]]

    # a run without pipeline stages: no Pipeline panel; synthetic dp/world collectives still split by dimension
    got = _run_cb(live_server, [("run-comm-dims", "children"), ("run-pipeline", "children")], plain)
    assert got["run-pipeline"]["children"] is None
    assert [r[0] for r in _rows(_find(got["run-comm-dims"]["children"], "run-comm-dims-table"))] == ["dp", "world"]


def test_run_without_collectives_hides_the_panels(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "no-comm", "model_family": "f", "world_size": 1})
        c.ingest_rows(rid, [_step(0, s) for s in range(3)])
    live_server.compact()
    got = _run_cb(live_server, [("run-comm-dims", "children"), ("run-pipeline", "children")], rid)
    assert got["run-comm-dims"]["children"] is None and got["run-pipeline"]["children"] is None


def test_compare_and_scaling_split_exposed_comm_by_dimension(live_server: Any) -> None:
    a = load(live_server, RunSpec(name="vla-4", family="vla-7b", world_size=4, steps=10, seed=4), compact=False)
    b = load(live_server, RunSpec(name="vla-8", family="vla-7b", world_size=8, steps=10, seed=8), compact=False)
    pp = _pipeline_run(live_server)
    with live_server.client() as c:
        by = {r: c.summary(r)["comm_by_dim"] for r in (a, b, pp)}
    assert set(by[a]) == set(by[b]) == {"dp", "world"}

    # compare: a bar per run in each dimension, and a diff row per dimension with Δ vs the first run
    got = _callback(live_server, [
        ("compare-metrics", "children"), ("compare-series", "figure"), ("compare-decomposition", "figure"),
        ("compare-comm-dims", "figure"), ("compare-config", "children")],
        [("compare-runs", "value", [a, pp]), ("compare-only-diff", "value", ["1"])])
    fig = got["compare-comm-dims"]["figure"]
    go.Figure(fig)
    assert [t["name"] for t in fig["data"]] == ["vla-4", "pp-dp-tp"]
    assert fig["data"][0]["x"] == ["dp", "world", "pp", "tp"]
    ms = 1e3 if "(ms)" in fig["layout"]["yaxis"]["title"]["text"] else 1e6
    assert fig["data"][0]["y"] == pytest.approx([by[a]["dp"]["exposed_s"] * ms, by[a]["world"]["exposed_s"] * ms, 0, 0])
    assert fig["data"][1]["y"] == pytest.approx([0.013 * ms, 0, 0.020 * ms, 0.001 * ms])
    rows = {r[0]: r[1:] for r in _rows(_find(got["compare-metrics"]["children"], "compare-diff"))}
    dp = rows["exposed comm · dp (per step)"]
    assert dp[0] == fmt_s(by[a]["dp"]["exposed_s"])
    assert dp[1].startswith("13.0 ms") and "%" in dp[1]
    assert rows["exposed comm · pp (per step)"][1].startswith("20.0 ms")

    # scaling: exposed comm per dimension against world size, a line per dimension
    got = _callback(live_server, [("scaling-throughput", "figure"), ("scaling-efficiency", "figure"),
                                  ("scaling-decomposition", "children"), ("scaling-comm-dims", "figure"),
                                  ("scaling-table", "children")], [("scaling-family", "value", "vla-7b")],
                    [("scaling-hand", "data", None)])
    fig = got["scaling-comm-dims"]["figure"]
    go.Figure(fig)
    lines = {t["name"]: t for t in fig["data"]}
    assert {"dp", "world"} <= {n.split(" · ")[0] for n in lines}
    dp_lines = [t for n, t in lines.items() if n.split(" · ")[0] == "dp" and 4 in t["x"]]
    assert len(dp_lines) == 1
    ms = 1e3 if "(ms)" in fig["layout"]["yaxis"]["title"]["text"] else 1e6
    t = dp_lines[0]
    assert t["x"] == [4, 8]
    assert t["y"] == pytest.approx([by[a]["dp"]["exposed_s"] * ms, by[b]["dp"]["exposed_s"] * ms])
    # a family whose runs carry no tokens (the pipeline job): placed without throughput, dims still drawn
    got = _callback(live_server, [("scaling-throughput", "figure"), ("scaling-efficiency", "figure"),
                                  ("scaling-decomposition", "children"), ("scaling-comm-dims", "figure"),
                                  ("scaling-table", "children")], [("scaling-family", "value", "pp-7b")],
                    [("scaling-hand", "data", None)])
    fig = got["scaling-comm-dims"]["figure"]
    assert {t["name"]: t["y"] for t in fig["data"]} == {"pp": pytest.approx([20.0]), "dp": pytest.approx([13.0]),
                                                        "tp": pytest.approx([1.0])}


def test_parallel_figures_are_valid_and_explain_empty_data() -> None:
    series = {"steps": [0, 1, 2], "dims": {"dp": {"exposed_s": [0.01, 0.02, 0.01], "total_s": [0.03] * 3},
                                           "mesh_x": {"exposed_s": [0.001] * 3, "total_s": [0.002] * 3},
                                           "idle": {"exposed_s": [0, 0, 0], "total_s": [0.001] * 3}}}
    fig = F.comm_dims_figure(series, ["dp", "mesh_x"])
    go.Figure(fig)
    assert [t["name"] for t in fig["data"]] == ["dp", "mesh_x"]  # a dimension that never exposes anything is not drawn
    assert fig["data"][0]["line"]["color"] == F.dim_color("dp") != F.dim_color("mesh_x", ["mesh_x"])
    pipe = {"per_stage": [{"stage": 0, "bubble_s": 0.001, "busy_s": 0.1}, {"stage": 1, "bubble_s": 0.02, "busy_s": 0.08}],
            "slowest_stage": 0}
    go.Figure(F.pipeline_stages_figure(pipe))
    go.Figure(F.compare_comm_dims_figure({1: {"dp": {"exposed_s": 0.01}}, 2: {}}, {1: "a", 2: "b"}))
    scal = {"configs": [{"config": "H100 · zero=3", "points": [
        {"world_size": 8, "comm_by_dim": {"dp": {"exposed_s": 0.01, "total_s": 0.02}}},
        {"world_size": 16, "comm_by_dim": {"dp": {"exposed_s": 0.02, "total_s": 0.03}, "tp": {"exposed_s": 0.001}}}]}]}
    fig = F.scaling_comm_dims_figure(scal)
    go.Figure(fig)
    assert {t["name"]: t["y"] for t in fig["data"]} == {"dp": pytest.approx([10.0, 20.0]), "tp": [None, pytest.approx(1.0)]}
    for empty in (F.comm_dims_figure({}), F.pipeline_stages_figure(None), F.compare_comm_dims_figure({}, {}),
                  F.compare_comm_dims_figure({1: {}}, {1: "a"}), F.scaling_comm_dims_figure({"configs": []})):
        assert empty["data"] == [] and empty["layout"]["annotations"][0]["text"]


def test_run_page_draws_the_new_panels_in_a_browser(live_server: Any, browser: Any) -> None:
    from browser_util import severe_logs, wait_for, wait_for_charts

    rid = _pipeline_run(live_server)
    d = browser
    d.get(f"{live_server.url}/runs/{rid}")
    counts = wait_for_charts(d, ["run-comm-dims-chart", "run-pipeline-chart"])
    assert counts == [3, 2]
    text = wait_for(d, "document.getElementById('run-comm-dims-section').innerText + '\\n' + "
                       "document.getElementById('run-pipeline-section').innerText + '\\n' + "
                       "document.getElementById('run-phases').innerText", what="the panels' text")
    for s in ("Communication by dimension", "Pipeline", "Interleaved1F1B", "vision_encoder", "2 MB"):
        assert s in text, (s, text)
    errs = severe_logs(d)
    assert not errs, "browser console errors:\n" + "\n".join(errs)
