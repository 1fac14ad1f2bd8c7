"""Ingest benchmark: sustained rank-step records/s through HTTP + msgpack into embedded Postgres,
side by side with raw psycopg binary COPY of the same rows into the same tables; bytes on disk per
rank-step after compaction, side by side with a one-row-per-rank-step table with a primary key.

    python bench/ingest.py [--rank-steps 400000] [--ranks 256] [--senders 3] [--runs 1]
                           [--compaction-workers 0] [--before REV]

``--runs K`` splits the rank-steps over K runs (compaction is partitioned by run: one run is folded
by one compactor at a time); ``--compaction-workers N`` runs the server with N compaction processes.
``--encoding`` (default auto: zstd for a server that takes it, as the agent negotiates, else gzip).
``--before REV`` first measures the server of an older commit (laid out from ``git archive`` in a temp
dir, served with that code on PYTHONPATH), then this checkout's, each on its own embedded Postgres
with its own COPY reference, in the same invocation; the last lines give after / before.

Prints `name: value unit` lines last (docs/benchmarks.md). The server runs as its own process
(`fleetscope serve --database-url`), as in production; batches are encoded before timing starts.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetscope.server.codec import RAW_COLL_LAYOUT, RAW_STEP_LAYOUT  # noqa: E402
from fleetscope.server.db import EmbeddedPostgres, libpq_url, upgrade  # noqa: E402

from fleetscope.client import columnar  # noqa: E402
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS, encode_batch  # noqa: E402


def make_rows(ranks: int, steps: int, seed: int = 0) -> tuple[list[tuple], list[tuple]]:
    """Realistic rank-step rows (all fields) and 4 collective records per rank-step."""
    rng = np.random.default_rng(seed)
    n = ranks * steps
    step = np.repeat(np.arange(steps), ranks)
    rank = np.tile(np.arange(ranks), steps)
    compute = 0.8 * rng.lognormal(0, 0.02, n)
    data = 0.02 * rng.lognormal(0, 0.3, n)
    exposed = 0.1 * rng.lognormal(0, 0.1, n)
    other = 0.03 * rng.lognormal(0, 0.1, n)
    step_s = compute + data + exposed + other
    ts = 1.7e9 + step * 1.0 + rng.random(n) * 1e-3
    cols = {
        "rank": rank, "step": step, "step_s": step_s, "ts": ts, "data_s": data, "compute_s": compute,
        "forward_s": compute / 3, "backward_s": compute * 0.6, "optimizer_s": compute * (1 - 1 / 3 - 0.6),
        "comm_exposed_s": exposed, "comm_total_s": exposed * 3, "other_s": other,
        "tokens": rng.integers(14000, 16384, n), "padded_tokens": np.full(n, 16384), "samples": np.full(n, 8),
        "flops": np.full(n, 6.9e14), "mem_allocated_bytes": rng.integers(60 << 30, 61 << 30, n) // 512 * 512,
        "mem_reserved_bytes": np.full(n, 72 << 30), "mem_peak_bytes": rng.integers(66 << 30, 68 << 30, n) // 512 * 512,
        "alloc_retries": np.zeros(n, dtype=np.int64), "flags": np.zeros(n, dtype=np.int64),
        "hw_flops": np.full(n, 8.3e14),
    }  # fmt: skip
    names = [f.name for f in RANK_STEP_FIELDS]
    rows = list(zip(*(cols[k].tolist() for k in names), strict=True))
    colls = []
    for i in range(n):
        r, s, tot, exp_, t = int(rank[i]), int(step[i]), float(cols["comm_total_s"][i]), float(exposed[i]), float(ts[i])
        colls.append((r, s, 0, "all_reduce", ranks, 400 << 20, 16, tot * 0.7, exp_ * 0.7, t, "dp"))
        colls.append((r, s, 1, "all_reduce", ranks, 25 << 20, 4, tot * 0.2, exp_ * 0.2, t, "dp"))
        colls.append((r, s, 2, "all_gather", ranks, 4 << 20, 1, tot * 0.08, exp_ * 0.08, t, "dp"))
        colls.append((r, s, 3, "barrier", ranks, 0, 1, tot * 0.02, exp_ * 0.02, t, "world"))
    return rows, colls


def encode_batches(run_id: int, rows: list[tuple], colls: list[tuple], per_batch: int,
                   encoding: str = "gzip") -> list[tuple[bytes, dict]]:
    out = []
    for i in range(0, len(rows), per_batch):
        b = {"v": 1, "run_id": run_id, "rank_steps": columnar(rows[i : i + per_batch], RANK_STEP_FIELDS, binary=True),
             "collectives": columnar(colls[4 * i : 4 * (i + per_batch)], COLLECTIVE_FIELDS, binary=True)}
        out.append(encode_batch(b, encoding=encoding))
    return out


REF_TABLES = f"""
CREATE TABLE ref_rank_steps ({", ".join(f"{c} {'int4' if t == 'i4' else 'float8'}" for c, t in RAW_STEP_LAYOUT.columns)});
CREATE TABLE ref_collectives ({", ".join(f"{c} {dict(i2='int2', i4='int4', i8='int8', f8='float8')[t]}" for c, t in RAW_COLL_LAYOUT.columns)});
"""


def raw_copy(url: str, run_id: int, rows: list[tuple], colls: list[tuple]) -> float:
    """Reference: psycopg binary COPY (write_row) of the same rows into row tables of the same columns
    (one row per record, no index: the fastest way to land them in Postgres)."""
    from fleetscope.server.validate import OP_CODE

    step_cols = RAW_STEP_LAYOUT.names
    names = [f.name for f in RANK_STEP_FIELDS]
    idx = [names.index(c) if c in names else None for c in step_cols]
    t0 = time.perf_counter()
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        with cur.copy(f"COPY ref_rank_steps ({', '.join(step_cols)}) FROM STDIN (FORMAT BINARY)") as cp:
            cp.set_types(["int4"] * 4 + ["float8"] * (len(step_cols) - 4))
            for row in rows:
                cp.write_row([run_id if i is None else row[i] for i in idx])
        with cur.copy(f"COPY ref_collectives ({', '.join(RAW_COLL_LAYOUT.names)}) FROM STDIN (FORMAT BINARY)") as cp:
            cp.set_types(["int4", "int4", "int4", "int4", "int2", "int4", "int8", "int4", "float8", "float8", "float8"])
            for r, s, seq, op, n, b, calls, tot, exp_, t, _dim in colls:
                cp.write_row((run_id, s, r, seq, OP_CODE[op], n, b, calls, tot, exp_, t))
        conn.commit()
    return time.perf_counter() - t0


def old_build(rev: str, into: Path) -> Path:
    """``rev``'s code laid out as the installed package (``fleetscope`` with its ``server``, ``agent``,
    ``dashboard`` and ``migrations`` subpackages) under ``into``; returns the PYTHONPATH entry."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = src / "fleetscope"
    for sub in ("server", "agent", "dashboard", "migrations"):
        if (src / sub).is_dir():
            (pkg / sub).symlink_to(src / sub, target_is_directory=True)
    return src


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-steps", type=int, default=400_000)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8192, help="rank-steps per HTTP batch")
    ap.add_argument("--senders", type=int, default=3)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--runs", type=int, default=1, help="split the rank-steps over this many runs")
    ap.add_argument("--compaction-workers", type=int, default=0)
    ap.add_argument("--before", metavar="REV", help="also measure this older commit's server first, in the same run")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="seconds between the server answering and timing (its compaction processes finish starting)")
    ap.add_argument("--encoding", choices=("auto", "gzip", "zstd"), default="auto",
                    help="body encoding; auto: what the agent uses with that server (zstd where the run registration "
                         "lists it, else gzip)")
    args = ap.parse_args()
    builds: list[tuple[str, str | None]] = [("after" if args.before else "", None)]
    if args.before:
        top = Path(tempfile.mkdtemp(prefix="fsb-old-", dir="/tmp"))
        atexit.register(shutil.rmtree, top, True)
        builds.insert(0, (f"before ({args.before})", str(old_build(args.before, top))))
    results = {}
    for label, pythonpath in builds:
        if label:
            print(f"--- {label}", flush=True)
        results[label] = measure(args, pythonpath)
    if args.before:
        (lb, b), (la, a) = list(results.items())
        print(f"sustained_after_over_before: {a['sustained'] / b['sustained']:.2f} x "
              f"({a['sustained']:,.0f} vs {b['sustained']:,.0f} rank-steps/s)")
        print(f"copy_ratio_before_after: {b['ratio']:.2f} x -> {a['ratio']:.2f} x")


