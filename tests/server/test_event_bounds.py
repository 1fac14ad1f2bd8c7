"""Bounds on what a run stores as events (server/limits.py; docs/security.md, "Bounds on what a run
stores"), through the real server over loopback HTTP: a record kind that is not a string is a 422 on
a connection that stays open; process groups are stored once per group (a 16,384-rank job's groups
cost kilobytes) and the summary's node spans come from them; events beyond a run's caps are dropped
and counted (also with two server instances) while the rest of the batch lands; histogram and pipeline
sizes out of range are refused, long reasons are cut; and the largest payloads a run may hold give a
summary and a run page in bounded memory, whatever an older server stored."""

from __future__ import annotations

import http.client
import json
import threading
import time
import tracemalloc
from typing import Any
from urllib.parse import urlparse

import numpy as np
import psutil
import pytest
from conftest import start_server
from fleetscope.server import reports
from fleetscope.server.limits import (
    MAX_EVENT_VALUES,
    MAX_EVENTS_PER_KIND,
    MAX_EVENTS_PER_RUN,
    MAX_GROUP_RANKS_LISTED,
    MAX_GROUPS_PER_RUN,
    MAX_HIST_BINS,
    MAX_PIPELINE_STAGES,
    MAX_REASON_CHARS,
)
from sqlalchemy import text

from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

CEILING_MIB = 256
_STEP_NAMES = [f.name for f in RANK_STEP_FIELDS]


def _ev(rank: int, seq: int, kind: str, data: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "kind": kind, "ts": 1.7e9, "step": step, "data": data}


def _run(c: Any, name: str, world: int) -> int:
    return int(c.register_run({"name": name, "model_family": "f", "world_size": world}))


def _q(srv: Any, sql: str, **params: Any) -> Any:
    with srv.app.state.fs.engine.connect() as c:
        return c.execute(text(sql), params).fetchall()


def _step_row(rank: int, step: int, step_s: float, exposed: float) -> tuple:
    row: list[Any] = [None] * len(RANK_STEP_FIELDS)
    row[0], row[1] = rank, step
    row[_STEP_NAMES.index("step_s")] = step_s
    row[_STEP_NAMES.index("ts")] = 1.7e9 + step
    row[_STEP_NAMES.index("compute_s")] = step_s - exposed
    row[_STEP_NAMES.index("comm_exposed_s")] = exposed
    row[_STEP_NAMES.index("other_s")] = 0.0
    return tuple(row)


def _steps_batch(rid: int, ranks: list[int], step: int) -> dict[str, Any]:
    return {"rank": ranks, "step": [step] * len(ranks), "step_s": [0.1] * len(ranks), "ts": [1.7e9 + step] * len(ranks)}


