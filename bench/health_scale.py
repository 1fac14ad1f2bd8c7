"""Run health at the largest world size (issue 29, "Health at any size"): ``/health`` and ``/summary`` of a
262,144-rank hung run, and how long the health pass takes to mark another, small run failed with and
without that run present.

    python bench/health_scale.py [--ranks 262144] [--every 128] [--reps 5] [--interval-s 5]
                                 [--read-timeout-s S]

A real server (``fleetscope serve``, embedded Postgres, the health pass every ``--interval-s`` s,
``stall_silence_s`` 1 day so the bulk-inserted positions stay live; defaults otherwise, the read budget
included unless ``--read-timeout-s``).

1. **Without the big run.** ``--reps`` times: a 2-rank run registers and lands 3 steps, then (at a
   random moment of the pass's cycle) one ``failure`` event of rank 1 goes through the real ingest;
   the time from that POST to ``runs.status = 'failed'`` (polled in SQL every 10 ms) is measured.
2. **The big run.** A ``--ranks``-rank run registered an hour ago (no step: stalled), its ``ranks``
   rows (8 per node) and one position per rank inserted in bulk in SQL: every rank blocked in
   ``all_reduce`` #12 on dim ``dp`` with a 2-frame stack, except every ``--every``-th rank (offset 77),
   stuck in its data loader after #11 — 2,048 ranks that never arrived at 262,144. The bench waits
   until the pass has concluded on it (``run_health`` row ``hung``).
3. ``GET /health`` and ``GET /summary`` of the big run, ``--reps`` times each (median, max; the
   response's size; whether the lists are bounded and the counts right), and the wavefront query alone
   (``store.health.wave_summary``, in this process).
4. **With the big run.** Step 1 again on new small runs, the big run still hung and analysed by the
   pass: the ratio of the medians is the figure (target: every other run's state within its threshold
   plus one interval — for a failure, within one interval).

Prints ``name: value unit`` lines last, with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetscope.client import Client  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))
    print(f"  {name}: {value:.4g} {unit}", file=sys.stderr, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(url: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_COMPACT_GRACE_S": "1",
           "FLEETSCOPE_ALERTS_ENABLED": "false", "FLEETSCOPE_HEALTH_INTERVAL_S": str(args.interval_s),
           "FLEETSCOPE_STALL_SILENCE_S": "86400"}
    if args.read_timeout_s:
        env["FLEETSCOPE_READ_TIMEOUT_S"] = str(args.read_timeout_s)
    out = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen([sys.executable, "-m", "fleetscope", "serve", "--database-url", url, "--port", str(port),
                          "--insecure-no-auth"], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    Client(base).wait_ready(120)
    return p, base


#: every rank blocked in all_reduce #12 on dim dp, except ranks ≡ 77 (mod every), stuck in the data loader
POSITIONS_SQL = """
INSERT INTO run_positions (run_id, rank, seq, ts, step, state, phase, open_s, coll_op, coll_dim, coll_group, coll_seq,
                           coll_bytes, coll_since_s, coll_done, stack, source, received_at)
SELECT :r, g, 100, extract(epoch FROM now()), 5, 'in_step', CASE WHEN g % :every = 77 THEN 'data' ELSE 'backward' END,
       30.0, 'all_reduce', 'dp', '0', CASE WHEN g % :every = 77 THEN 11 ELSE 12 END, 1048576, 29.0,
       g % :every = 77,
       CASE WHEN g % :every = 77
            THEN '[{"file": "/ws/train.py", "line": 90, "func": "main"},
                   {"file": "/ws/data/loader.py", "line": 211, "func": "__next__"}]'::jsonb
            ELSE '[{"file": "/ws/train.py", "line": 88, "func": "main"},
                   {"file": "/torch/distributed/c10d.py", "line": 2501, "func": "all_reduce"}]'::jsonb END,
       'agent', now()
FROM generate_series(0, :w - 1) AS g
"""

RANKS_SQL = """
INSERT INTO ranks (run_id, rank, host, node, local_rank)
SELECT :r, g, 'n' || lpad((g / 8)::text, 6, '0'), 'n' || lpad((g / 8)::text, 6, '0'), g % 8
FROM generate_series(0, :w - 1) AS g
"""


def make_big_run(base: str, eng: Any, ranks: int, every: int) -> int:
    from sqlalchemy import text

    c = Client(base)
    rid = c.register_run({"name": f"big-{ranks}", "world_size": ranks, "started_at": time.time() - 3600})
    t = time.perf_counter()
    with eng.begin() as conn:
        conn.execute(text(RANKS_SQL), {"r": rid, "w": ranks})
        conn.execute(text(POSITIONS_SQL), {"r": rid, "w": ranks, "every": every})
    figure("big_run_bulk_insert_s", time.perf_counter() - t, "s")
    return rid


def crash_latency(base: str, eng: Any, tag: str, interval_s: float, rng: random.Random) -> float:
    """A 2-rank run lands 3 steps, then rank 1's failure: seconds from the POST to status 'failed'."""
    from sqlalchemy import text

    c = Client(base)
    t0 = time.time() - 30
    rid = c.register_run({"name": f"small-{tag}", "world_size": 2, "started_at": t0})
    cols: dict[str, list[Any]] = {"rank": [], "step": [], "step_s": [], "ts": []}
    for s in range(3):
        for r in range(2):
            cols["rank"].append(r)
            cols["step"].append(s)
            cols["step_s"].append(1.0)
            cols["ts"].append(t0 + s)
    c.ingest({"v": 1, "run_id": rid, "rank_steps": cols})
    time.sleep(rng.uniform(0, interval_s))  # a random moment of the pass's cycle
    ev = {"rank": 1, "seq": 1, "kind": "failure", "ts": time.time(), "step": 3,
          "data": {"source": "exception", "exception": "RuntimeError", "message": "boom", "rank": 1}}
    t_post = time.perf_counter()
    c.ingest({"v": 1, "run_id": rid, "events": [ev]})
    deadline = t_post + 600
    with eng.connect() as conn:
        while time.perf_counter() < deadline:
            st = conn.execute(text("SELECT status FROM runs WHERE id = :r"), {"r": rid}).scalar()
            conn.commit()
            if st == "failed":
                return time.perf_counter() - t_post
            time.sleep(0.01)
    raise AssertionError(f"run {rid} not failed within 600 s")