def measure(args: argparse.Namespace, pythonpath: str | None) -> dict[str, float]:
    """One build's figures (``pythonpath``: serve that code instead of this checkout's)."""
    steps = max(1, args.rank_steps // args.ranks)
    n = steps * args.ranks

    tmp = Path(tempfile.mkdtemp(prefix="fsb-", dir="/tmp"))
    atexit.register(shutil.rmtree, tmp, True)  # the temp dir goes with the run
    pg = EmbeddedPostgres(tmp)
    url = pg.start()
    upgrade(url)
    server = None
    try:
        print(f"generating {n:,} rank-steps ({args.ranks} ranks x {steps} steps) + {4 * n:,} collectives ...", flush=True)
        rows, colls = make_rows(args.ranks, steps)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            for name in ("bench-copy", *(f"bench-http-{k}" for k in range(args.runs))):
                c.execute("INSERT INTO runs (name, world_size) VALUES (%s, %s)", (name, args.ranks))
            http_runs = [c.execute("SELECT id FROM runs WHERE name = %s", (f"bench-http-{k}",)).fetchone()[0]
                         for k in range(args.runs)]
            http_run = http_runs[0]
            copy_run = c.execute("SELECT id FROM runs WHERE name = 'bench-copy'").fetchone()[0]
        from fleetscope.server.auth import create_token
        from fleetscope.server.db import make_engine

        eng = make_engine(url, pool_size=1)
        token = create_token(eng, "bench", scope="admin", replace=True)
        eng.dispose()

        # --- reference: raw COPY of the same rows into row tables (then dropped)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute(REF_TABLES)
        t_copy = raw_copy(libpq_url(url), copy_run, rows, colls)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute("DROP TABLE ref_rank_steps, ref_collectives")
        copy_rate = n / t_copy
        print(f"raw COPY: {t_copy:.2f}s", flush=True)

        encoding = args.encoding
        if encoding == "auto":  # as the agent: zstd with a server that takes it (its registration lists it)
            src = (Path(pythonpath) / "fleetscope" if pythonpath else ROOT) / "server" / "ingest.py"
            encoding = "zstd" if "INGEST_ENCODINGS" in src.read_text() else "gzip"
        # each run gets a contiguous share of the steps (whole steps: every rank of a step in one run)
        per_run = -(-steps // args.runs) * args.ranks
        by_run = []
        for k, rid in enumerate(http_runs):
            lo, hi = k * per_run, min(n, (k + 1) * per_run)
            by_run.append(encode_batches(rid, rows[lo:hi], colls[4 * lo:4 * hi], args.batch, encoding) if hi > lo else [])
        batches = [b[i] for i in range(max(map(len, by_run))) for b in by_run if i < len(b)]  # runs interleaved
        wire_bytes = sum(len(b) for b, _ in batches)
        env = {**os.environ, "FLEETSCOPE_COMPACT_GRACE_S": "2", "FLEETSCOPE_COMPACT_INTERVAL_S": "0.5"}
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
        server = subprocess.Popen(
            [sys.executable, "-m", "fleetscope.cli", "serve", "--database-url", url, "--port", str(args.port),
             "--compaction-workers", str(args.compaction_workers)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp,
        )
        base = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.2)

        time.sleep(args.settle_s)  # /healthz answers before the compaction processes finish importing
        lat: list[float] = []
        retries = [0]
        q = list(range(len(batches)))
        lock = threading.Lock()

        def sender() -> None:
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120) as h:
                while True:
                    with lock:
                        if not q:
                            return
                        i = q.pop(0)
                    body, headers = batches[i]
                    while True:
                        t = time.perf_counter()
                        r = h.post("/api/v1/ingest", content=body, headers=headers)
                        if r.status_code in (429, 503):
                            retries[0] += 1
                            time.sleep(float(r.headers.get("Retry-After", "1")))
                            continue
                        r.raise_for_status()
                        lat.append(time.perf_counter() - t)
                        break

        t0 = time.perf_counter()
        threads = [threading.Thread(target=sender) for _ in range(args.senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_accept = time.perf_counter() - t0
        # sustained = until everything is compacted into step blocks (the server's own compactor)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            while c.execute("SELECT count(*) FROM ingest_fragments").fetchone()[0] > 0:
                time.sleep(0.05)
            t_done = time.perf_counter() - t0
            stored = c.execute("SELECT sum(rank_steps), sum(collective_records) FROM runs WHERE id = ANY(%s)",
                               (http_runs,)).fetchone()
            assert tuple(map(int, stored)) == (n, 4 * n), stored
            c.execute("VACUUM ANALYZE steps, run_collectives, runs")
            total = c.execute(
                "SELECT pg_total_relation_size('steps') + pg_total_relation_size('run_collectives')"
            ).fetchone()[0]
            coll_bytes = c.execute("SELECT coalesce(sum(octet_length(coll_block)), 0) FROM steps").fetchone()[0]
            # reference layout: one row per rank-step, same columns, primary key
            c.execute(
                "CREATE TABLE ref_rank_steps (run_id int, step int, rank int, flags int, "
                + ", ".join(f"{f} float8" for f in RAW_STEP_LAYOUT.names[4:])
                + ", PRIMARY KEY (run_id, step, rank))"
            )
        with psycopg.connect(libpq_url(url)) as c, c.cursor() as cur:
            names = [f.name for f in RANK_STEP_FIELDS]
            idx = [names.index(x) for x in RAW_STEP_LAYOUT.names[1:]]
            with cur.copy("COPY ref_rank_steps FROM STDIN") as cp:
                for row in rows:
                    cp.write_row([http_run, *(row[i] for i in idx)])
            c.commit()
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute("VACUUM ANALYZE ref_rank_steps")
            ref = c.execute("SELECT pg_total_relation_size('ref_rank_steps')").fetchone()[0]
        lat_ms = np.array(lat) * 1e3
        print(f"runs: {args.runs}, compaction workers: {args.compaction_workers} (0: a thread of the server), "
              f"load {os.getloadavg()}")
        print(f"batches: {len(batches)} x {args.batch} rank-steps (+4 collectives each), {args.senders} senders, "
              f"{wire_bytes / n:.1f} wire bytes per rank-step (msgpack+{encoding}), {retries[0]} backpressure retries")
        print(f"ingest_accept_rate: {n / t_accept:,.0f} rank-steps/s")
        print(f"ingest_sustained_rate: {n / t_done:,.0f} rank-steps/s (accepted and compacted, + {4 * n / t_done:,.0f} collectives/s)")
        print(f"raw_copy_rate: {copy_rate:,.0f} rank-steps/s (+ 4x collectives; psycopg binary COPY write_row into row tables)")
        print(f"ingest_vs_copy_ratio: {n / t_done / copy_rate:.2f} x")
        print(f"batch_latency_p50: {np.percentile(lat_ms, 50):.0f} ms")
        print(f"batch_latency_p99: {np.percentile(lat_ms, 99):.0f} ms")
        print(f"bytes_per_rank_step: {(total - coll_bytes) / n:.1f} B (steps table + toast + index + rollups, collectives excluded)")
        print(f"bytes_per_rank_step_with_collectives: {total / n:.1f} B (incl. 4 collective records per rank-step)")
        print(f"reference_bytes_per_rank_step: {ref / n:.1f} B (one row per rank-step with primary key)")
        return {"sustained": n / t_done, "ratio": n / t_done / copy_rate}
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        pg.stop()


if __name__ == "__main__":
    main()