def _post(conn: http.client.HTTPConnection, token: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    conn.request("POST", "/api/v1/ingest", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    return r.status, json.loads(r.read()), r.getheader("connection")


# --------------------------------------------------------------------------- kind not a string


def test_a_record_kind_that_is_not_a_string_is_a_422_naming_it_and_the_connection_stays_open(live_server: Any) -> None:
    with live_server.client() as c:
        rid = _run(c, "kinds", 4)
    u = urlparse(live_server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        status, _, _ = _post(conn, live_server.token, {"v": 1, "run_id": rid, "records": [
            {"kind": "rank_step", "rank": 0, "step": 0, "step_s": 0.1}]})
        assert status == 200
        sock = conn.sock
        bad_records = [
            ({"records": [{"kind": "rank_step", "rank": 0, "step": 1, "step_s": 0.1}, {"kind": ["rank_step"], "rank": 0}]},
             "records[1].kind", "records"),
            ({"records": [{"kind": {"a": 1}, "rank": 0}]}, "records[0].kind", "records"),
            ({"records": [{"kind": 7}]}, "records[0].kind", "records"),
            ({"records": [{"kind": "event", "event": ["note"], "rank": 0, "seq": 1}]}, "records[0].event", "records"),
            ({"events": [_ev(0, 1, ["note"], {})]}, "events[0].kind", "events"),  # type: ignore[arg-type]
            ({"events": [_ev(0, 1, {"k": "note"}, {})]}, "events[0].kind", "events"),  # type: ignore[arg-type]
        ]
        for extra, where, section in bad_records:
            status, body, connection = _post(conn, live_server.token, {"v": 1, "run_id": rid, **extra})
            assert status == 422, body
            assert body["detail"]["where"] == where and body["detail"]["loc"]["section"] == section
            assert (connection or "").lower() != "close"
            assert conn.sock is sock  # http.client drops the socket when the server closes it
        # the same connection carries the next batch
        status, body, _ = _post(conn, live_server.token, {"v": 1, "run_id": rid, "records": [
            {"kind": "rank_step", "rank": 1, "step": 0, "step_s": 0.1}, {"kind": "event", "event": "note", "rank": 0, "seq": 0}]})
        assert status == 200 and body["accepted"]["rank_steps"] == 1 and body["accepted"]["events"] == 1
        assert conn.sock is sock
    finally:
        conn.close()
    assert _q(live_server, "SELECT kind FROM run_events WHERE run_id = :r", r=rid) == [("note",)]


# --------------------------------------------------------------------------- groups: once per group


TP, DP, WORLD = 8, 2048, 16_384


def _node(rank: int) -> str:
    return f"node{rank // 8:05d}"  # 8 GPUs per node: a TP group is one node, a DP group spans 2048


def _group_events(ranks: range) -> list[dict[str, Any]]:
    """Every rank's descriptions of its TP and DP groups, as an agent sends them: TP listed by half of
    the ranks (8 ranks) and as start/stride by the other half, DP (2048 ranks) as start/stride."""
    out = []
    for r in ranks:
        t0 = r - r % TP
        tp = {"dim": "tp", "size": TP, "group": f"tp{t0}"}
        tp.update({"ranks": list(range(t0, t0 + TP))} if r % 2 else {"start": t0, "stride": 1})
        out.append(_ev(r, 0, "comm_group", tp))
        out.append(_ev(r, 1, "comm_group", {"dim": "dp", "size": DP, "start": r % TP, "stride": TP, "group": f"dp{r % TP}"}))
    return out


def test_a_16384_rank_jobs_groups_are_stored_once_each_and_give_the_node_spans(live_server: Any) -> None:
    srv = live_server
    with srv.client() as c:
        rid = _run(c, "groups-16k", WORLD)
        for lo in range(0, WORLD, 8192):
            c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "host": _node(r), "node": _node(r)}
                                                        for r in range(lo, lo + 8192)]})
        accepted = 0
        for lo in range(0, WORLD, 2048):
            accepted += c.ingest({"v": 1, "run_id": rid, "events": _group_events(range(lo, lo + 2048))})["accepted"]["events"]
        assert accepted == 2 * WORLD  # every description is kept: its group is stored
        again = c.ingest({"v": 1, "run_id": rid, "events": _group_events(range(0, 2048))})  # a re-sent batch
        assert again["accepted"]["events"] == 2 * 2048
        # a few ranks' steps with TP and DP collectives, so that the summary has those dimensions
        steps, colls = [], []
        for s in range(3):
            for r in range(16):
                steps.append(_step_row(r, s, 1.0, 0.3))
                colls.append((r, s, 0, "all_reduce", TP, 1 << 20, 1, 0.15, 0.1, 1.7e9 + s, "tp"))
                colls.append((r, s, 1, "all_reduce", DP, 1 << 24, 1, 0.25, 0.2, 1.7e9 + s, "dp"))
        assert len(COLLECTIVE_FIELDS) == len(colls[0])
        c.ingest_rows(rid, steps, colls)
        srv.compact()
        summary = c.summary(rid)

    rows = _q(srv, "SELECT dim, count(*), count(*) FILTER (WHERE ranks IS NULL AND start IS NOT NULL), min(size), "
                   "max(size), sum(pg_column_size(g.*)) FROM run_groups g WHERE run_id = :r GROUP BY dim ORDER BY dim", r=rid)
    by_dim = {d: (n, ap, lo, hi, int(b)) for d, n, ap, lo, hi, b in rows}
    assert by_dim["tp"][:4] == (WORLD // TP, WORLD // TP, TP, TP)  # one row per group, as a progression
    assert by_dim["dp"][:4] == (TP, TP, DP, DP)
    row_bytes = sum(v[4] for v in by_dim.values())
    table_bytes = _q(srv, "SELECT pg_total_relation_size('run_groups')")[0][0]
    events_rows = _q(srv, "SELECT count(*) FROM run_events WHERE run_id = :r", r=rid)[0][0]
    print(f"run_groups: {WORLD // TP + TP} rows, {row_bytes} B of rows, {table_bytes} B with its index")
    assert row_bytes < 200 * (WORLD // TP + TP)  # < 200 B per group, whatever its size
    assert table_bytes < 1 << 20
    assert events_rows == 0  # comm_group descriptions are not run events any more
    counts = dict(_q(srv, "SELECT kind, stored FROM run_event_counts WHERE run_id = :r", r=rid))
    assert counts == {"comm_group": WORLD // TP + TP}

    dims = summary["comm_by_dim"]
    assert dims["tp"]["nodes"] == 1 and dims["dp"]["nodes"] == WORLD // 8
    assert dims["dp"]["exposed_s"] == pytest.approx(0.2) and dims["tp"]["exposed_s"] == pytest.approx(0.1)
    dp_finding = next(f["finding"] for f in summary["parallel_findings"] if f["dim"] == "dp")
    assert f"spans {WORLD // 8} nodes" in dp_finding
    assert summary["folded"]["events_dropped"] == {} and summary["folded"]["events_folded"] == {}


def test_listed_groups_old_agents_truncated_lists_and_an_older_servers_rows_give_spans(live_server: Any) -> None:
    """A group that is no progression is stored as its compressed rank list; an older agent's first-256
    list of a larger group is kept as listed (a lower bound on its span); a run stored before
    run_groups reads the comm_group events an older server kept, bounded."""
    srv = live_server
    world = 4096
    rng = np.random.default_rng(7)
    odd = sorted(int(x) for x in rng.choice(world, size=1024, replace=False))  # spans many nodes
    with srv.client() as c:
        rid = _run(c, "listed", world)
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "node": _node(r)} for r in range(world)]})
        res = c.ingest({"v": 1, "run_id": rid, "events": [
            _ev(r, 0, "comm_group", {"dim": "ep", "size": 1024, "ranks": odd}) for r in odd[:50]] + [
            _ev(0, 1, "comm_group", {"dim": "dp", "size": 512, "ranks": list(range(0, 8 * 256, 8))})]})  # old agent
        assert res["accepted"]["events"] == 51
        c.ingest_rows(rid, [_step_row(r, 0, 1.0, 0.5) for r in range(4)],
                      [(r, 0, i, "all_to_all", n, 1 << 20, 1, 0.3, 0.2, 1.7e9, d)
                       for r in range(4) for i, (n, d) in enumerate(((1024, "ep"), (512, "dp")))])
        srv.compact()
        dims = c.summary(rid)["comm_by_dim"]
        stored = _q(srv, "SELECT dim, size, listed, start, octet_length(ranks) FROM run_groups WHERE run_id = :r "
                         "ORDER BY dim", r=rid)
        assert [(d, n, ls, st) for d, n, ls, st, _ in stored] == [("dp", 512, 256, None), ("ep", 1024, 1024, None)]
        assert stored[1][4] < 4 * 1024  # compressed, under 4 bytes a rank
        assert dims["ep"]["nodes"] == len({_node(r) for r in odd}) and dims["dp"]["nodes"] == 256

        # a run an older server stored: its comm_group events are rows of run_events
        old = _run(c, "before-run-groups", world)
        c.ingest({"v": 1, "run_id": old, "ranks": [{"rank": r, "node": _node(r)} for r in range(world)]})
        c.ingest_rows(old, [_step_row(0, 0, 1.0, 0.5)], [(0, 0, 0, "all_reduce", 512, 1 << 20, 1, 0.3, 0.2, 1.7e9, "dp")])
        with srv.app.state.fs.engine.begin() as conn:
            # 1,100 ranks, each listing 10,000 ranks (what an older server kept), more rows than the read takes
            # (events.legacy_groups: 1,024): one statement, one row a rank
            n = conn.execute(text("INSERT INTO run_events (run_id, rank, seq, kind, data) SELECT :r, k, 0, "
                                  "'comm_group', CAST(:d AS jsonb) FROM generate_series(0, 1099) k"),
                             {"r": old, "d": json.dumps({"dim": "dp", "size": 10_000,
                                                         "ranks": list(range(0, world, 8)) * 20})}).rowcount
            assert n == 1100
        srv.compact()
        dims = c.summary(old)["comm_by_dim"]
    assert dims["dp"]["nodes"] == 256  # from the first 256 ranks of the first 1,024 rows


