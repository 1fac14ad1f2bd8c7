"""Bounds of server/limits.py that only the agent used to keep, through the real server over HTTP: a
client that is not our agent sends 100,000 phase names, 200,000 collectives in one rank-step, 100,000
node names, a trace summary of 5,000 kernels — ingest refuses (422 naming the limit) or folds and
counts, and every read stays bounded whatever is stored (payload sizes, row counts, the server's RSS
growth; no timing assertions)."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from fleetscope.server.limits import (
    MAX_COLLECTIVES_PER_RANK_STEP,
    MAX_KERNELS_PER_TRACE,
    MAX_NODES_PER_RUN,
    MAX_PAGE_ROWS,
    MAX_PHASE_NAMES_PER_RUN,
)
from fleetscope.server.store.bounds import OVERFLOW_PHASE
from sqlalchemy import text

from fleetscope.client import ApiError

TS0 = 1.7e9
RSS_CEILING = 256 << 20  # bytes the server may grow by for one read (generous: real use is far less)


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)  # the live server runs in this process (uvicorn thread)


def _get(srv: Any, path: str, **params: Any) -> httpx.Response:
    r = httpx.get(f"{srv.url}{path}", params=params, timeout=300)
    assert r.status_code == 200, r.text[:500]
    return r


def _rank_steps(steps: Iterable[int], ranks: Sequence[int] = (0,), *, phases: bool = True) -> dict[str, list[Any]]:
    pairs = [(s, r) for s in steps for r in ranks]
    k = len(pairs)
    cols = {"rank": [r for _, r in pairs], "step": [s for s, _ in pairs], "step_s": [1.0] * k,
            "ts": [TS0 + s for s, _ in pairs], "data_s": [0.1] * k, "compute_s": [0.7] * k, "comm_exposed_s": [0.0] * k}
    if phases:
        cols |= {"forward_s": [0.2] * k, "backward_s": [0.4] * k}
    return cols


def _folded(srv: Any, rid: int) -> dict[str, int]:
    return _get(srv, f"/api/v1/runs/{rid}/summary").json()["folded"]


# ------------------------------------------------------------------------------------------ phases


def test_the_agents_overflow_name_is_the_servers() -> None:
    from fleetscope.agent.run import MAX_CUSTOM_PHASES
    from fleetscope.agent.run import OVERFLOW_PHASE as AGENT_OVERFLOW

    assert AGENT_OVERFLOW == OVERFLOW_PHASE and MAX_CUSTOM_PHASES == MAX_PHASE_NAMES_PER_RUN


def test_100k_phase_names_across_batches_and_servers_fold_into_the_overflow_phase(live_server: Any) -> None:
    """10 batches of 10,000 names each (1,000 per step, 0.001 s each), half through a second server
    instance on the same database: the run keeps 32 names, the rest fold into ``other_phases`` with
    their seconds, counted; the summary lists at most 33 phases."""
    from conftest import start_server

    other = start_server(live_server.db_url)
    try:
        with live_server.client() as c, other.client(live_server.token) as c2:
            rid = c.register_run({"name": "phase-flood", "world_size": 1})
            for b in range(10):
                steps = range(10 * b, 10 * b + 10)
                names = [(s, f"p{s:03d}_{j:04d}") for s in steps for j in range(1000)]
                batch = {"v": 1, "run_id": rid, "rank_steps": _rank_steps(steps, phases=False),
                         "phases": {"rank": [0] * len(names), "step": [s for s, _ in names],
                                    "phase": [n for _, n in names], "seconds": [0.001] * len(names)}}
                (c if b < 5 else c2).ingest(batch)
                (live_server if b < 5 else other).compact()
            live_server.compact()
        phases = _get(live_server, f"/api/v1/runs/{rid}/summary").json()["phases"]
        assert len(phases) == MAX_PHASE_NAMES_PER_RUN + 1 and OVERFLOW_PHASE in phases  # no forward/backward sent
        # every name of every step but the first folds: the overflow's median step carries a whole second
        assert phases[OVERFLOW_PHASE] == pytest.approx(1.0, rel=1e-6)
        assert _folded(live_server, rid)["phase_names"] == 100_000 - MAX_PHASE_NAMES_PER_RUN
        with live_server.state.engine.connect() as conn:
            n_names, total = conn.execute(text("SELECT count(DISTINCT phase), sum(seconds) FROM run_phases "
                                               "WHERE run_id = :r"), {"r": rid}).one()
            kept = conn.execute(text("SELECT count(*) FROM run_names WHERE run_id = :r AND kind = 'phase'"),
                                {"r": rid}).scalar()
        assert n_names == MAX_PHASE_NAMES_PER_RUN + 1 and kept == MAX_PHASE_NAMES_PER_RUN
        assert float(total) == pytest.approx(100.0, rel=1e-9)  # no second lost
        # the run page says so, above everything
        from fleetscope.dashboard import _state
        from fleetscope.dashboard.pages import run as run_page

        old = _state.engine
        try:
            _state.engine = lambda: live_server.state.engine  # type: ignore[assignment]
            flat = str(run_page.layout(run_id=str(rid)).to_plotly_json())
        finally:
            _state.engine = old  # type: ignore[assignment]
        assert "run-folded" in flat and f"{100_000 - MAX_PHASE_NAMES_PER_RUN:,} phase records beyond" in flat
    finally:
        other.stop()


def test_the_phase_read_is_bounded_whatever_is_stored(live_server: Any) -> None:
    """Rows an older server stored without the bound (500 names, the overflow the smallest): the summary
    lists the 32 biggest and the overflow."""
    with live_server.client() as c:
        rid = c.register_run({"name": "phase-legacy", "world_size": 1})
        c.ingest({"v": 1, "run_id": rid, "rank_steps": _rank_steps(range(3))})
        live_server.compact()
    with live_server.state.engine.begin() as conn:
        conn.execute(text("INSERT INTO run_phases (run_id, step, phase, seconds, ranks) VALUES (:r, :s, :p, :v, '1')"),
                     [{"r": rid, "s": s, "p": f"legacy{i:03d}", "v": 0.001 * (i + 1)} for i in range(500) for s in range(3)]
                     + [{"r": rid, "s": 0, "p": OVERFLOW_PHASE, "v": 1e-6}])
    phases = _get(live_server, f"/api/v1/runs/{rid}/summary").json()["phases"]
    custom = {k: v for k, v in phases.items() if k not in ("forward", "backward", "optimizer")}
    assert len(custom) == MAX_PHASE_NAMES_PER_RUN + 1 and OVERFLOW_PHASE in custom
    assert {f"legacy{i:03d}" for i in range(500 - MAX_PHASE_NAMES_PER_RUN, 500)} == set(custom) - {OVERFLOW_PHASE}
    assert list(custom)[-1] == OVERFLOW_PHASE  # biggest first


# ------------------------------------------------------------------------------------- collectives


def _colls(step: int, rank: int, seqs: range) -> dict[str, list[Any]]:
    n = len(seqs)
    return {"rank": [rank] * n, "step": [step] * n, "seq": list(seqs), "op": ["all_reduce"] * n, "group_size": [2] * n,
            "bytes": [1 << 20] * n, "calls": [1] * n, "total_s": [1e-5 * (1 + i % 7) for i in seqs],
            "exposed_s": [0.0] * n, "start_ts": [TS0 + step + 0.5 + 1e-6 * i for i in seqs]}


@pytest.fixture
def quiet_server(db_url: str) -> Iterator[Any]:
    """A live server whose background compactor does not run (an hour between passes): only the test's
    forced passes compact, so which batches one pass sees does not depend on timing (a complete step is
    folded by the next background pass, which could otherwise land between two of the test's batches)."""
    from conftest import start_server

    srv = start_server(db_url, compact_interval_s=3600.0)
    yield srv
    srv.stop()


def test_collectives_of_one_rank_step_are_refused_beyond_the_cap_and_capped_across_batches(quiet_server: Any) -> None:
    live_server = quiet_server
    eng = live_server.state.engine
    with live_server.client() as c:
        rid = c.register_run({"name": "coll-flood", "world_size": 2})
        # 200,000 collectives of one rank-step in one batch: refused whole, naming the limit and the rank-step
        with pytest.raises(ApiError) as e:
            c.ingest({"v": 1, "run_id": rid, "rank_steps": _rank_steps([0], [0, 1]), "collectives": _colls(0, 1, range(200_000))})
        assert e.value.status == 422
        msg = str(e.value.detail)
        assert "MAX_COLLECTIVES_PER_RANK_STEP" in msg and str(MAX_COLLECTIVES_PER_RANK_STEP) in msg
        assert "step 0, rank 1" in msg and "200000" in msg
        assert e.value.detail["loc"] == {"section": "collectives", "index": MAX_COLLECTIVES_PER_RANK_STEP, "field": "seq"}
        live_server.compact()
        assert c.get(f"/api/v1/runs/{rid}")["collective_records"] == 0  # nothing of it written
        # exactly the cap: accepted, every record kept
        got = c.ingest({"v": 1, "run_id": rid, "rank_steps": _rank_steps([0], [0, 1]),
                        "collectives": _colls(0, 1, range(MAX_COLLECTIVES_PER_RANK_STEP))})
        assert got["accepted"]["collectives"] == MAX_COLLECTIVES_PER_RANK_STEP
        # step 1, rank 0: 12,000 records in three batches under the cap each; the compactor keeps the cap:
        # the stored ones first (one pass), then the new ones in seq order (the next pass takes two batches)
        c.ingest({"v": 1, "run_id": rid, "rank_steps": _rank_steps([1], [0, 1]), "collectives": _colls(1, 0, range(0, 4000))})
        live_server.compact()
        c.ingest({"v": 1, "run_id": rid, "collectives": _colls(1, 0, range(8000, 12_000))})
        c.ingest({"v": 1, "run_id": rid, "collectives": _colls(1, 0, range(4000, 8000))})
        live_server.compact()
        run = c.get(f"/api/v1/runs/{rid}")
    assert run["collective_records"] == 2 * MAX_COLLECTIVES_PER_RANK_STEP
    assert _folded(live_server, rid)["collectives"] == 12_000 - MAX_COLLECTIVES_PER_RANK_STEP
    from fleetscope.server.codec import COLL_BLOCK_FIELDS, decode_block

    with eng.connect() as conn:
        blk, n = conn.execute(text("SELECT coll_block, coll_records FROM steps WHERE run_id = :r AND step = 1"),
                              {"r": rid}).one()
    seq = np.sort(decode_block(COLL_BLOCK_FIELDS, blk)["seq"])
    assert n == len(seq) == MAX_COLLECTIVES_PER_RANK_STEP and (seq == np.arange(MAX_COLLECTIVES_PER_RANK_STEP)).all()

    for step, rank in ((0, 1), (1, 0)):
        r = _get(live_server, f"/api/v1/runs/{rid}/overlap", step=step, rank=rank)
        d = r.json()
        assert len(r.content) < 2_000_000
        assert d["collectives_total"] == MAX_COLLECTIVES_PER_RANK_STEP and len(d["collectives"]) == MAX_PAGE_ROWS
        assert sum(g["records"] for g in d["collectives_folded"]) == MAX_COLLECTIVES_PER_RANK_STEP - MAX_PAGE_ROWS
        assert len(d["collectives_folded"]) <= 20
        # the longest are listed (1e-5 × 7 s first), in record order; the folded rows keep the bytes
        assert min(x["end_s"] - x["start_s"] for x in d["collectives"]) >= max(
            g["total_s"] / g["records"] for g in d["collectives_folded"]) - 1e-9
        starts = [x["start_s"] for x in d["collectives"]]
        assert starts == sorted(starts)
        assert (sum(x["bytes"] for x in d["collectives"]) + sum(g["bytes"] for g in d["collectives_folded"])
                == MAX_COLLECTIVES_PER_RANK_STEP * (1 << 20))
    small = _get(live_server, f"/api/v1/runs/{rid}/overlap", step=1, rank=0, limit=10).json()
    assert len(small["collectives"]) == 10 and small["overlap_ratio"] == d["overlap_ratio"]  # figures over all
    bad = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/overlap", params={"limit": MAX_PAGE_ROWS + 1})
    assert bad.status_code == 422 and "limit" in bad.text

    # whatever is stored: a block an older server wrote with 50,000 records of one rank-step
    from fleetscope.server.codec import encode_block

    k = 50_000
    big = {"rank": np.zeros(k, dtype=np.int64), "seq": np.arange(k), "op": np.zeros(k, dtype=np.int64),
           "group_size": np.full(k, 2), "bytes": np.full(k, 1024.0), "calls": np.ones(k, dtype=np.int64),
           "total_s": np.full(k, 1e-5), "exposed_s": np.zeros(k), "start_ts": TS0 + 1.5 + 1e-7 * np.arange(k),
           "dim": np.zeros(k, dtype=np.int64)}
    with eng.begin() as conn:
        conn.execute(text("UPDATE steps SET coll_block = :b WHERE run_id = :r AND step = 1"),
                     {"b": encode_block(COLL_BLOCK_FIELDS, {n: big[n] for n, _ in COLL_BLOCK_FIELDS}), "r": rid})
    before = _rss()
    r = _get(live_server, f"/api/v1/runs/{rid}/overlap", step=1, rank=0)
    grew = _rss() - before
    assert len(r.content) < 2_000_000 and grew < RSS_CEILING, (len(r.content), grew)
    d = r.json()
    assert d["collectives_total"] == MAX_COLLECTIVES_PER_RANK_STEP and len(d["collectives"]) == MAX_PAGE_ROWS


# ------------------------------------------------------------------------------------------- nodes


def test_100k_node_names_keep_the_cap_and_the_node_list_is_paged(live_server: Any) -> None:
    eng = live_server.state.engine
    n = 100_000
    with live_server.client() as c:
        rid = c.register_run({"name": "node-flood", "world_size": n})
        for lo, hi in ((0, 60_000), (60_000, n)):  # across batches
            c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": i, "host": f"h{i:06d}", "local_rank": 0}
                                                       for i in range(lo, hi)]})
        c.ingest({"v": 1, "run_id": rid, "rank_steps": _rank_steps([0], [0, 1])})
        live_server.compact()
    with eng.connect() as conn:
        ranks, named, hosts, local = conn.execute(text(
            "SELECT count(*), count(host), count(DISTINCT host), count(local_rank) FROM ranks WHERE run_id = :r"),
            {"r": rid}).one()
    assert ranks == local == n  # every rank's record kept, ...
    assert named == hosts == MAX_NODES_PER_RUN  # ... the names beyond the cap dropped
    before = _rss()
    summary = _get(live_server, f"/api/v1/runs/{rid}/summary")  # the run's network over 100,000 ranks, its node rows
    grew = _rss() - before
    assert grew < RSS_CEILING and len(summary.content) < 2_000_000, (grew, len(summary.content))
    assert summary.json()["folded"]["node_names"] == n - MAX_NODES_PER_RUN
    # a name already kept is kept again; a new one is still dropped
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": 1, "host": "h000001"}, {"rank": 70_000, "host": "new"}]})
    with eng.connect() as conn:
        assert conn.execute(text("SELECT host FROM ranks WHERE run_id = :r AND rank IN (1, 70000) ORDER BY rank"),
                            {"r": rid}).scalars().all() == ["h000001", None]

    before = _rss()
    r = _get(live_server, "/api/v1/nodes")
    grew = _rss() - before
    body = r.json()
    assert grew < RSS_CEILING, grew
    assert body["total"] == MAX_NODES_PER_RUN and len(body["nodes"]) == 500
    assert body["limit"] == 500 and body["offset"] == 0
    big = _get(live_server, "/api/v1/nodes", limit=10_000).json()  # an old client's large limit: clamped
    assert len(big["nodes"]) == big["limit"] == MAX_PAGE_ROWS and big["total"] == MAX_NODES_PER_RUN
    assert len(_get(live_server, "/api/v1/nodes", limit=10_000).content) < 2_000_000
    page2 = _get(live_server, "/api/v1/nodes", limit=500, offset=500).json()
    assert [x["node"] for x in page2["nodes"]] == [x["node"] for x in big["nodes"][500:1000]]
    tail = _get(live_server, "/api/v1/nodes", limit=500, offset=MAX_NODES_PER_RUN - 10).json()
    assert len(tail["nodes"]) == 10 and tail["total"] == MAX_NODES_PER_RUN
    assert _get(live_server, "/api/v1/nodes", offset=10**6).json()["nodes"] == []
    assert httpx.get(f"{live_server.url}/api/v1/nodes", params={"offset": -1}).status_code == 422

    # the Cluster page: a bounded table that says how many it shows
    outputs = [("cluster-kpis", "children"), ("cluster-chart", "figure"), ("cluster-table", "children"),
               ("cluster-detail", "children")]
    out = [{"id": i, "property": p} for i, p in outputs]
    httpx.get(f"{live_server.url}/", timeout=60)
    before = _rss()
    res = httpx.post(f"{live_server.url}/_dash-update-component", timeout=300, json={
        "output": ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..", "outputs": out,
        "inputs": [{"id": "cluster-node", "property": "value", "value": None}],
        "changedPropIds": ["cluster-node.value"], "state": []})
    grew = _rss() - before
    assert res.status_code == 200, res.text[:500]
    assert len(res.content) < 2_000_000 and grew < RSS_CEILING, (len(res.content), grew)
    from dash_util import find, texts
    from fleetscope.dashboard.pages.cluster import TABLE_NODES

    table = res.json()["response"]["cluster-table"]["children"]
    assert f"Showing the {TABLE_NODES:,} worst of {MAX_NODES_PER_RUN:,} nodes" in " ".join(texts(table)), res.text[:2000]
    assert len(find(table, "cluster-nodes")["props"]["children"][1]["props"]["children"]) == TABLE_NODES


