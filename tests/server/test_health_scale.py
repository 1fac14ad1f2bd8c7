"""Run health at any size (issue 29): the wavefront computed in SQL is the Python one, bounded; a
262,144-rank hung run through the real server (bounded ``/health``, right counts) beside a small run that
crashed, which one pass marks failed before — and independently of — the big run's analysis; the
analysis under a time budget and spaced out; a database outage logged once per cause, not per run."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from health_util import FAST, bulk_run, event, frame, steps_batch
from sqlalchemy import text

BIG = 262_144  # runs.MAX_WORLD_SIZE


def _run_row(conn: Any, name: str, world: int, age_s: float = 3600.0) -> int:
    return int(conn.execute(text(
        "INSERT INTO runs (name, world_size, started_at, status, owner_key) VALUES (:n, :w, "
        "now() - make_interval(secs => :a), 'running', 'test') RETURNING id"), {"n": name, "w": world, "a": age_s}).scalar())


# ------------------------------------------------------------------------------ SQL == Python, small runs


def _scenario(rng: random.Random, world: int) -> tuple[list[dict[str, Any]], list[tuple[int, str | None, str | None]]]:
    """Random positions (a majority collective with victims, laggards, ranks past it, silent ranks, ranks
    without a position, odd dims/groups) and ``ranks`` rows (node, host-only, none)."""
    structured = rng.random() < 0.7
    pos = []
    for r in range(world):
        if rng.random() < 0.12:
            continue  # never reported
        age = rng.choice([0.0, 1.0, 1.0, 1.0, 500.0]) if rng.random() < 0.3 else 0.0
        if structured:
            kind = rng.choices(["wait", "behind", "past", "stuck", "victim", "nogroup"], [12, 1, 1, 2, 1, 1])[0]
            op, dim, group, seq, done = {
                "wait": ("all_reduce", "dp", "g0", 5, False), "behind": ("all_reduce", "dp", "g0", 4, False),
                "past": ("all_reduce", "dp", "g0", rng.choice([5, 6]), True),
                "stuck": ("all_reduce", "dp", "g0", 4, True), "victim": ("all_gather", "tp", "g1", 9, False),
                "nogroup": (rng.choice([None, "broadcast"]), rng.choice(["", None]), rng.choice([None, "pg"]),
                            rng.choice([None, 5]), rng.choice([None, False, True])),
            }[kind]
        else:
            op = rng.choice([None, "all_reduce", "all_gather"])
            dim = rng.choice(["dp", "tp", "", None])
            group = rng.choice(["0", "1", None])
            seq = rng.choice([None, 3, 4, 5])
            done = rng.choice([True, False, None])
        stack = rng.choice([None, [], [frame("/a/x.py", r, "f"), frame("/a/y.py", 2, "g")]])
        pos.append({"rank": r, "step": rng.choice([None, 7, 8, 8]), "state": rng.choice(["in_step", "idle"]),
                    "phase": rng.choice([None, "data", "backward"]), "open_s": rng.choice([None, 12.0]),
                    "op": op, "dim": dim, "group": group, "seq": seq, "done": done, "stack": stack, "age": age})
    if rng.random() < 0.2:  # a rank outside the world (never validated in: counted as a position only)
        pos.append({"rank": world + 3, "step": 8, "state": "in_step", "phase": None, "open_s": None, "op": None,
                    "dim": None, "group": None, "seq": None, "done": None, "stack": None, "age": 0.0})
    per = rng.choice([1, 2, 4])
    ranks = []
    for r in range(world):
        u = rng.random()
        if u < 0.7:
            ranks.append((r, f"{rng.choice(['n', 'N', 'a'])}{r // per}", None))
        elif u < 0.85:
            ranks.append((r, None, f"h{r // per}"))
    return pos, ranks


def _insert(conn: Any, rid: int, pos: list[dict[str, Any]], ranks: list[tuple[int, str | None, str | None]]) -> None:
    import json

    for p in pos:
        conn.execute(text(
            "INSERT INTO run_positions (run_id, rank, seq, ts, step, state, phase, open_s, coll_op, coll_dim, coll_group, "
            "coll_seq, coll_done, stack, source, received_at) VALUES (:r, :k, 1, 1000.0, :step, :state, :phase, :open_s, "
            ":op, :dim, :grp, :seq, :done, CAST(:stack AS jsonb), 'agent', now() - make_interval(secs => :age))"),
            {"r": rid, "k": p["rank"], "step": p["step"], "state": p["state"], "phase": p["phase"],
             "open_s": p["open_s"], "op": p["op"], "dim": p["dim"], "grp": p["group"], "seq": p["seq"],
             "done": p["done"], "stack": None if p["stack"] is None else json.dumps(p["stack"]), "age": p["age"]})
    for r, node, host in ranks:
        conn.execute(text("INSERT INTO ranks (run_id, rank, node, host) VALUES (:r, :k, :n, :h)"),
                     {"r": rid, "k": r, "n": node, "h": host})


def _comparable(w: Any) -> dict[str, Any]:
    d = dict(w.__dict__)
    f = d.pop("first")
    d["first"] = None if f is None else {k: getattr(f, k) for k in ("rank", "step", "state", "phase", "op", "dim",
                                                                       "seq", "done", "stack")}
    return d


def _masked(s: str | None) -> str | None:
    return None if s is None else re.sub(r"\d+(\.\d+)? (s|min|h)\b", "<t>", s)


def test_the_sql_wavefront_is_the_python_one_on_random_runs(engine: Any) -> None:
    from fleetscope.server.analysis.health import HealthParams, evaluate, summarize
    from fleetscope.server.store import health as store

    rng = random.Random(29)
    params = HealthParams(silence_s=30.0, max_listed=3, max_stacks=2)
    hung = lost = 0
    for i in range(60):
        world = rng.randint(1, 20)
        pos, ranks = _scenario(rng, world)
        with engine.begin() as c:
            rid = _run_row(c, f"r{i}", world)
            _insert(c, rid, pos, ranks)
        sql = store.wave_summary(engine, rid, world, 30.0, max_listed=3, max_stacks=2)
        loaded = store.positions(engine, rid, limit=10_000)
        nodes = store.node_map(engine, rid)
        py = summarize(loaded, world, nodes, 30.0, max_listed=3, max_stacks=2)
        assert _comparable(sql) == _comparable(py), (i, pos, ranks)
        common = {"name": "r", "status": "running", "world_size": world, "steps": 9, "current_step": 8, "now": 1e6,
                  "progress_at": 1e6 - 600, "p99_step_s": 1.0, "failures": [], "n_failed_ranks": 0,
                  "finished_at": None, "pauses": [], "params": params}
        a = evaluate(**common, positions=None, nodes={}, wave=sql)
        b = evaluate(**common, positions=loaded, nodes=nodes)
        da, db = a.detail(), b.detail()
        for d in (da, db):  # how long the first one is stuck counts its position's age, read twice
            if d["stuck"]:
                d["stuck"]["for_s"] = round(d["stuck"]["for_s"])
        assert da == db, i
        assert _masked(a.finding) == _masked(b.finding), i
        hung += a.state == "hung" and a.kind == "hang"
        lost += a.kind == "node_lost"
    assert hung >= 10 and lost >= 3  # the scenarios cover both findings


# ------------------------------------------------------------------------------ a 262,144-rank run


@pytest.fixture
def big(db_url: str) -> Iterator[Any]:
    """A server whose own pass is off (the test drives a pass), positions silent only after an hour."""
    from conftest import start_server

    s = start_server(db_url, **{**FAST, "health_enabled": False, "stall_silence_s": 3600.0, "stall_first_s": 600.0})
    yield s
    s.stop()


def test_a_262144_rank_hang_is_bounded_and_a_small_crash_beside_it_is_marked_failed_first(
        big: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetscope.server import health_pass
    from fleetscope.server.health_pass import HealthWorker, params_from
    from fleetscope.server.store import health as store

    eng = big.state.engine
    with big.client() as c:
        small = c.register_run({"name": "small", "world_size": 2, "started_at": time.time() - 60})
        c.ingest(steps_batch(small, 2, range(3), t0=time.time() - 30))
        # the big run registered an hour ago, no step (stalled), every rank's position in SQL
        rid = c.register_run({"name": "big", "world_size": BIG, "started_at": time.time() - 3600})
    big.compact()
    bulk_run(eng, rid, BIG)  # ranks ≡ 77 (mod 128) never arrived: 2,048 of them, on 2,048 nodes of 8 ranks
    with big.client() as c:
        c.ingest({"v": 1, "run_id": small, "events": [event(1, "failure", {
            "source": "exception", "exception": "RuntimeError", "message": "boom", "rank": 1}, step=3)]})

    # one pass, observed: when the big run's analysis starts, the small run must be failed already
    seen: list[tuple[int, str | None]] = []
    real = store.wave_summary

    def observed(engine: Any, run_id: int, *a: Any, **k: Any) -> Any:
        with engine.connect() as conn:
            seen.append((run_id, conn.execute(text("SELECT status FROM runs WHERE id = :r"), {"r": small}).scalar()))
        return real(engine, run_id, *a, **k)

    monkeypatch.setattr(health_pass.store, "wave_summary", observed)
    w = HealthWorker(eng, params_from(big.state.settings), interval_s=0.2)
    w.triage()
    # triage alone concluded on the small run, and never analysed the big one
    assert httpx.get(f"{big.url}/api/v1/runs/{small}").json()["status"] == "failed"
    assert seen == [] and list(w._pending) == [rid] and ("triage", small) in w.trace
    w.analyse_pending()
    assert seen == [(rid, "failed")]  # the big run's analysis began after the small run was marked failed
    assert w.trace.index(("triage", small)) < w.trace.index(("analysis", rid))
    with eng.connect() as conn:
        st, detail = conn.execute(text("SELECT state, detail FROM run_health WHERE run_id = :r"), {"r": rid}).one()
    assert st == "hung" and detail["missing_count"] == 2048 and len(detail["missing_ranks"]) == 1024
    assert len(detail["stacks"]) == 16

    # the analysis is spaced out: not due again at once, its conclusion carried over
    n = w.analyses
    w.analyse_pending()
    assert w.analyses == n and w._due[rid] > time.monotonic()

    # /health of the big run through the real server: bounded lists, true counts
    r = httpx.get(f"{big.url}/api/v1/runs/{rid}/health", timeout=120)
    assert r.status_code == 200, r.text[:300]
    h = r.json()
    assert h["state"] == "hung" and h["collective"] == {"op": "all_reduce", "dim": "dp", "seq": 12}
    assert h["waiting"]["ranks"] == BIG - 2048
    assert h["missing_count"] == 2048 and len(h["missing_ranks"]) == 1024 and h["missing_ranks"][:3] == [77, 205, 333]
    assert len(h["missing_nodes"]) == 1024 and h["missing_nodes"][0] == "n000009" and h["missing_nodes_count"] == 2048
    assert sorted(h["stacks"], key=int) == [str(77 + 128 * i) for i in range(16)]
    assert h["stacks"]["77"][-1] == {"file": "/ws/data/loader.py", "line": 211, "func": "__next__"}
    assert h["stuck"]["rank"] == 77 and h["stuck"]["phase"] == "data"
    assert ("run big hung at step 5: 260,096 of 262,144 ranks wait in all_reduce #12 on dim dp; ranks 77, 205, "
            "333, 461, 589, 717, 845, 973, 1101, 1229, 1357, 1485 and 2036 more ranges (nodes n000009, n000025, "
            "n000041, n000057, n000073, n000089, n000105, n000121 and 2040 more) never arrived — stuck in "
            "`loader.py:211 __next__` for") in h["finding"]
    assert len(r.content) < 256 * 1024
    # the summary of the same run: its goodput needs no wavefront
    s = httpx.get(f"{big.url}/api/v1/runs/{rid}/summary", timeout=120)
    assert s.status_code == 200 and s.json()["goodput"] is not None


def test_an_analysis_over_its_budget_concludes_stalled_and_the_pass_goes_on(engine: Any) -> None:
    from fleetscope.server.analysis.health import HealthParams
    from fleetscope.server.health_pass import HealthWorker
    from fleetscope.server.store import health as store

    world = 65_536
    with engine.begin() as c:
        rid = _run_row(c, "wide", world)
        other = _run_row(c, "crashed", 2, age_s=30)
        c.execute(text("INSERT INTO run_failures (run_id, rank, source, ts, exception) VALUES (:r, 0, 'exception', "
                       "extract(epoch FROM now()), 'ValueError')"), {"r": other})
    bulk_run(engine, rid, world)
    params = HealthParams(silence_s=3600.0, stall_first_s=60.0)
    w = HealthWorker(engine, params, interval_s=0.2, budget_s=0.001, inline_ranks=1024)
    w.run_once()
    assert w.over_budget == 1
    h = store.load_health(engine, rid)
    assert h["state"] == "stalled" and "were not analysed (over the 0.001 s budget)" in h["finding"]
    assert store.load_health(engine, other)["state"] == "failed"
    with engine.connect() as c:
        assert c.execute(text("SHOW statement_timeout")).scalar() == "0"  # SET LOCAL: the pool is left as it was
    # with room, the same run is analysed (next time it is due)
    w.budget_s = 60.0
    w._due.clear()
    w.run_once()
    h = store.load_health(engine, rid)
    assert h["state"] == "hung" and h["detail"]["missing_count"] == world // 128


# ------------------------------------------------------------------------------ outages


def test_a_database_outage_logs_one_line_per_cause_not_a_traceback_per_run(
        engine: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg
    from fleetscope.server import health_pass
    from fleetscope.server.analysis.health import HealthParams
    from fleetscope.server.db import make_engine
    from fleetscope.server.health_pass import HealthWorker
    from fleetscope.server.store import health as store
    from sqlalchemy.exc import OperationalError

    with engine.begin() as c:
        ids = [_run_row(c, f"r{i}", 2, age_s=5) for i in range(6)]
    caplog.set_level(logging.INFO, logger="fleetscope.server.health_pass")

    # the database is unreachable: every pass fails at its first query
    dead = make_engine("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2", pool_size=1)
    w = HealthWorker(dead, HealthParams(), interval_s=0.2)
    for _ in range(5):
        assert w.run_once() == []
    dead.dispose()
    recs = [r for r in caplog.records if r.name == "fleetscope.server.health_pass"]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING and not recs[0].exc_info
    assert "database unavailable" in recs[0].getMessage() and w.errors == 5

    # it goes down in the middle of a pass: every run's read fails the same way — still one line; a run
    # whose data breaks the analysis is logged (with its traceback, once) and the others are concluded
    caplog.clear()
    real = health_pass.assess
    down = {"on": True}

    def flaky(eng: Any, rp: Any, *a: Any, **k: Any) -> Any:
        if rp.run_id == ids[0]:
            raise ValueError("bad data")
        if down["on"] and rp.run_id in ids[1:3]:
            raise OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused"))
        return real(eng, rp, *a, **k)

    monkeypatch.setattr(health_pass, "assess", flaky)
    w = HealthWorker(engine, HealthParams(), interval_s=0.2)
    for _ in range(3):
        w.run_once()
    recs = [r for r in caplog.records if r.name == "fleetscope.server.health_pass"]
    assert sorted((r.levelno, bool(r.exc_info)) for r in recs) == [(logging.WARNING, False), (logging.ERROR, True)]
    assert w.errors == 9
    rows = store.health_rows(engine, ids)
    assert sorted(rows) == sorted(ids[3:])  # the runs whose reads worked were concluded every pass
    assert all(st == "running" for st, _, _ in rows.values())
