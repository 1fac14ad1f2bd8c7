"""One rank's breakdown (``GET /api/v1/runs/{id}/ranks/{rank}/steps``) on large runs: latency warm and cold.

    python bench/rank_steps.py [--ranks 1024] [--steps 5000] [--wide-ranks 262144] [--wide-steps 24] [--reps 7]

1. The large run of ``bench/analysis.py`` (``--ranks`` × ``--steps``, a straggler at rank 317, loaded the
   same way: columnar batches through the real ingest and compaction, ``fleetscope serve`` on embedded
   Postgres), then over HTTP:
   - a page (1,000 steps) of one rank: **cold** = the first read of a page no request read before
     (another rank, another step range each time; nothing of it in the server process — the paged
     form is not cached — and its blocks not read since compaction), **warm** = the same request again;
   - the whole run downsampled (``max_points=600``, what the run page's drill-down asks): cold = the
     first request for a rank (reads every step's block), warm = again (the per-run-version cache);
   - the notebook client's ``rank_steps(run, 317)`` (every page);
   - in-process: the heatmap of a component other than step time (``compute_s``: data, compute and other
     decoded from every block once), cold and cached.
2. A wide run, ``--wide-ranks`` × ``--wide-steps`` (262,144 ranks: a page is 8 steps, whatever ``limit``
   asks): the same page and series timings for one rank — what bounded work means at the largest world
   size (each block holds every rank: it is decompressed whole, the rank's bytes picked out).

Medians of ``--reps``. Prints ``name: value unit`` lines last, with the 1-minute load average
(docs/benchmarks.md, "One rank's breakdown").
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from analysis import load_big_run, start_server, wait_compacted  # noqa: E402

from fleetscope.client import Client  # noqa: E402
from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))
    print(f"  {name}: {value:.4g} {unit}", file=sys.stderr)


def _once(h: httpx.Client, path: str, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = h.get(path, params=params)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def time_rank_reads(base: str, rid: int, prefix: str, ranks: list[int], afters: list[int | None], reps: int,
                    page: int = 1000) -> None:
    """Cold: each (rank, page) read once, a different rank and range each time; warm: the first again."""
    path = f"/api/v1/runs/{rid}/ranks/{{}}/steps"
    with httpx.Client(base_url=base, timeout=300) as h:
        cold = []
        got: dict[str, Any] = {}
        for r, a in zip(ranks, afters, strict=True):
            dt, got = _once(h, path.format(r), {"limit": page, **({"after": a} if a is not None else {})})
            cold.append(dt)
        figure(f"{prefix}_page_rows", len(got["steps"]), "steps")
        figure(f"{prefix}_page_cold_p50", statistics.median(cold) * 1e3, "ms")
        r0, a0 = ranks[0], afters[0]
        warm = [_once(h, path.format(r0), {"limit": page, **({"after": a0} if a0 is not None else {})})[0]
                for _ in range(reps)]
        figure(f"{prefix}_page_warm_p50", statistics.median(warm) * 1e3, "ms")
        cold_s = []
        for r in ranks:
            dt, got = _once(h, path.format(r), {"max_points": 600})
            cold_s.append(dt)
        figure(f"{prefix}_series_rows", len(got["steps"]), "rows")
        figure(f"{prefix}_series_steps_read", got["points"], "steps")
        figure(f"{prefix}_series_cold_p50", statistics.median(cold_s) * 1e3, "ms")
        warm_s = [_once(h, path.format(ranks[0]), {"max_points": 600})[0] for _ in range(reps)]
        figure(f"{prefix}_series_warm_p50", statistics.median(warm_s) * 1e3, "ms")


def check_straggler(base: str, rid: int, rank: int) -> None:
    body = httpx.get(f"{base}/api/v1/runs/{rid}/ranks/{rank}/steps", params={"limit": 200}, timeout=300).json()
    ratio = float(np.median([r["compute_s"] / r["median_compute_s"] for r in body["steps"]]))
    figure(f"straggler_{rank}_compute_vs_median", ratio, "x")


def time_client(base: str, rid: int, rank: int) -> None:
    with Client(base, timeout=300) as c:
        t0 = time.perf_counter()
        df = c.rank_steps(rid, rank)
        figure("client_rank_steps_whole_run", time.perf_counter() - t0, "s")
        figure("client_rank_steps_rows", len(df), "rows")


def time_heatmap(url: str, rid: int, reps: int) -> None:
    from fleetscope.server import rank_matrix, reports
    from fleetscope.server.db import make_engine

    eng = make_engine(url, pool_size=2)
    try:
        rank_matrix.clear_cache()
        t0 = time.perf_counter()
        reports.rank_heatmap(eng, rid, field="work_s")
        figure("heatmap_work_cold", (time.perf_counter() - t0) * 1e3, "ms")
        t0 = time.perf_counter()
        reports.rank_heatmap(eng, rid, field="compute_s")
        figure("heatmap_compute_first", (time.perf_counter() - t0) * 1e3, "ms")
        ts = []
        for f in ("data_s", "other_s", "straggler_wait_s"):
            t0 = time.perf_counter()
            reports.rank_heatmap(eng, rid, field=f)
            ts.append(time.perf_counter() - t0)
        figure("heatmap_other_components_after_p50", statistics.median(ts) * 1e3, "ms")
        warm = []
        for _ in range(reps):
            t0 = time.perf_counter()
            reports.rank_heatmap(eng, rid, field="compute_s")
            warm.append(time.perf_counter() - t0)
        figure("heatmap_compute_cached_p50", statistics.median(warm) * 1e3, "ms")
    finally:
        eng.dispose()


def load_wide_run(base: str, ranks: int, steps: int, straggler: int, per_batch: int = 65_536) -> int:
    """``ranks`` × ``steps``, every step sent in batches of ``per_batch`` ranks (the body cap)."""
    names = [f.name for f in RANK_STEP_FIELDS]
    rng = np.random.default_rng(1)
    c = Client(base, timeout=600)
    rid = c.register_run({"name": "wide", "model_family": "llm-70b", "world_size": ranks, "device_type": "H100",
                          "peak_flops": 989e12})
    t0 = time.monotonic()
    ts = 1.7e9
    for step in range(steps):
        factor = np.ones(ranks)
        factor[straggler] = 1.3
        compute = 0.8 * rng.lognormal(0, 0.01, ranks) * factor
        data = 0.016 * rng.lognormal(0, 0.3, ranks)
        other = 0.024 * rng.lognormal(0, 0.1, ranks)
        work = compute + data + other
        exposed = 0.05 + work.max() - work
        for lo in range(0, ranks, per_batch):
            sl = slice(lo, min(lo + per_batch, ranks))
            n = sl.stop - sl.start
            cols = {"rank": np.arange(sl.start, sl.stop), "step": np.full(n, step), "ts": np.full(n, ts),
                    "step_s": (work + exposed)[sl], "data_s": data[sl], "compute_s": compute[sl],
                    "comm_exposed_s": exposed[sl], "comm_total_s": exposed[sl] + 0.2, "other_s": other[sl],
                    "flags": np.zeros(n, dtype=np.int64)}
            batch: dict[str, Any] = {"v": 1, "run_id": rid, "rank_steps": {k: cols[k].tolist() for k in names if k in cols}}
            c.ingest(batch)
        ts += float(work.max()) + 0.05
    c.finish_run(rid)
    sent = time.monotonic() - t0
    comp = wait_compacted(base, rid, ranks * steps, steps)
    print(f"wide run: {ranks * steps} rank-steps sent in {sent:.1f}s, compacted {comp:.1f}s later", file=sys.stderr)
    figure("wide_run_ingest_and_compaction", sent + comp, "s")
    return rid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--straggler", type=int, default=317)
    ap.add_argument("--wide-ranks", type=int, default=262_144, help="0: no wide run")
    ap.add_argument("--wide-steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--database-url", default=None, help="an empty Postgres database (default: embedded)")
    args = ap.parse_args()

    pg = None
    url = args.database_url
    if url is None:
        from fleetscope.server.db import EmbeddedPostgres

        pg_dir = tempfile.mkdtemp(prefix="fsb-", dir="/tmp")
        atexit.register(shutil.rmtree, pg_dir, True)
        pg = EmbeddedPostgres(pg_dir)
        pg.start()
        url = pg._server.get_uri("postgres")
    from fleetscope.server.db import upgrade

    upgrade(url)
    proc, base = start_server(url)
    try:
        rid = load_big_run(base, args.ranks, args.steps, args.straggler)
        check_straggler(base, rid, args.straggler)
        # cold: five distinct ranks, each on a page of steps no earlier read touched
        ranks = [args.straggler, *[(args.straggler + 101 * i) % args.ranks for i in range(1, 5)]]
        afters = [None if i == 0 or 1000 * i >= args.steps else 1000 * i - 1 for i in range(5)]
        time_rank_reads(base, rid, "big", ranks, afters, args.reps)
        time_client(base, rid, args.straggler)
        time_heatmap(url, rid, args.reps)
        if args.wide_ranks:
            wide_straggler = min(200_000, args.wide_ranks - 1)
            wid = load_wide_run(base, args.wide_ranks, args.wide_steps, wide_straggler)
            check_straggler(base, wid, wide_straggler)
            # a page of a 262,144-rank run is 8 steps: cold = three distinct ranks on three distinct pages
            wranks = [wide_straggler, 0, args.wide_ranks - 1]
            page = max(1, 2 * 1024 * 1024 // args.wide_ranks)
            wafters = [None if i == 0 or page * i >= args.wide_steps else page * i - 1 for i in range(3)]
            time_rank_reads(base, wid, "wide", wranks, wafters, args.reps)
    finally:
        proc.terminate()
        proc.wait(30)
        if pg is not None:
            pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