# --------------------------------------------------------------------------- caps: dropped and counted


def test_events_beyond_a_kind_or_the_run_cap_are_dropped_and_counted_while_the_batch_lands(live_server: Any) -> None:
    srv = live_server
    with srv.client() as c:
        rid = _run(c, "caps", 8)

        def events(kind: str, rank: int, seqs: range) -> list[dict[str, Any]]:
            return [_ev(rank, s, kind, {"i": s}) for s in seqs]

        for lo in range(0, MAX_EVENTS_PER_KIND, 10_000):
            assert c.ingest({"v": 1, "run_id": rid, "events": events("note", 0, range(lo, lo + 10_000))}
                            )["accepted"]["events"] == 10_000
        res = c.ingest({"v": 1, "run_id": rid, "rank_steps": _steps_batch(rid, [0, 1, 2, 3], 0),
                        "events": events("note", 1, range(5)) + events("eval", 1, range(5, 7))})
        assert res["accepted"] == {"rank_steps": 4, "collectives": 0, "modality_tokens": 0, "phases": 0, "ranks": 0,
                                   "events": 2}
        assert c.ingest({"v": 1, "run_id": rid, "events": events("note", 1, range(5))})["accepted"]["events"] == 0
        # the whole run: 20,000 + 2 + 20,000 + 9,998 = 50,000; then nothing more of any kind
        for lo in range(0, MAX_EVENTS_PER_KIND, 10_000):
            c.ingest({"v": 1, "run_id": rid, "events": events("ckpt", 2, range(lo, lo + 10_000))})
        res = c.ingest({"v": 1, "run_id": rid, "rank_steps": _steps_batch(rid, [0, 1, 2, 3], 1),
                        "events": events("loss", 3, range(10_000))})
        assert res["accepted"]["events"] == MAX_EVENTS_PER_RUN - 2 * MAX_EVENTS_PER_KIND - 2 and res["accepted"]["rank_steps"] == 4
        srv.compact()
        summary = c.summary(rid)
    counts = dict(_q(srv, "SELECT kind, count(*) FROM run_events WHERE run_id = :r GROUP BY kind", r=rid))
    assert counts == {"note": MAX_EVENTS_PER_KIND, "eval": 2, "ckpt": MAX_EVENTS_PER_KIND, "loss": 9_998}
    assert sum(counts.values()) == MAX_EVENTS_PER_RUN
    assert summary["rank_steps"] == 8 and summary["steps"] == 2  # the rank-steps of those batches landed
    assert summary["folded"]["events_dropped"] == {"note": 10, "loss": 2}
    stored = dict(_q(srv, "SELECT kind, stored FROM run_event_counts WHERE run_id = :r", r=rid))
    assert stored == {**counts, "": MAX_EVENTS_PER_RUN}


