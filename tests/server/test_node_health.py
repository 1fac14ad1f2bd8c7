"""Cluster and network health through the real server: runs sent by ``fleetscope simulate --slow-node``
(the real agent transport) → the run summary's ``network`` names the slow node and its ranks;
``GET /api/v1/nodes`` ranks it first over a few runs (and a straggler's node second), keeps what was
measured when the blocks are removed later, forgets a deleted run; bad input gets a 4xx naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from analysis_util import load
from fleetscope.server import reports
from sqlalchemy import text
from typer.testing import CliRunner

from fleetscope.cli import app
from fleetscope.simulate import run_simulation
from fleetscope.synthetic import RunSpec

SLOW = "node0002"  # ranks 16-23 of 32 (8 per node)


def _summary(srv: Any, rid: int) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _rid(srv: Any, name: str) -> int:
    return int(httpx.get(f"{srv.url}/api/v1/runs", params={"name": name}).json()["runs"][0]["id"])


def test_a_slow_node_is_named_by_the_summary_and_ranked_first_across_runs(live_server: Any) -> None:
    srv = ["--server", live_server.url, "--token", live_server.token]
    out = CliRunner().invoke(app, ["simulate", *srv, "--run", "slow-a", "--family", "vla-7b", "--ranks", "32",
                                   "--steps", "20", "--seed", "1", "--slow-node", f"{SLOW}=2",
                                   "--legacy-model"])  # the model of the run_simulation runs it is ranked against
    assert out.exit_code == 0, out.output
    for i in (2, 3):
        run_simulation(server=live_server.url, token=live_server.token, run=f"slow-{i}", family="vla-7b", ranks=32,
                       steps=20, seed=i, slow_nodes={SLOW: 2.0})
    run_simulation(server=live_server.url, token=live_server.token, run="straggler", family="vla-7b", ranks=32,
                   steps=20, seed=4, straggler={9: 1.3})  # a compute straggler on node0001
    run_simulation(server=live_server.url, token=live_server.token, run="healthy", family="vla-7b", ranks=32,
                   steps=20, seed=5)
    live_server.compact()

    s = _summary(live_server, _rid(live_server, "slow-a"))
    net = s["network"]
    assert [n["node"] for n in net["slow_nodes"]] == [SLOW]
    assert net["slow_nodes"][0]["ranks"] == 8 and net["slow_nodes"][0]["slow_ranks"] == 8
    assert net["slow_nodes"][0]["busbw_ratio"] == pytest.approx(0.5, abs=0.1)
    assert net["slow_nodes"][0]["latency_ratio"] == pytest.approx(2.0, rel=0.2)
    assert sorted(it["rank"] for it in net["slow_ranks"]) == list(range(16, 24))
    assert all(it["node"] == SLOW and it["node_flagged"] for it in net["slow_ranks"])
    assert net["ranks_measured"] == 32 and net["steps_sampled"] == 20 and net["source"] == "last 20 steps"
    assert s["stragglers"] == []  # a slow link is not more work: no straggler

    healthy = _summary(live_server, _rid(live_server, "healthy"))["network"]
    assert healthy["slow_ranks"] == [] and healthy["slow_nodes"] == [] and healthy["ranks_measured"] == 32
    strag = _summary(live_server, _rid(live_server, "straggler"))
    assert strag["stragglers"][0]["rank"] == 9 and strag["network"]["slow_nodes"] == []

    r = httpx.get(f"{live_server.url}/api/v1/nodes", timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["refreshed_runs"] == 2 and body["pending_runs"] == 0  # the two runs no summary was asked of
    nodes = body["nodes"]
    assert body["total"] == len(nodes) == 4
    first, second = nodes[0], nodes[1]
    assert first["node"] == SLOW and first["runs"] == 5 and first["slow_network_runs"] == 3
    assert first["straggler_runs"] == 0 and first["slowed_runs"] == 3 and first["slowed_share"] == 0.6
    assert first["busbw_ratio_median"] == pytest.approx(0.5, abs=0.1) and first["last_seen"]
    assert second["node"] == "node0001" and second["straggler_runs"] == 1 and second["slow_network_runs"] == 0
    assert all(n["slowed_runs"] == 0 and n["busbw_ratio_median"] == pytest.approx(1.0, abs=0.15) for n in nodes[2:])

    one = httpx.get(f"{live_server.url}/api/v1/nodes/{SLOW}").json()
    assert one["node"] == SLOW and len(one["run_history"]) == 5
    assert sorted(h["name"] for h in one["run_history"] if h["slow_network"]) == ["slow-2", "slow-3", "slow-a"]
    assert httpx.get(f"{live_server.url}/api/v1/nodes/nope").status_code == 404

    # the blocks of a run are removed later (retention) and the run changes: what was measured stays
    rid = _rid(live_server, "slow-2")
    with live_server.state.engine.begin() as c:
        c.execute(text("UPDATE steps SET coll_block = NULL WHERE run_id = :r"), {"r": rid})
        c.execute(text("UPDATE runs SET status = 'failed' WHERE id = :r"), {"r": rid})
    reports.clear_caches()
    again = httpx.get(f"{live_server.url}/api/v1/nodes").json()
    assert again["refreshed_runs"] == 1 and again["nodes"][0]["node"] == SLOW
    assert again["nodes"][0]["slow_network_runs"] == 3
    assert _summary(live_server, rid)["network"]["slow_nodes"] == []  # the run itself has nothing left to show

    # a deleted run leaves the history
    assert httpx.delete(f"{live_server.url}/api/v1/runs/{_rid(live_server, 'slow-a')}",
                        headers={"Authorization": f"Bearer {live_server.token}"}).status_code == 200
    after = httpx.get(f"{live_server.url}/api/v1/nodes").json()["nodes"][0]
    assert after["node"] == SLOW and after["runs"] == 4 and after["slow_network_runs"] == 2

    # a read brings runs up to date within a time budget: past it, the rest waits for the next reads
    from fleetscope.server.reports.nodes import refresh_node_health

    with live_server.state.engine.begin() as c:
        c.execute(text("DELETE FROM run_node_health"))
    reports.clear_caches()
    assert refresh_node_health(live_server.state.engine, budget_s=0.0) == (1, 3)  # one run of 4, however slow
    assert refresh_node_health(live_server.state.engine, budget_s=600.0) == (3, 0)


def test_bad_input_is_refused_naming_the_field(live_server: Any) -> None:
    r = httpx.get(f"{live_server.url}/api/v1/nodes", params={"limit": 0})
    assert r.status_code == 422 and "limit" in r.text
    r = httpx.get(f"{live_server.url}/api/v1/nodes/x", params={"runs": "many"})
    assert r.status_code == 422 and "runs" in r.text
    srv = ["--server", live_server.url, "--token", live_server.token]
    for bad, msg in (("node0002", "NODE=FACTOR"), ("node0002=0", "FACTOR > 0"), ("node0002=x", "NODE=FACTOR"),
                     ("node0009=2", "not a node of this run")):
        out = CliRunner().invoke(app, ["simulate", *srv, "--run", "bad", "--family", "vla-7b", "--ranks", "16",
                                       "--steps", "2", "--slow-node", bad])
        assert out.exit_code == 2 and "--slow-node" in out.output and msg in out.output, out.output
    assert httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "bad"}).json()["runs"] == []
    # no runs: an empty history, and a run without collectives has an empty network
    assert httpx.get(f"{live_server.url}/api/v1/nodes").json() == {
        "nodes": [], "total": 0, "slowed_total": 0, "slow_network_total": 0, "limit": 500, "offset": 0,
        "refreshed_runs": 0, "pending_runs": 0}
    rid = load(live_server, RunSpec(name="no-coll", family="vit-h", world_size=4, steps=5), collectives=False)
    net = _summary(live_server, rid)["network"]
    assert net["slow_ranks"] == [] and net["slow_nodes"] == [] and net["ranks_measured"] == 0 and net["source"] is None
    (n,) = httpx.get(f"{live_server.url}/api/v1/nodes").json()["nodes"]
    assert n["node"] == "node0000" and n["runs"] == 1 and n["busbw_ratio_median"] is None and n["slowed_runs"] == 0


def test_readers_saving_the_same_runs_rows_at_once_all_succeed(live_server: Any) -> None:
    import threading

    from fleetscope.server.store import nodes as node_store

    rid = load(live_server, RunSpec(name="race", family="vit-h", world_size=8, steps=3, gpus_per_node=2))
    eng = live_server.state.engine
    rows = [{"node": f"node{k:04d}", "ranks": 2, "straggler_ranks": 0, "slow_ranks": k % 2, "slow_network": k == 1,
             "busbw_ratio": 1.0 - k / 10, "latency_ratio": 1.0} for k in range(4)]
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(10):
                node_store.save_node_health(eng, rid, 24, "running", rows[: 2 + (i % 3)])
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    node_store.save_node_health(eng, rid, 24, "running", rows[:3])  # a node no longer in the run is dropped
    with eng.connect() as c:
        got = c.execute(text("SELECT node, slow_network FROM run_node_health WHERE run_id = :r ORDER BY node"),
                        {"r": rid}).fetchall()
    assert [tuple(g) for g in got] == [("node0000", False), ("node0001", True), ("node0002", False)]


def test_the_sample_is_every_kth_compacted_step_from_the_latest_whatever_the_step_numbers(live_server: Any) -> None:
    """Odd step numbers only (1, 3, …, 499) and a stride of 2: every other stored step, the latest in."""
    from analysis_util import field_index
    from fleetscope.server.reports.network import sample_plan
    from fleetscope.server.store import nodes as node_store
    from fleetscope.server.store import runs as run_store

    i_step = field_index("step")

    def odd(step: int, rows: list[tuple]) -> list[tuple]:
        return [r[:i_step] + (2 * step + 1,) + r[i_step + 1:] for r in rows]

    def odd_coll(step: int, rows: list[tuple]) -> list[tuple]:
        return [r[:1] + (2 * step + 1,) + r[2:] for r in rows]

    rid = load(live_server, RunSpec(name="odd", family="vit-h", world_size=8, steps=250, gpus_per_node=2,
                                    slow_nodes={"node0001": 2.0}), transform=odd, coll_transform=odd_coll)
    run = run_store.get_run(live_server.state.engine, rid, pending=False)
    assert run is not None and run.steps == 250 and sample_plan(run) == (2, 200)
    blocks = node_store.sampled_comm_blocks(live_server.state.engine, rid, stride=2, limit=200)
    assert [s for s, _ in blocks] == list(range(3, 500, 4))
    net = _summary(live_server, rid)["network"]
    assert net["source"] == "125 steps sampled (every 2)" and [n["node"] for n in net["slow_nodes"]] == ["node0001"]
