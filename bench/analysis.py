"""Analysis benchmark: stragglers found on 1,024 ranks, and analysis latency on a large run.

    python bench/analysis.py [--ranks 1024] [--steps 5000] [--sim-steps 30] [--straggler 317]

1. ``fleetscope simulate --straggler R:1.3`` on ``--ranks`` ranks (the real agent transport, the real
   ingest and compaction): is rank R named first, and is no other rank flagged? (docs/benchmarks.md "Targets")
2. A large run (``--ranks`` × ``--steps``, the targets' data set) ingested as columnar msgpack
   batches, then the run summary over HTTP (warm, median of 15) and each analysis function timed
   in-process; side by side, the straggler report recomputed by decoding every step block (the scan
   the per-rank rollups avoid) and the cost of the compaction fold per rank-step.

The server runs as its own process (``fleetscope serve``) on embedded Postgres. Prints
``name: value unit`` lines last (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetscope.client import Client  # noqa: E402
from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_COMPACT_GRACE_S": "2",
           "FLEETSCOPE_ALERTS_ENABLED": "false"}
    p = subprocess.Popen([sys.executable, "-m", "fleetscope", "serve", "--database-url", url, "--port", str(port),
                          "--insecure-no-auth"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    Client(base).wait_ready(120)
    return p, base


def wait_compacted(base: str, run_id: int, rank_steps: int, steps: int, timeout: float = 1800) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = httpx.get(f"{base}/api/v1/runs/{run_id}", timeout=30).json()
        if r["steps"] >= steps and r["rank_steps"] >= rank_steps:
            # the counters include landed-but-uncompacted rows: wait for the blocks too
            s = httpx.get(f"{base}/api/v1/runs/{run_id}/summary", timeout=60).json()
            if s["steps"] >= steps:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError("compaction did not finish")


def run_id_of(base: str, name: str) -> int:
    return int(httpx.get(f"{base}/api/v1/runs", params={"name": name}).json()["runs"][0]["id"])


def simulate_straggler(base: str, ranks: int, steps: int, straggler: int) -> None:
    from fleetscope.simulate import run_simulation

    t0 = time.monotonic()
    run_simulation(server=base, token=None, run="sim-straggler", family="llm-70b", ranks=ranks, steps=steps,
                   seed=3, straggler={straggler: 1.3})
    rid = run_id_of(base, "sim-straggler")
    wait_compacted(base, rid, ranks * steps, steps)
    print(f"simulate: {ranks} ranks x {steps} steps sent and compacted in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    s = httpx.get(f"{base}/api/v1/runs/{rid}/summary", timeout=60).json()
    named = [x["rank"] for x in s["stragglers"]]
    print(f"stragglers: {s['stragglers'][:3]}", file=sys.stderr)
    figure("straggler_named_first", float(bool(named) and named[0] == straggler), "bool")
    figure("stragglers_flagged", float(len(named)), "ranks")
    figure("other_ranks_flagged", float(len([r for r in named if r != straggler])), "ranks")


def big_run_batches(ranks: int, steps: int, straggler: int, chunk: int, seed: int = 0,
                    with_collectives: bool = False) -> Any:
    """Columnar batches of a synchronous job (the model of fleetscope.synthetic, vectorised)."""
    rng = np.random.default_rng(seed)
    names = [f.name for f in RANK_STEP_FIELDS]
    ts = 1.7e9
    for lo in range(0, steps, chunk):
        k = min(chunk, steps - lo)
        jitter = rng.lognormal(0, 0.03, (k, 1))
        factor = np.ones((1, ranks))
        factor[0, straggler] = 1.3
        compute = 0.80 * jitter * rng.lognormal(0, 0.01, (k, ranks)) * factor
        data = 0.016 * rng.lognormal(0, 0.3, (k, ranks))
        other = 0.024 * rng.lognormal(0, 0.1, (k, ranks))
        work = compute + data + other
        wait = work.max(axis=1, keepdims=True) - work
        own = 0.05 * jitter
        exposed = own + wait
        step_s = work + exposed
        start = ts + np.cumsum(np.r_[0, (work.max(axis=1) + own[:, 0])[:-1]])
        ts = float(start[-1] + work.max(axis=1)[-1] + own[-1, 0])
        n = k * ranks
        cols = {
            "rank": np.tile(np.arange(ranks), k), "step": np.repeat(np.arange(lo, lo + k), ranks),
            "step_s": step_s.ravel(), "ts": np.repeat(start, ranks), "data_s": data.ravel(),
            "compute_s": compute.ravel(), "forward_s": compute.ravel() / 3, "backward_s": compute.ravel() * 0.6,
            "optimizer_s": compute.ravel() * (1 - 1 / 3 - 0.6), "comm_exposed_s": exposed.ravel(),
            "comm_total_s": (0.3 * jitter + wait).ravel(), "other_s": other.ravel(),
            "tokens": rng.integers(7000, 8192, n), "padded_tokens": np.full(n, 8192), "samples": np.full(n, 4),
            "flops": np.full(n, 3.4e15), "mem_allocated_bytes": np.full(n, 60 << 30),
            "mem_reserved_bytes": np.full(n, 72 << 30), "mem_peak_bytes": np.full(n, 66 << 30),
            "alloc_retries": np.zeros(n, dtype=np.int64), "flags": np.zeros(n, dtype=np.int64),
        }  # fmt: skip
        cols["hw_flops"] = np.full(n, 4.1e15)
        out = {k2: cols[k2].tolist() for k2 in names}
        if with_collectives:
            # 4 records per rank-step, as the agent sends them: 2 gradient all-reduce buckets and an
            # all-gather in dp, a barrier in world (every collective names its dimension)
            r = np.tile(np.arange(ranks), k)
            st = np.repeat(np.arange(lo, lo + k), ranks)
            tot = (0.3 * jitter + wait).ravel()
            exp_ = exposed.ravel()
            t0 = np.repeat(start, ranks)
            recs = [(0, "all_reduce", 400 << 20, 16, 0.7, "dp"), (1, "all_reduce", 25 << 20, 4, 0.2, "dp"),
                    (2, "all_gather", 4 << 20, 1, 0.08, "dp"), (3, "barrier", 0, 1, 0.02, "world")]
            m = len(recs)
            out_c = {
                "rank": np.repeat(r, m).tolist(), "step": np.repeat(st, m).tolist(),
                "seq": np.tile([x[0] for x in recs], n).tolist(), "op": [x[1] for x in recs] * n,
                "group_size": [ranks] * (n * m), "bytes": np.tile([x[2] for x in recs], n).tolist(),
                "calls": np.tile([x[3] for x in recs], n).tolist(),
                "total_s": (np.repeat(tot, m) * np.tile([x[4] for x in recs], n)).tolist(),
                "exposed_s": (np.repeat(exp_, m) * np.tile([x[4] for x in recs], n)).tolist(),
                "start_ts": np.repeat(t0, m).tolist(), "dim": [x[5] for x in recs] * n,
            }
            yield out, out_c
        else:
            yield out, None


def load_big_run(base: str, ranks: int, steps: int, straggler: int, with_collectives: bool = False) -> int:
    c = Client(base, timeout=300)
    rid = c.register_run({"name": "big", "model_family": "llm-70b", "world_size": ranks, "device_type": "H100",
                          "peak_flops": 989e12, "config": {"tp": 1}, "meta": {"flops_source": "estimated"}})
    hosts = [{"rank": r, "host": f"node{r // 8:04d}", "node": f"node{r // 8:04d}", "local_rank": r % 8}
             for r in range(ranks)]
    t0 = time.monotonic()
    chunk = max(1, (15_000 if with_collectives else 60_000) // ranks)
    for i, (cols, colls) in enumerate(big_run_batches(ranks, steps, straggler, chunk, with_collectives=with_collectives)):
        batch: dict[str, Any] = {"v": 1, "run_id": rid, "rank_steps": cols}
        if colls is not None:
            batch["collectives"] = colls
        if i == 0:
            batch["ranks"] = hosts
        c.ingest(batch)
    c.finish_run(rid)
    sent = time.monotonic() - t0
    comp = wait_compacted(base, rid, ranks * steps, steps)
    print(f"big run: {ranks * steps} rank-steps sent in {sent:.1f}s, compacted {comp:.1f}s later", file=sys.stderr)
    figure("big_run_ingest_and_compaction", sent + comp, "s")
    return rid


def _timed(fn: Any, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_analysis(base: str, url: str, rid: int, straggler: int) -> None:
    from fleetscope.server import reports
    from fleetscope.server.analysis.stragglers import from_blocks
    from fleetscope.server.db import make_engine
    from fleetscope.server.store import runs as run_store
    from fleetscope.server.store.steps import recent_blocks

    s = httpx.get(f"{base}/api/v1/runs/{rid}/summary", timeout=60).json()
    named = [x["rank"] for x in s["stragglers"]]
    figure("big_run_straggler_named_first", float(bool(named) and named[0] == straggler), "bool")
    figure("big_run_other_ranks_flagged", float(len([r for r in named if r != straggler])), "ranks")
    with httpx.Client(base_url=base, timeout=60) as h:
        summary_s = _timed(lambda: h.get(f"/api/v1/runs/{rid}/summary").raise_for_status(), 15)
    figure("summary_latency_warm_p50", summary_s * 1e3, "ms")
    eng = make_engine(url, pool_size=2)
    try:
        def stragglers_uncached() -> None:
            reports.clear_caches()
            reports.stragglers(eng, rid)

        figure("run_stragglers_latency_uncached", _timed(stragglers_uncached, 7) * 1e3, "ms")

        # the summary cold (every process cache cleared; the run_stats figures row stays), and what
        # each field group adds: each timed cold on its own
        from fleetscope.server.reports import runs as rr

        def cold_summary() -> None:
            reports.clear_caches()
            reports.run_summary(eng, rid)

        figure("summary_latency_cold", _timed(cold_summary, 3) * 1e3, "ms")
        run0 = run_store.get_run(eng, rid)
        assert run0 is not None
        fig0 = reports.figures(eng, [run0])[rid]

        def field(name: str, fn: Any) -> None:
            def cold() -> None:
                reports.clear_caches()
                fn()

            figure(f"summary_field_{name}_cold", _timed(cold, 3) * 1e3, "ms")

        field("comm_by_dim_pipeline_phases_seqlen", lambda: rr.parallel_summary(eng, run0, fig0))
        field("compile", lambda: rr.run_compile(eng, rid))
        field("token_balance", lambda: rr.run_token_balance(eng, run0))
        field("network", lambda: rr.run_network(eng, run0, rr._stragglers(eng, run0, fig0)))
        field("overlap_advice", lambda: rr.run_overlap_advice(
            eng, run0, fig0, rr.summary_bottlenecks(rr._bottlenecks(eng, run0, fig0))))
        figure("run_stragglers_latency_cached", _timed(lambda: reports.stragglers(eng, rid), 7) * 1e3, "ms")
        figure("run_bottlenecks_latency", _timed(lambda: reports.bottlenecks(eng, rid), 5) * 1e3, "ms")
        figure("run_goodput_latency", _timed(lambda: reports.goodput(eng, rid), 5) * 1e3, "ms")
        figure("check_run_latency", _timed(lambda: reports.check_run(eng, rid), 3) * 1e3, "ms")
        # reference in the same run: the straggler figures by decoding every step block (no rollups)
        run = run_store.get_run(eng, rid, pending=False)
        assert run is not None
        t0 = time.perf_counter()
        ref = from_blocks(recent_blocks(eng, rid, run.steps), 0)
        scan = time.perf_counter() - t0
        assert ref is not None
        figure("straggler_scan_of_all_blocks", scan * 1e3, "ms")
        figure("rollups_speedup_vs_scan", scan / max(figure_value("run_stragglers_latency_uncached") / 1e3, 1e-9), "x")
    finally:
        eng.dispose()


def figure_value(name: str) -> float:
    return next(v for n, v, _ in FIGURES if n == name)


def time_fold(url: str, ranks: int) -> None:
    """Cost of the rank-rollup fold inside compaction: per pass of 1 step (a live job at 1 step/s)
    and per rank-step in bulk passes of 50 steps (catching up, the ingest benchmark)."""
    import psycopg
    from fleetscope.server.analysis.rollups import fold_rank_rollups
    from fleetscope.server.db import libpq_url
    from fleetscope.server.store.compaction import RollupWriter

    rng = np.random.default_rng(1)
    run_id = 999_999  # a run id of its own, removed afterwards
    with psycopg.connect(libpq_url(url)) as conn:
        for steps in (1, 50):
            n = ranks * steps
            ts = []
            for i in range(10):  # consecutive passes, committed: the steady state (rows updated in place)
                S = {"run_id": np.full(n, run_id), "step": np.repeat(np.arange(i * steps, (i + 1) * steps), ranks),
                     "rank": np.tile(np.arange(ranks), steps), "is_old": np.zeros(n, dtype=bool)}
                for f in ("step_s", "data_s", "compute_s", "other_s", "comm_exposed_s"):
                    S[f] = rng.lognormal(0, 0.05, n)
                C = {k: np.zeros(0, dtype=np.int64) for k in ("run_id", "step", "rank", "seq")}
                C["start_ts"] = np.zeros(0)
                C["is_old"] = np.zeros(0, dtype=bool)
                gkeys = np.unique(S["run_id"] * (1 << 32) + S["step"])
                gid = np.searchsorted(gkeys, S["run_id"] * (1 << 32) + S["step"])
                with conn.cursor() as cur:
                    t0 = time.perf_counter()
                    fold_rank_rollups(RollupWriter(cur), S=S, C=C, gid=gid, cgid=np.zeros(0, dtype=np.int64),
                                      gkeys=gkeys)
                    ts.append(time.perf_counter() - t0)
                conn.commit()
            med = statistics.median(ts[3:])
            if steps == 1:
                figure(f"rollup_fold_pass_{ranks}_ranks_1_step", med * 1e3, "ms")
            else:
                figure(f"rollup_fold_cost_bulk_{steps}_steps", med / n * 1e6, "us/rank-step")
        for t in ("rank_rollups", "rank_windows"):
            conn.execute(f"DELETE FROM {t} WHERE run_id = %s", (run_id,))
        conn.commit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000, help="steps of the large run (targets: 5,000)")
    ap.add_argument("--sim-steps", type=int, default=30, help="steps sent by simulate --straggler")
    ap.add_argument("--straggler", type=int, default=317)
    ap.add_argument("--database-url", default=None, help="an empty Postgres database (default: embedded)")
    ap.add_argument("--collectives", action="store_true",
                    help="the large run also carries 4 collective records per rank-step, each naming its dimension")
    args = ap.parse_args()

    pg = None
    url = args.database_url
    if url is None:
        from fleetscope.server.db import EmbeddedPostgres

        pg_dir = tempfile.mkdtemp(prefix="fsb-", dir="/tmp")
        atexit.register(shutil.rmtree, pg_dir, True)  # the temp dir goes with the run
        pg = EmbeddedPostgres(pg_dir)
        pg.start()
        url = pg._server.get_uri("postgres")
    from fleetscope.server.db import upgrade

    upgrade(url)
    proc, base = start_server(url)
    try:
        simulate_straggler(base, args.ranks, args.sim_steps, args.straggler)
        rid = load_big_run(base, args.ranks, args.steps, args.straggler, with_collectives=args.collectives)
        time_analysis(base, url, rid, args.straggler)
        time_fold(url, args.ranks)
    finally:
        proc.terminate()
        proc.wait(30)
        if pg is not None:
            pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")  # the machine is shared: context for the times
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
