"""Pages survive any run. Next to a healthy run, runs whose rank-steps carry every subset of the measured
step components (data, compute, exposed comm, other, forward/backward/optimizer, comm total: each one
alone and each one missing; no tokens, so no MFU), a step time and nothing else, one rank and one step,
no steps at all, and absurd but accepted values (1e29 s steps, the largest world size with two ranks
reporting, 0 s steps, 1e-12 s steps) are ingested over the wire, with alerts and benchmark series of the
same kind. Then every page's layout (through Dash Pages' router) and every page callback is called through
Dash's own endpoint on the real server: every answer is a 200, nothing needed containing (no "could not
render" note, nothing logged by the dashboard) and the healthy run stays listed on the fleet, in compare
and in scaling.

Containment itself: inputs a client can send but no page expects make real code fail inside callbacks;
the endpoint still answers 200, each of that callback's charts and panels says "could not render:
<reason>", the failure is logged with its traceback, and other runs' panels are untouched. A fleet row
or a figure whose builder fails is replaced by its note (the row keeps the run's link).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import plotly.graph_objects as go
import psycopg
import pytest
from conftest import _db_uri, start_server
from dash_util import add_alert, load
from fleetscope.dashboard import figures as F
from fleetscope.dashboard.components import md_escape

from fleetscope.synthetic import RunSpec
from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
#: the measured parts of a rank-step the agent may or may not send, as a share of the step
SHARE = {"data_s": 0.1, "compute_s": 0.6, "comm_exposed_s": 0.2, "other_s": 0.1, "forward_s": 0.2, "backward_s": 0.35,
         "optimizer_s": 0.05, "comm_total_s": 0.3}
PARTS = tuple(SHARE)
FAMILY = "hostile"
DASH_LOG = "fleetscope.dashboard"


def _row(rank: int, step: int, step_s: float, parts: tuple[str, ...], **extra: Any) -> tuple:
    row: list[Any] = [None] * len(NAMES)
    vals = {"rank": rank, "step": step, "ts": 1.7e9 + step, "step_s": step_s, **{k: SHARE[k] * step_s for k in parts},
            **extra}
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _run(srv: Any, name: str, *, world_size: int = 2, ranks: int | None = None, steps: int = 3, step_s: float = 0.5,
         parts: tuple[str, ...] = (), phases: bool = False, colls: bool = False, **extra: Any) -> int:
    """A run whose rank-steps carry only ``parts``; with custom phases and collectives when asked."""
    ranks = world_size if ranks is None else ranks
    keys = [(s, r) for s in range(steps) for r in range(ranks)]
    with srv.client() as c:
        rid = c.register_run({"name": name, "model_family": FAMILY, "world_size": world_size,
                              "config": {"shape": name, "lr": 1e-4}})
        if keys:
            kw: dict[str, Any] = {"ranks": [{"rank": r, "host": f"h{r}", "node": f"n{r}"} for r in range(ranks)]}
            if phases:
                kw["phases"] = {"rank": [r for _, r in keys], "step": [s for s, _ in keys], "phase": ["loss"] * len(keys),
                                "seconds": [0.01 * step_s] * len(keys)}
            coll = [(r, s, 0, "all_reduce", world_size, 1 << 20, 1, 0.3 * step_s, None, None, "dp") for s, r in keys]
            c.ingest_rows(rid, [_row(r, s, step_s, parts, **extra) for s, r in keys], coll if colls else None, **kw)
    return rid


@pytest.fixture(scope="module")
def hostile(pg_admin_uri: str) -> Iterator[dict[str, Any]]:
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    srv = start_server(_db_uri(pg_admin_uri, name))
    try:
        ids: dict[str, int] = {}
        ids["healthy"] = load(srv, RunSpec(name="healthy-8", family=FAMILY, world_size=8, steps=12, seed=1),
                              modalities=True, events=True, compact=False)
        for p in PARTS:
            ids[f"only-{p}"] = _run(srv, f"only-{p}", parts=(p,))
            ids[f"no-{p}"] = _run(srv, f"no-{p}", parts=tuple(q for q in PARTS if q != p), phases=True, colls=True)
        ids["step-only"] = _run(srv, "step-only")
        ids["one"] = _run(srv, "one-rank-one-step", world_size=1, steps=1, parts=("compute_s",))
        ids["zero"] = _run(srv, "zero-steps", steps=0)
        ids["huge-s"] = _run(srv, "huge-steps", step_s=1e29, parts=PARTS, tokens=1, flops=1e12, colls=True)
        ids["huge-ws"] = _run(srv, "huge-world", world_size=262_144, ranks=2, parts=("compute_s", "comm_exposed_s"),
                              colls=True, tokens=100)
        ids["zero-s"] = _run(srv, "zero-duration", step_s=0.0, parts=PARTS, tokens=100, flops=1e12, colls=True)
        ids["tiny-s"] = _run(srv, "tiny-steps", step_s=1e-12, parts=("compute_s",), tokens=10**9, flops=1e20)
        srv.compact()
        eng = srv.state.engine
        alerts = [
            add_alert(eng, run_id=ids["only-compute_s"], metric="tokens_per_s_per_gpu", before=None, after=None,
                      change=None, significance=None, first_bad={"run_id": ids["only-compute_s"], "index": 1},
                      details={"runs": [ids["healthy"], ids["only-compute_s"]], "values": [1.0, None]}),
            add_alert(eng, kind="run_changepoint", metric="step_s", run_id=ids["huge-s"], before=1e29, after=0.0,
                      change=-1.0, first_bad={"run_id": ids["huge-s"], "step": 1}),
            add_alert(eng, kind="run_series", metric="mfu", run_id=ids["zero"], before=0.0, after=0.0, change=0.0,
                      details={"family": FAMILY, "world_size": 262_144}),
        ]
        pts = [{"name": "all_reduce_busbw", "params": {"bytes": b}, "unit": "GB/s", "value": v, "ts": 1.7e9 + i}
               for i, (b, v) in enumerate([(0, 0.0), (1 << 20, 1e300), ("huge", 5.0), (1e300, -1e300)])]
        pts += [{"name": "matmul_tflops", "params": {"deep": {"n": [1, {"m": None}]}}, "unit": "%{y}", "value": 1e-300,
                 "ts": 1.7e9}]
        with srv.client() as c:
            r = c.http.post("/api/v1/benchmarks", json={"cluster": "c-1", "points": pts})
            assert r.status_code == 200, r.text
        yield {"srv": srv, "ids": ids, "alerts": alerts}
    finally:
        srv.stop()
        with psycopg.connect(pg_admin_uri, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _update(srv: Any, outputs: list[tuple[str, str]], inputs: list[tuple[str, str, Any]],
            state: list[tuple[str, str, Any]] | None = None) -> dict[str, Any]:
    """POST /_dash-update-component as the page does; any status but 200/204 fails the test."""
    out = [{"id": i, "property": p} for i, p in outputs]
    body = {
        "output": out[0]["id"] + "." + out[0]["property"] if len(out) == 1
        else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": out[0] if len(out) == 1 else out,
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [f"{i}.{p}" for i, p, _ in inputs],
        "state": [{"id": i, "property": p, "value": v} for i, p, v in state or ()],
    }
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=120)
    assert r.status_code in (200, 204), (outputs, inputs, r.status_code, r.text[:500])
    return r.json()["response"] if r.status_code == 200 else {}


def _page(srv: Any, path: str, search: str = "") -> Any:
    """A page's layout as Dash Pages' router renders it."""
    httpx.get(f"{srv.url}/", timeout=30)  # the router callback is registered on the first request
    res = _update(srv, [("_pages_content", "children"), ("_pages_store", "data")],
                  [("_pages_location", "pathname", path), ("_pages_location", "search", search)])
    return res["_pages_content"]["children"]


RUN_CALLBACKS = [
    ([("run-kpis", "children"), ("run-bottleneck-text", "children"), ("run-decomposition", "figure"),
      ("run-throughput", "figure"), ("run-memory", "figure"), ("run-modality", "figure")], []),
    ([("run-compile", "children")], []),
    ([("run-kernels", "children")], []),
    ([("run-heatmap", "figure")], [("run-heat-field", "value", "work_s"), ("run-heat-agg", "value", "max")]),
    ([("run-heatmap", "figure")], [("run-heat-field", "value", "step_s"), ("run-heat-agg", "value", "min")]),
    ([("run-stragglers", "figure"), ("run-straggler-table", "children")], []),
    ([("run-collectives", "figure"), ("run-collective-table", "children")], []),
    ([("run-comm-dims", "children"), ("run-pipeline", "children")], []),
    ([("run-overlap", "children")], []),
    ([("run-extras", "children"), ("run-config", "children")], []),
]
COMPARE_OUT = [("compare-metrics", "children"), ("compare-series", "figure"), ("compare-decomposition", "figure"),
               ("compare-comm-dims", "figure"), ("compare-config", "children")]
SCALING_OUT = [("scaling-throughput", "figure"), ("scaling-efficiency", "figure"), ("scaling-decomposition", "children"),
               ("scaling-comm-dims", "figure"), ("scaling-table", "children")]
FLEET_OUT = [("fleet-table", "data"), ("fleet-kpis", "children"), ("fleet-empty", "children"), ("fleet-table", "style_table"),
             ("fleet-count", "children")]
FLEET_IN = [("fleet-family", "value", None), ("fleet-status", "value", None), ("fleet-search", "value", "")]


def _notes(resp: Any) -> list[str]:
    """Every "could not render" note in a response (panel, row, or chart annotation)."""
    s = json.dumps(resp)
    out, i = [], s.find("could not render")
    while i >= 0:
        out.append(s[i:i + 200])
        i = s.find("could not render", i + 1)
    return out


def _figures(resp: Any) -> Iterator[dict[str, Any]]:
    """Every figure in a response (outputs and graphs inside panels)."""
    if isinstance(resp, dict):
        if "data" in resp and "layout" in resp and isinstance(resp["data"], list):
            yield resp
        for v in resp.values():
            yield from _figures(v)
    elif isinstance(resp, list):
        for v in resp:
            yield from _figures(v)


def test_every_page_renders_every_hostile_run(hostile: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    srv, ids = hostile["srv"], hostile["ids"]
    caplog.set_level(logging.ERROR, logger=DASH_LOG)
    seen: dict[str, Any] = {}

    # fleet: every run listed, the healthy one with its figures
    got = seen["fleet"] = _update(srv, FLEET_OUT, FLEET_IN)
    rows = {r["name"]: r for r in got["fleet-table"]["data"]}
    assert len(rows) == len(ids)
    healthy = rows[f"[{md_escape('healthy-8')}](/runs/{ids['healthy']})"]
    assert healthy["tokens_per_s"] and healthy["steps"] == 12 and "·" in healthy["bottleneck"]
    assert rows[f"[{md_escape('only-compute_s')}](/runs/{ids['only-compute_s']})"]["bottleneck"] == "compute 100 % · no ceiling"
    for q in ("only", "zero", "huge"):  # filtered views too
        seen[f"fleet?q={q}"] = _update(srv, FLEET_OUT, FLEET_IN[:2] + [("fleet-search", "value", q)])

    # every run's page: its layout and every section
    for key, rid in ids.items():
        seen[f"run {key}"] = page = _page(srv, f"/runs/{rid}")
        assert "Run not found" not in json.dumps(page)
        for outputs, extra in RUN_CALLBACKS:
            seen[f"run {key} {outputs[0][0]}"] = _update(srv, outputs, [("run-id", "data", rid), *extra])

    # compare: the healthy run first, then the hostile ones (at most 8 runs a view)
    every = [r for k, r in ids.items() if k != "healthy"]
    for i in range(0, len(every), 7):
        got = seen[f"compare {i}"] = _update(srv, COMPARE_OUT, [("compare-runs", "value", [ids["healthy"], *every[i:i + 7]]),
                                                                ("compare-only-diff", "value", [])])
        assert "healthy-8" in json.dumps(got["compare-metrics"]["children"])
        assert [t["name"] for t in got["compare-series"]["figure"]["data"]][0] == "healthy-8"
    seen["compare layout"] = _page(srv, "/compare", f"?runs={ids['healthy']},{ids['zero']},{ids['huge-s']}")

    # scaling: the family of every run, the healthy run placed on the curve
    seen["scaling layout"] = _page(srv, "/scaling", f"?family={FAMILY}")
    got = seen["scaling"] = _update(srv, SCALING_OUT, [("scaling-family", "value", FAMILY)],
                                    [("scaling-hand", "data", None)])
    assert "healthy-8" in json.dumps(got["scaling-table"]["children"])

    # regressions: each alert selected, in every state tab
    for state in ("firing", "all"):
        seen[f"regressions {state}"] = _page(srv, "/regressions", f"?state={state}")
    for a in hostile["alerts"]:
        seen[f"alert {a}"] = _update(srv, [("regressions-chart", "figure"), ("regressions-detail", "children")],
                                     [("regressions-alert", "data", a)])

    # benchmarks and the cluster
    seen["benchmarks layout"] = _page(srv, "/benchmarks")
    for cluster in (None, "c-1"):
        seen[f"benchmarks {cluster}"] = _update(srv, [("benchmarks-charts", "children")],
                                                [("benchmarks-cluster", "value", cluster)])
    seen["cluster layout"] = _page(srv, "/cluster", "?node=n0")
    for node in (None, "n0"):
        seen[f"cluster {node}"] = _update(srv, [("cluster-kpis", "children"), ("cluster-chart", "figure"),
                                                ("cluster-table", "children"), ("cluster-detail", "children")],
                                          [("cluster-node", "value", node)])

    notes = {k: n for k, v in seen.items() if (n := _notes(v))}
    assert not notes, json.dumps(notes, indent=1)[:3000]
    logged = [r.getMessage() for r in caplog.records if r.name == DASH_LOG]
    assert not logged, logged
    figs = [f for v in seen.values() for f in _figures(v)]
    assert len(figs) >= 8 * len(ids)  # every run page draws its charts
    for f in figs:
        go.Figure(f)  # every chart is a valid Plotly figure


def test_a_failing_callback_is_contained_to_its_own_panels(hostile: dict[str, Any],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    srv, ids = hostile["srv"], hostile["ids"]
    caplog.set_level(logging.ERROR, logger=DASH_LOG)
    # a compare URL edited by hand: a run id that is no number makes the callback's own code raise
    got = _update(srv, COMPARE_OUT, [("compare-runs", "value", [ids["healthy"], "12; drop"]),
                                     ("compare-only-diff", "value", ["1"])])
    for cid, prop in COMPARE_OUT:
        v = got[cid][prop]
        if prop == "figure":
            go.Figure(v)
            assert v["data"] == [] and v["layout"]["annotations"][0]["text"].startswith("could not render: ValueError")
        else:
            assert v["props"]["children"].startswith("could not render: ValueError"), v
    rec = [r for r in caplog.records if r.name == DASH_LOG]
    assert rec and rec[0].exc_info is not None and "compare._fill" in rec[0].getMessage()
    # a heatmap aggregation no page offers: that chart says why; the run's other sections still render
    caplog.clear()
    got = _update(srv, [("run-heatmap", "figure")], [("run-id", "data", ids["healthy"]), ("run-heat-field", "value", "x"),
                                                     ("run-heat-agg", "value", {"not": "an aggregation"})])
    text = got["run-heatmap"]["figure"]["layout"]["annotations"][0]["text"]
    assert text.startswith("could not render: "), text
    assert any(r.exc_info for r in caplog.records if r.name == DASH_LOG)
    ok = _update(srv, RUN_CALLBACKS[0][0], [("run-id", "data", ids["healthy"])])
    assert not _notes(ok) and ok["run-decomposition"]["figure"]["data"]
    # the fleet: still every run, the healthy one with its figures
    rows = _update(srv, FLEET_OUT, FLEET_IN)["fleet-table"]["data"]
    assert len(rows) == len(ids) and any("healthy" in r["name"] and r["tokens_per_s"] for r in rows)


def test_a_failing_row_or_figure_builder_leaves_a_note(caplog: pytest.LogCaptureFixture) -> None:
    from fleetscope.dashboard.app import build_dash

    build_dash()  # pages register themselves with the app
    from fleetscope.dashboard.pages.fleet import _row

    caplog.set_level(logging.ERROR, logger=DASH_LOG)
    # a fleet row whose figures cannot be formatted (a share that is no number): the run stays listed, linked
    row = _row({"id": 7, "name": "odd <run>", "model_family": "f", "top_bottleneck": {"component": "data", "share": [1]}})
    assert row["name"] == f"[{md_escape('odd <run>')}](/runs/7)" and row["model_family"] == "f"
    assert row["bottleneck"].startswith("could not render: TypeError")
    assert _row({"id": 8, "name": "fine", "status": "running", "top_bottleneck": None})["bottleneck"] == "–"
    # a figure builder given a point it cannot place: the chart is the note, a valid figure
    fig = F.scaling_decomposition_figure({"config": "c", "points": [{"world_size": None, "step_s": 1.0}]})
    go.Figure(fig)
    assert fig["data"] == [] and "could not render: TypeError" in fig["layout"]["annotations"][0]["text"]
    msgs = [r.getMessage() for r in caplog.records if r.name == DASH_LOG and r.exc_info]
    assert any("fleet row" in m and "run 7" in m for m in msgs) and any("scaling_decomposition_figure" in m for m in msgs)