# ----------------------------------------------------------------------------------------- kernels


def test_a_trace_summary_keeps_the_top_kernels_and_sums_the_rest(live_server: Any) -> None:
    n = 5000
    rows = [{"kernel_type": "COMPUTATION", "name": f"void gemm_kernel_{i:05d}(float*)", "count": 2, "sum_us": float(i + 1),
             "max_us": 1.0, "min_us": 1.0, "mean_us": 1.0, "std_us": 0.0} for i in range(n)]
    rows.append({"kernel_type": "COMMUNICATION", "name": "others", "count": 7, "kernels": 3, "sum_us": 5.5})
    with live_server.client() as c:
        rid = c.register_run({"name": "kernel-flood", "world_size": 2})
        r = c.http.post(f"/api/v1/runs/{rid}/traces", json={"ranks": {"0": {"source": "r0.json", "top_kernels": rows}}})
        assert r.status_code == 200, r.text[:500]
        traces = c.get(f"/api/v1/runs/{rid}/traces")["traces"]
    (s,) = [t["summary"] for t in traces if t["rank"] == 0]
    top = s["top_kernels"]
    named = [k for k in top if k["name"] != "others"]
    assert len(named) == MAX_KERNELS_PER_TRACE and len(top) == MAX_KERNELS_PER_TRACE + 2  # + COMPUTATION, COMMUNICATION
    assert {k["sum_us"] for k in named} == {float(i + 1) for i in range(n - MAX_KERNELS_PER_TRACE, n)}  # the longest
    assert sum(k["sum_us"] for k in top) == pytest.approx(sum(k["sum_us"] for k in rows))  # totals preserved
    assert sum(k["count"] for k in top) == sum(k["count"] for k in rows)
    other = {k["kernel_type"]: k for k in top if k["name"] == "others"}
    assert other["COMPUTATION"]["kernels"] == n - MAX_KERNELS_PER_TRACE and other["COMMUNICATION"]["kernels"] == 3
    assert _folded(live_server, rid)["kernels"] == n - MAX_KERNELS_PER_TRACE

    # the kernels endpoint over the agent's sampled windows: bounded by the per-run name bound and `top`
    from fleetscope.server.analysis.kernels import CATEGORIES, MAX_NAMES

    evs = [{"rank": r, "seq": 100 + w, "kind": "trace_summary", "ts": TS0 + w, "step": 10 * w,
            "data": {"first_step": 10 * w, "active_steps": 2, "summary": {"top_kernels": [
                {"kernel_type": "COMPUTATION", "name": f"k{w}_{j:03d}", "count": 1, "sum_us": float(j + 1)}
                for j in range(100)]}}} for r in range(2) for w in range(4)]
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": evs})
        rep = c.get(f"/api/v1/runs/{rid}/kernels", top=200)
    assert rep["windows"] == 8 and rep["names"] <= MAX_NAMES + len(CATEGORIES) and len(rep["kernels"]) <= 200
    assert rep["kernel_us"] == pytest.approx(8 * sum(range(1, 101)))  # every window's time, folded or not