def test_a_kind_cap_holds_with_two_server_instances_writing_at_once(live_server: Any) -> None:
    """The cap is enforced in the database under the run's lock, not in a process's memory."""
    other = start_server(live_server.db_url)
    try:
        with live_server.client() as c:
            rid = _run(c, "two-servers", 8)
        per_sender, batch = 12_000, 1_000
        accepted: list[int] = []

        def send(srv: Any, rank: int) -> None:
            with srv.client() as cl:
                for lo in range(0, per_sender, batch):
                    got = cl.ingest({"v": 1, "run_id": rid, "events": [_ev(rank, s, "x", {}) for s in range(lo, lo + batch)]})
                    accepted.append(got["accepted"]["events"])

        threads = [threading.Thread(target=send, args=(srv, rank))
                   for srv, rank in ((live_server, 0), (other, 1), (live_server, 2), (other, 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(accepted) == 4 * per_sender // batch
        assert sum(accepted) == MAX_EVENTS_PER_KIND
        assert _q(live_server, "SELECT count(*) FROM run_events WHERE run_id = :r", r=rid)[0][0] == MAX_EVENTS_PER_KIND
        assert _q(live_server, "SELECT stored, dropped FROM run_event_counts WHERE run_id = :r AND kind = 'x'",
                  r=rid)[0] == (MAX_EVENTS_PER_KIND, 4 * per_sender - MAX_EVENTS_PER_KIND)
    finally:
        other.stop()


# --------------------------------------------------------------------------- per-kind schemas


def _refused(c: Any, rid: int, srv: Any, events: list[dict[str, Any]], where: str, words: str) -> None:
    before = _q(srv, "SELECT count(*) FROM run_events WHERE run_id = :r", r=rid)[0][0]
    r = c.http.post("/api/v1/ingest", json={"v": 1, "run_id": rid, "events": events,
                                            "rank_steps": _steps_batch(rid, [0], 9)})
    assert r.status_code == 422, r.text
    d = r.json()["detail"]
    assert d["where"] == where and words in d["error"], d
    assert d["loc"]["section"] == "events" and d["loc"]["field"] == "data"
    assert _q(srv, "SELECT count(*) FROM run_events WHERE run_id = :r", r=rid)[0][0] == before  # nothing written


def test_histogram_counts_and_bins_out_of_range_are_refused_naming_the_field(live_server: Any) -> None:
    srv = live_server
    with srv.client() as c:
        rid = _run(c, "hist", 2)
        for bins, where, words in [
            ({"3": -1}, "events[0].data.bins.3", "MAX_HIST_COUNT"),
            ({"3": 1e300}, "events[0].data.bins.3", "MAX_HIST_COUNT"),
            ({"3": 2e15}, "events[0].data.bins.3", "MAX_HIST_COUNT"),
            ({"3": "7"}, "events[0].data.bins.3", "MAX_HIST_COUNT"),
            ({"3": True}, "events[0].data.bins.3", "MAX_HIST_COUNT"),
            ({str(MAX_HIST_BINS): 1}, f"events[0].data.bins.{MAX_HIST_BINS}", "MAX_HIST_BINS"),
            ({"-1": 1}, "events[0].data.bins.-1", "MAX_HIST_BINS"),
            ({str(k): 1 for k in range(MAX_HIST_BINS)} | {"x": 1}, "events[0].data.bins", "MAX_HIST_BINS"),
            ([1, 2], "events[0].data.bins", "object"),
        ]:
            _refused(c, rid, srv, [_ev(0, 0, "seq_lens", {"bins": bins, "steps": 1})], where, words)
        c.ingest({"v": 1, "run_id": rid, "rank_steps": _steps_batch(rid, [0, 1], 0), "events": [
            _ev(0, 0, "seq_lens", {"bins": {"3": 5, "10": 2}, "steps": 1}),
            _ev(1, 0, "seq_lens", {"bins": {"03": 1, "63": 1e15}, "steps": 1})]})  # "03" is bin 3
        # an older server stored these: the read leaves them out
        with srv.app.state.fs.engine.begin() as conn:
            conn.execute(text("INSERT INTO run_events (run_id, rank, seq, kind, data) VALUES (:r, 1, 1, 'seq_lens', "
                              "CAST(:d AS jsonb))"), {"r": rid, "d": json.dumps({"bins": {"3": -9, "4": 1e300, "99": 5}})})
        srv.compact()
        hist = c.summary(rid)["seq_len_hist"]
    assert {b["lo"]: b["count"] for b in hist["bins"]} == {8: 6, 1024: 2, 2**63: 10**15}
    assert hist["sequences"] == 8 + 10**15


def test_pipeline_sizes_out_of_range_are_refused_and_older_rows_ignored(live_server: Any) -> None:
    srv = live_server
    with srv.client() as c:
        rid = _run(c, "pp", 8)
        stage = {"stage": 0, "num_stages": 4, "group_rank": 0, "group_size": 4}
        for data, where, words in [
            (stage | {"num_stages": MAX_PIPELINE_STAGES + 1}, "events[0].data.num_stages", "MAX_PIPELINE_STAGES"),
            (stage | {"stage": -1}, "events[0].data.stage", "MAX_PIPELINE_STAGES"),
            (stage | {"stage": MAX_PIPELINE_STAGES}, "events[0].data.stage", "MAX_PIPELINE_STAGES"),
            (stage | {"group_size": 1e300}, "events[0].data.group_size", "MAX_PIPELINE_STAGES"),
            (stage | {"num_stages": 4.0}, "events[0].data.num_stages", "MAX_PIPELINE_STAGES"),
        ]:
            _refused(c, rid, srv, [_ev(0, 0, "pp_stage", data)], where, words)
        sched = {"schedule": "Schedule1F1B", "n_microbatches": 8, "stages": [0]}
        for data, where, words in [
            (sched | {"n_microbatches": 1e300}, "events[0].data.n_microbatches", "MAX_MICROBATCHES"),
            (sched | {"n_microbatches": -2}, "events[0].data.n_microbatches", "MAX_MICROBATCHES"),
            (sched | {"n_microbatches": 65_537}, "events[0].data.n_microbatches", "MAX_MICROBATCHES"),
            (sched | {"stages": [0, MAX_PIPELINE_STAGES]}, "events[0].data.stages[1]", "MAX_PIPELINE_STAGES"),
            (sched | {"stages": list(range(MAX_EVENT_VALUES + 1))}, "events[0].data", "MAX_EVENT_VALUES"),
        ]:
            _refused(c, rid, srv, [_ev(0, 0, "pp_schedule", data)], where, words)
        evs = [_ev(r, 0, "pp_stage", {"stage": r // 2, "num_stages": 4, "group_rank": r // 2, "group_size": 4})
               for r in range(8)] + [_ev(0, 1, "pp_schedule", sched)]
        c.ingest({"v": 1, "run_id": rid, "events": evs, "rank_steps": _steps_batch(rid, list(range(8)), 0)})
        with srv.app.state.fs.engine.begin() as conn:  # an older server stored these
            conn.execute(text("INSERT INTO run_events (run_id, rank, seq, kind, data) VALUES "
                              "(:r, 7, 5, 'pp_stage', CAST(:a AS jsonb)), (:r, 7, 6, 'pp_schedule', CAST(:b AS jsonb))"),
                         {"r": rid, "a": json.dumps({"stage": 3, "num_stages": 10**30}),
                          "b": json.dumps({"n_microbatches": -5, "schedule": "x" * 100_000})})
        srv.compact()
        pipe = c.summary(rid)["pipeline"]
    assert pipe["stages"] == 4 and pipe["microbatches"] == 8 and pipe["schedule"] == "Schedule1F1B"


def test_reasons_are_cut_and_counted_not_refused_and_compile_summaries_fold_to_fit(live_server: Any) -> None:
    srv = live_server
    long = "guard failed: " + "x" * 65_000
    reasons = [{"reason": f"break {i} " + "y" * 1000, "count": 1000 - i} for i in range(400)]
    with srv.client() as c:
        rid = _run(c, "reasons", 2)
        res = c.ingest({"v": 1, "run_id": rid, "rank_steps": _steps_batch(rid, [0, 1], 0), "events": [
            _ev(0, 0, "compile", {"compile_s": 1.5, "recompile": True, "reason": long, "trigger": "dynamo"}, step=0),
            _ev(0, 1, "graph_break", {"reason": long, "count": 1}, step=0),
            _ev(1, 0, "compile_summary", {"compiles": 1, "recompiles": 1, "compile_s": 1.5, "graph_breaks": reasons,
                                          "recompile_reasons": reasons[:5], "reasons_dropped": 0}, step=0)]})
        assert res["accepted"]["events"] == 3
        with srv.app.state.fs.engine.begin() as conn:  # an older server kept a reason whole
            conn.execute(text("INSERT INTO run_events (run_id, rank, seq, kind, step, data) VALUES (:r, 1, 9, "
                              "'graph_break', 0, CAST(:d AS jsonb))"), {"r": rid, "d": json.dumps({"reason": "z" + long})})
        summary = c.summary(rid)
    stored = dict(_q(srv, "SELECT kind, data FROM run_events WHERE run_id = :r AND seq < 9", r=rid))
    for kind in ("compile", "graph_break"):
        kept = stored[kind]["reason"]
        assert len(kept) == MAX_REASON_CHARS and kept.endswith("…") and kept.startswith("guard failed: ")
    cs = stored["compile_summary"]
    kept_breaks = cs["graph_breaks"]
    assert 300 < len(kept_breaks) < 400 and len(cs["recompile_reasons"]) == 5  # folded to fit MAX_EVENT_VALUES
    assert [b["count"] for b in kept_breaks] == [1000 - i for i in range(len(kept_breaks))]  # the most frequent
    assert all(len(b["reason"]) == MAX_REASON_CHARS for b in kept_breaks)
    assert cs["reasons_dropped"] == 400 - len(kept_breaks)
    comp = summary["compile"]
    assert all(len(r["reason"]) <= MAX_REASON_CHARS for k in ("recompile", "graph_break") for r in comp["reasons"][k])
    assert len(json.dumps(comp)) < 64 * 1024
    assert summary["folded"]["events_folded"] == {"compile": 1, "graph_break": 1, "compile_summary": 1}


def test_event_data_beyond_max_event_values_is_refused_naming_the_limit(live_server: Any) -> None:
    srv = live_server
    with srv.client() as c:
        rid = _run(c, "values", 2)
        _refused(c, rid, srv, [_ev(0, 0, "note", {"x": list(range(MAX_EVENT_VALUES))})], "events[0].data",
                 "MAX_EVENT_VALUES")
        _refused(c, rid, srv, [_ev(0, 0, "comm_group", {"dim": "dp", "size": 2, "ranks": [0, 1],
                                                         "pad": list(range(MAX_EVENT_VALUES))})],
                 "events[0].data", "MAX_EVENT_VALUES")
        big = {"dim": "dp", "size": MAX_GROUP_RANKS_LISTED + 1, "ranks": list(range(MAX_GROUP_RANKS_LISTED + 1))}
        c.register_run({"name": "values", "model_family": "f", "world_size": MAX_GROUP_RANKS_LISTED + 1})
        _refused(c, rid, srv, [_ev(0, 0, "comm_group", big)], "events[0].data.ranks", "MAX_GROUP_RANKS_LISTED")
        _refused(c, rid, srv, [_ev(0, 0, "comm_group", {"dim": "dp", "size": 4, "start": 16_380, "stride": 8})],
                 "events[0].data.size", "world_size")
        ok = c.ingest({"v": 1, "run_id": rid, "events": [
            {**_ev(0, 0, "note", {"x": list(range(MAX_EVENT_VALUES - 2))}), "ts": 1_700_000_000},  # 1,000 values
            _ev(0, 2, "note", {}),  # a float ts after an int one
            _ev(0, 1, "comm_group", {"dim": "dp", "size": MAX_GROUP_RANKS_LISTED,
                                     "ranks": list(range(MAX_GROUP_RANKS_LISTED))})]})
        assert ok["accepted"]["events"] == 3
    assert _q(srv, "SELECT ts FROM run_events WHERE run_id = :r ORDER BY seq", r=rid) == [(1.7e9,), (1.7e9,)]
    assert _q(srv, "SELECT start, stride, size, ranks FROM run_groups WHERE run_id = :r", r=rid) == [
        (0, 1, MAX_GROUP_RANKS_LISTED, None)]  # a full list that is a progression is stored as one


# --------------------------------------------------------------------------- memory of the largest run


class _PeakRss:
    """The process's peak resident memory while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> _PeakRss:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def test_the_largest_allowed_event_payloads_give_a_summary_and_run_page_in_bounded_memory(live_server: Any) -> None:
    """MAX_EVENTS_PER_KIND pp_stage events of MAX_EVENT_VALUES values each, MAX_GROUPS_PER_RUN groups
    (the largest rank lists among them) and more beyond the cap: the summary and the run page's data
    stay under the ceiling (Python allocations and the process's resident memory)."""
    srv = live_server
    world = WORLD
    pad = list(range(MAX_EVENT_VALUES - 6))  # {stage, num_stages, group_rank, group_size, pad: [...]} = 1,000 values
    t0 = time.monotonic()
    with srv.client() as c:
        rid = _run(c, "largest", world)
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "node": _node(r)} for r in range(world)],
                  "rank_steps": _steps_batch(rid, [0, 1], 0)})
        # the first 2,000 through the API; the rest up to the cap are those rows as the server stored them
        # (event i: rank i % world, seq i // world, stage i % 4; its data is that of the stored event i % 4),
        # written in one statement, then the counts the server keeps: what 18,000 more events through the
        # API would store, in a fraction of the time
        first = 2_000
        evs = [_ev(i % world, i // world, "pp_stage", {"stage": i % 4, "num_stages": 4, "group_rank": i % 4,
                                                         "group_size": 4, "pad": pad}) for i in range(first)]
        assert c.ingest({"v": 1, "run_id": rid, "events": evs})["accepted"]["events"] == first
        with srv.app.state.fs.engine.begin() as conn:
            copied = conn.execute(text(
                "INSERT INTO run_events (run_id, rank, seq, kind, ts, step, data) "
                "SELECT e.run_id, i % :w, i / :w, e.kind, e.ts, e.step, e.data FROM generate_series(:lo, :hi - 1) i "
                "JOIN run_events e ON e.run_id = :r AND e.rank = i % 4 AND e.seq = 0 AND e.kind = 'pp_stage'"),
                {"r": rid, "w": world, "lo": first, "hi": MAX_EVENTS_PER_KIND}).rowcount
            assert copied == MAX_EVENTS_PER_KIND - first
            conn.execute(text("UPDATE run_event_counts SET stored = stored + :n WHERE run_id = :r "
                              "AND kind IN ('pp_stage', '')"), {"r": rid, "n": copied})
        # the server sees the kind at its cap: one more is dropped and counted
        more = _ev(0, world, "pp_stage", {"stage": 0, "num_stages": 4, "group_rank": 0, "group_size": 4})
        assert c.ingest({"v": 1, "run_id": rid, "events": [more]})["accepted"]["events"] == 0
        rng = np.random.default_rng(3)
        n_listed = 64  # the longest lists a group may have, not progressions
        listed = [_ev(0, 10_000 + g, "comm_group", {
            "dim": "ep", "size": MAX_GROUP_RANKS_LISTED // 2,
            "ranks": sorted(int(x) for x in rng.choice(world, MAX_GROUP_RANKS_LISTED // 2, replace=False))})
            for g in range(n_listed)]
        c.ingest({"v": 1, "run_id": rid, "events": listed})
        extra = 100
        size = world // 16  # distinct progressions of world/16 ranks: every start of stride 1, then 2, ...
        shapes = [(st, sd) for sd in range(1, 9) for st in range(world - sd * (size - 1))]
        assert len(shapes) > MAX_GROUPS_PER_RUN + extra
        prog = [_ev(i % world, 20_000 + i // world, "comm_group", {"dim": "cp", "size": size, "start": st, "stride": sd})
                for i, (st, sd) in enumerate(shapes[:MAX_GROUPS_PER_RUN - n_listed + extra])]
        kept = sum(c.ingest({"v": 1, "run_id": rid, "events": prog[i:i + 8_192]})["accepted"]["events"]
                   for i in range(0, len(prog), 8_192))
        assert kept == MAX_GROUPS_PER_RUN - n_listed
        srv.compact()
    print(f"the largest run loaded in {time.monotonic() - t0:.1f} s")
    assert _q(srv, "SELECT count(*) FROM run_groups WHERE run_id = :r", r=rid)[0][0] == MAX_GROUPS_PER_RUN

    engine = srv.app.state.fs.engine
    reports.clear_caches()
    tracemalloc.start()
    try:
        with _PeakRss() as rss:
            summary = reports.run_summary(engine, rid)
            page = reports.run_page_summary(engine, rid)
            good = reports.goodput(engine, rid)
            evs = reports.run_events(engine, rid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"summary + run page: Python peak {peak / 2**20:.0f} MiB, RSS growth {rss.growth_mib:.0f} MiB")
    assert peak / 2**20 < CEILING_MIB and rss.growth_mib < CEILING_MIB
    assert summary is not None and page is not None and good is not None
    assert summary["pipeline"]["stages"] == 4
    assert summary["folded"]["events_dropped"] == {"comm_group": extra, "pp_stage": 1}
    assert _q(srv, "SELECT count(*), count(DISTINCT data->>'stage') FROM run_events WHERE run_id = :r "
                   "AND kind = 'pp_stage' AND jsonb_array_length(data->'pad') = :n", r=rid, n=len(pad))[0] == (
        MAX_EVENTS_PER_KIND, 4)  # the cap's worth of the largest events, each stage among them
    assert len(evs) == 500 and all(len(json.dumps(e["data"])) < 16_384 for e in evs)
    assert len(json.dumps(summary, default=str)) < 1 << 20

    # a deleted run leaves nothing behind, cached or stored
    with srv.client() as c:
        r = c.http.delete(f"/api/v1/runs/{rid}")
    assert r.status_code == 200 and r.json()["deleted"]["run_groups"] == MAX_GROUPS_PER_RUN
    assert _q(srv, "SELECT count(*) FROM run_event_counts WHERE run_id = :r", r=rid)[0][0] == 0
    from fleetscope.server.reports import _cache

    assert all(k[1] != rid for k in list(_cache._entries))


def test_every_bound_of_limits_py_is_in_the_security_docs_table() -> None:
    """docs/security.md, "Bounds on what a run stores": one row per constant, with its value."""
    import re
    from pathlib import Path

    from fleetscope.server import limits

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    section = re.search(r"^## Bounds on what a run stores\n(.*?)(?=^## )", doc, re.S | re.M)
    assert section, "docs/security.md has no 'Bounds on what a run stores' section"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(MAX_\w+)` \| ([^|]+) \|", section.group(1), re.M)}
    names = {n for n in vars(limits) if n.startswith("MAX_")}
    assert set(rows) == names
    for n in names:
        v = getattr(limits, n)
        assert rows[n].strip().replace(",", "") in (str(v), f"{v:.0e}".replace("+", "").replace("e0", "e")), (n, rows[n])
