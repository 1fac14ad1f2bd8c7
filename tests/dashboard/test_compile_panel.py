"""The run page's Compile panel and recompile markers (dashboard/pages/run.py), through Dash's own
callback endpoint on the real server (no browser): a run with compile events shows its compiles,
recompiles, graph breaks, compile time and top reasons, and its step-time chart marks the steps that
recompiled; a run without them shows no panel and no markers."""

from __future__ import annotations

from typing import Any

import httpx
from dash_util import load
from dash_util import texts as _texts

from fleetscope.synthetic import RunSpec

REASON = "0/0: tensor 'x' size mismatch at index 0. expected 8, actual 9"
BREAK = "Data-dependent branching (model/vla.py:88)"


def _callback(srv: Any, outputs: list[tuple[str, str]], rid: int) -> dict[str, Any]:
    """POST /_dash-update-component as the page does when its run id store is set."""
    out = [{"id": i, "property": p} for i, p in outputs]
    body = {
        "output": out[0]["id"] + "." + out[0]["property"] if len(out) == 1
        else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": out[0] if len(out) == 1 else out,
        "inputs": [{"id": "run-id", "property": "data", "value": rid}],
        "changedPropIds": ["run-id.data"],
        "state": [],
    }
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code in (200, 204), r.text[:500]
    return r.json()["response"] if r.status_code == 200 else {}




def _ids(node: Any) -> list[str]:
    if isinstance(node, list):
        return [i for n in node for i in _ids(n)]
    if isinstance(node, dict):
        props = node.get("props") or {}
        own = [props["id"]] if isinstance(props.get("id"), str) else []
        return own + _ids(props.get("children"))
    return []


def test_the_compile_panel_and_the_recompile_markers(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="compiled", family="vla-7b", world_size=2, steps=30, seed=3))
    plain = load(live_server, RunSpec(name="eager", family="vla-7b", world_size=2, steps=30, seed=4))
    ev = []
    for r in (0, 1):
        ev += [{"rank": r, "seq": 1, "kind": "compile", "ts": 1.7e9, "step": 0,
                "data": {"compile_s": 41.5, "frame": "train.py:10 forward", "recompile": False, "reason": None}},
               {"rank": r, "seq": 2, "kind": "graph_break", "ts": 1.7e9, "step": 0, "data": {"reason": BREAK, "count": 1}},
               {"rank": r, "seq": 3, "kind": "compile", "ts": 1.7e9, "step": 17,
                "data": {"compile_s": 3.0, "frame": "train.py:10 forward", "recompile": True, "reason": REASON}}]
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": ev})

    panel = _callback(live_server, [("run-compile", "children")], rid)["run-compile"]["children"]
    text = " ".join(_texts(panel))
    ids = _ids(panel)
    assert "run-compile-section" in ids and "run-compile-recompile" in ids and "run-compile-graph-break" in ids
    for s in ("Compile", "compiles", "recompiles", "graph breaks", "compile time", REASON, BREAK, "max over 2 ranks",
              "at 1 step", "44.50 s"):
        assert s in text, (s, text)

    outs = [("run-kpis", "children"), ("run-bottleneck-text", "children"), ("run-decomposition", "figure"),
            ("run-throughput", "figure"), ("run-memory", "figure"), ("run-modality", "figure")]
    fig = _callback(live_server, outs, rid)["run-decomposition"]["figure"]
    marks = [s for s in fig["layout"].get("shapes", []) if s.get("x0") == s.get("x1") and s.get("yref") == "y domain"]
    assert [m["x0"] for m in marks] == [17]
    assert [t["name"] for t in fig["data"]][-1] == "recompile"

    assert _callback(live_server, [("run-compile", "children")], plain)["run-compile"]["children"] is None
    fig = _callback(live_server, outs, plain)["run-decomposition"]["figure"]
    assert not fig["layout"].get("shapes") and "recompile" not in [t["name"] for t in fig["data"]]