def test_the_trace_read_stops_at_its_byte_budget(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /runs/{id}/traces`` returns summaries up to READ_BUDGET_BYTES of stored JSON, never more
    (rows beyond it wait for a narrower read), whatever size the stored summaries have."""
    from fleetscope.server.store import traces as trace_store

    rows = [{"kernel_type": "COMPUTATION", "name": f"void k{i:04d}(float*)", "count": 1, "sum_us": float(i + 1),
             "max_us": 1.0, "min_us": 1.0, "mean_us": 1.0, "std_us": 0.0} for i in range(MAX_KERNELS_PER_TRACE)]
    with live_server.client() as c:
        rid = c.register_run({"name": "trace-budget", "world_size": 4})
        for r in range(4):
            res = c.http.post(f"/api/v1/runs/{rid}/traces",
                              json={"ranks": {str(r): {"source": f"r{r}.json", "top_kernels": rows}}})
            assert res.status_code == 200, res.text[:300]
        assert sorted(t["rank"] for t in c.get(f"/api/v1/runs/{rid}/traces")["traces"] if t["rank"] >= 0) == [0, 1, 2, 3]
        with live_server.state.engine.connect() as conn:
            from sqlalchemy import text

            sizes = [int(x) for (x,) in conn.execute(text(
                "SELECT pg_column_size(summary) FROM trace_summaries WHERE run_id = :r AND rank >= 0 ORDER BY rank"),
                {"r": rid})]
        monkeypatch.setattr(trace_store, "READ_BUDGET_BYTES", sum(sizes[:2]) + sizes[2] // 2)  # two and a half
        got = [t["rank"] for t in c.get(f"/api/v1/runs/{rid}/traces")["traces"] if t["rank"] >= 0]
    assert got[:2] == [0, 1] and 2 not in got and 3 not in got