def crash_series(base: str, eng: Any, tag: str, args: argparse.Namespace, rng: random.Random) -> list[float]:
    out = [crash_latency(base, eng, f"{tag}-{i}", args.interval_s, rng) for i in range(args.reps)]
    figure(f"fail_detect_{tag}_median_s", statistics.median(out), "s")
    figure(f"fail_detect_{tag}_max_s", max(out), "s")
    return out


def wait_concluded(eng: Any, rid: int, timeout: float) -> float:
    from sqlalchemy import text

    t = time.perf_counter()
    with eng.connect() as conn:
        while time.perf_counter() - t < timeout:
            st = conn.execute(text("SELECT state FROM run_health WHERE run_id = :r"), {"r": rid}).scalar()
            conn.commit()
            if st == "hung":
                return time.perf_counter() - t
            time.sleep(0.05)
    return float("nan")


def timed_get(base: str, path: str, reps: int) -> tuple[list[float], httpx.Response]:
    ts = []
    r = None
    for _ in range(reps):
        t = time.perf_counter()
        r = httpx.get(f"{base}{path}", timeout=600)
        ts.append(time.perf_counter() - t)
    assert r is not None
    return ts, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=262_144)
    ap.add_argument("--every", type=int, default=128, help="every N-th rank (offset 77) never arrived")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--read-timeout-s", type=float, default=None)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    from fleetscope.server.db import EmbeddedPostgres, make_engine, upgrade
    from fleetscope.server.store import health as store
    from sqlalchemy import create_engine

    rng = random.Random(args.seed)
    figure("load_average_1min_start", os.getloadavg()[0], "runnable")
    pg_dir = tempfile.mkdtemp(prefix="fshs-", dir="/tmp")
    atexit.register(shutil.rmtree, pg_dir, True)
    pg = EmbeddedPostgres(pg_dir)
    pg.start()
    url = pg._server.get_uri("postgres")
    upgrade(url)
    eng = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    sa_eng = make_engine(url, pool_size=1)
    proc, base = start_server(url, args, Path(pg_dir) / "server.log")
    try:
        figure("health_pass_interval_s", args.interval_s, "s")
        without = crash_series(base, eng, "without_big", args, rng)
        rid = make_big_run(base, eng, args.ranks, args.every)
        figure("big_run_first_concluded_after_s", wait_concluded(eng, rid, 600), "s")
        ts, r = timed_get(base, f"/api/v1/runs/{rid}/health", args.reps)
        assert r.status_code == 200, r.text[:500]
        h = r.json()
        expect = sum(1 for g in range(args.ranks) if g % args.every == 77)
        print(f"  /health: {h['state']}: {h['finding'][:300]}", file=sys.stderr)
        figure(f"health_{args.ranks}_median_ms", statistics.median(ts) * 1e3, "ms")
        figure(f"health_{args.ranks}_max_ms", max(ts) * 1e3, "ms")
        figure(f"health_{args.ranks}_response_kib", len(r.content) / 1024, "KiB")
        figure(f"health_{args.ranks}_missing_listed", float(len(h["missing_ranks"])), "ranks")
        figure(f"health_{args.ranks}_missing_count_right", float(h["missing_count"] == expect), "bool")
        figure(f"health_{args.ranks}_stacks", float(len(h["stacks"])), "ranks")
        ts = []
        for _ in range(args.reps):  # the wavefront in SQL, in this process (what /health and the pass run)
            t = time.perf_counter()
            w = store.wave_summary(sa_eng, rid, args.ranks, 86400.0)
            ts.append(time.perf_counter() - t)
        figure(f"wave_summary_{args.ranks}_median_ms", statistics.median(ts) * 1e3, "ms")
        figure(f"wave_summary_{args.ranks}_right", float(w.missing.count == expect), "bool")
        ts, r = timed_get(base, f"/api/v1/runs/{rid}/summary", args.reps)
        assert r.status_code == 200, r.text[:500]
        figure(f"summary_{args.ranks}_median_ms", statistics.median(ts) * 1e3, "ms")
        figure(f"summary_{args.ranks}_max_ms", max(ts) * 1e3, "ms")
        with_big = crash_series(base, eng, "with_big", args, rng)
        figure("fail_detect_with_over_without_median", statistics.median(with_big) / statistics.median(without), "x")
        figure("fail_detect_with_big_max_over_interval", max(with_big) / args.interval_s, "x")
    finally:
        proc.terminate()
        proc.wait(60)
        eng.dispose()
        sa_eng.dispose()
        tracebacks = (Path(pg_dir) / "server.log").read_text(errors="replace").count("Traceback")
        figure("server_log_tracebacks", float(tracebacks), "tracebacks")
        pg.stop()
    figure("load_average_1min_end", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
