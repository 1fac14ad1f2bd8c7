"""Slow-node finder benchmark: precision and recall of the run summary's ``network.slow_nodes`` on
simulated 1,024-rank fleets, and what the ``network`` field costs on the 1,024 × 5,000 run.

    python bench/node_finder.py [--fleets-per-case 2] [--big-steps 5000] [--skip-big]

1. **Finder quality** (pure analysis, no server): fleets of ``--nodes`` × 8 ranks (128 × 8 = 1,024)
   made by the model of ``fleetscope.synthetic`` vectorised — synchronous steps (1 s compute with
   per-rank jitter, the others wait for the slowest rank inside the collectives), four collective
   records per rank-step (two gradient all-reduce buckets, an all-gather, a barrier) — with k ∈ {0,
   1, 2, 4} slow nodes at factor f ∈ {1.25, 1.5, 2, 3} (their collectives take f× as long, like
   ``simulate --slow-node``), noise σ ∈ {0.05, 0.1, 0.2, 0.3}, and in every
   fleet three confounders on healthy nodes: a compute straggler (1.3×), one network-slow rank
   (f×, a single bad GPU/link: its node must not be named), and a rank 10 % faster at compute (it waits
   longer inside every collective, so its busbw looks lower). Noise: σ per record, plus a persistent
   per-rank offset and a per-(node, step) offset shared by a node's ranks, σ/2 each (a rank whose injected factor ×
   persistent offset reaches 1/0.7 counts as truly slow for the slow-rank figures). Each fleet gives the analysis the
   sample the server would read (``reports.network.sample_plan``: 64 steps at 4,096 records per
   step). Precision and recall are pooled over fleets with f ≥ 1.5 (above the detection floor 1/0.7
   ≈ 1.43); f = 1.25 is reported apart. One fleet is also built by ``fleetscope.synthetic``
   itself (``RunSpec.slow_nodes``) as a cross-check of the vectorised model.
2. **Cost** (``--skip-big`` skips it): the 1,024 × 5,000 run of ``bench/analysis.py`` plus four
   collective records per rank-step and one slow node, ingested through the real server
   (``fleetscope serve`` on embedded Postgres) as binary msgpack batches; then, in the same run and
   interleaved by rounds, the run summary cold (process cache cleared) and warm, with the
   ``network`` field and with it stubbed out, in-process on the same database; the warm summary over
   HTTP; and the parts of a cold network computation (sampled blocks query + decode, analysis).

Prints ``name: value unit`` lines last (docs/benchmarks.md "Cluster and network health").
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

from fleetscope.wire import COLLECTIVE_OPS  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []
OP = {n: i for i, n in enumerate(COLLECTIVE_OPS)}
DIM_DP, DIM_WORLD = 1001, 1002
# (op, bytes per call, calls, share of the rank's collective time): the records of fleetscope.synthetic
RECORDS = (("all_reduce", 4_375_000_000, 6, 0.7, DIM_DP), ("all_reduce", 1_093_750_000, 2, 0.2, DIM_DP),
           ("all_gather", 4 << 20, 1, 0.08, DIM_DP), ("barrier", 0, 1, 0.02, DIM_WORLD))


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))


# --------------------------------------------------------------------------------------------- quality


def fleet_blocks(rng: np.random.Generator, *, nodes: int, per_node: int, steps: int, net: np.ndarray,
                 compute: np.ndarray, noise: float) -> tuple[list[tuple[int, dict[str, np.ndarray]]], np.ndarray]:
    """Decoded collective blocks of ``steps`` steps of a synchronous fleet; ``net[r]``: rank r's collective
    slowdown, ``compute[r]``: its compute factor. Noise: per record σ, plus a persistent per-rank offset
    and a per-(node, step) shared one of σ/2 each (links of a node vary together)."""
    R = nodes * per_node
    persistent = rng.lognormal(0, noise / 2, R)
    out = []
    for s in range(steps):
        jitter = rng.lognormal(0, 0.03)
        work = (1.0 * jitter * rng.lognormal(0, 0.01, R) * compute + 0.02 * rng.lognormal(0, 0.3, R)
                + 0.03 * rng.lognormal(0, 0.1, R))
        wait = work.max() - work
        node_noise = np.repeat(rng.lognormal(0, noise / 2, nodes), per_node)
        base = (0.3 * jitter + wait) * net * persistent * node_noise
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "seq", "op", "group_size", "bytes", "calls",
                                                             "total_s", "exposed_s", "start_ts", "dim")}
        for seq, (op, per_call, calls, share, dim) in enumerate(RECORDS):
            t = base * share * rng.lognormal(0, noise, R)
            for k, v in (("rank", np.arange(R)), ("seq", np.full(R, seq)), ("op", np.full(R, OP[op])),
                         ("group_size", np.full(R, R)), ("bytes", np.full(R, float(per_call * calls))),
                         ("calls", np.full(R, calls)), ("total_s", t), ("exposed_s", 0.5 * t),
                         ("start_ts", np.zeros(R)), ("dim", np.full(R, dim))):
                cols[k].append(v)
        out.append((s, {k: np.concatenate(v) for k, v in cols.items()}))
    return out, persistent


def quality(args: argparse.Namespace) -> None:
    from fleetscope.server.analysis.network import network_health, summary_network

    nodes, per_node = args.nodes, 8
    R = nodes * per_node
    hosts = {r: (f"node{r // per_node:04d}", f"node{r // per_node:04d}") for r in range(R)}
    steps = min(200, max(16, 262_144 // (4 * R)))  # what reports.network.sample_plan reads at 4 records per rank-step
    pooled = {"tp": 0, "fp": 0, "fn": 0}
    ranks_pooled = {"tp": 0, "fp": 0, "fn": 0}
    fast_flagged = 0
    by_factor: dict[float, list[int]] = {}
    by_noise: dict[float, list[int]] = {}
    below = {"tp": 0, "fp": 0, "fn": 0}
    false_on_clean = 0
    clean_fleets = 0
    rank_found = rank_cases = 0
    times = []
    seed = 0
    for f in (1.25, 1.5, 2.0, 3.0):
        for sigma in (0.05, 0.1, 0.2, 0.3):
            for k in (0, 1, 2, 4):
                for _ in range(args.fleets_per_case):
                    seed += 1
                    rng = np.random.default_rng(seed)
                    picks = rng.choice(nodes, size=k + 3, replace=False)
                    slow, strag_node, bad_rank_node = set(picks[:k].tolist()), int(picks[k]), int(picks[k + 1])
                    fast = int(picks[k + 2]) * per_node + int(rng.integers(per_node))
                    net = np.ones(R)
                    for n in slow:
                        net[n * per_node:(n + 1) * per_node] = f
                    bad_rank = bad_rank_node * per_node + int(rng.integers(per_node))
                    net[bad_rank] = f
                    compute = np.ones(R)
                    compute[strag_node * per_node + int(rng.integers(per_node))] = 1.3  # a compute straggler
                    compute[fast] = 0.9  # a rank consistently 10 % faster: it waits longer in every collective
                    bl, persistent = fleet_blocks(rng, nodes=nodes, per_node=per_node, steps=steps, net=net, compute=compute,
                                      noise=sigma)
                    t0 = time.perf_counter()
                    res = summary_network(network_health(bl, hosts), limit=R)
                    times.append(time.perf_counter() - t0)
                    found = {int(x["node"][4:]) for x in res["slow_nodes"]}
                    tp, fp, fn = len(found & slow), len(found - slow), len(slow - found)
                    bucket = pooled if f >= 1.5 else below
                    bucket["tp"] += tp
                    bucket["fp"] += fp
                    bucket["fn"] += fn
                    if k == 0:
                        clean_fleets += 1
                        false_on_clean += len(found)
                    flagged = {x["rank"] for x in res["slow_ranks"]}
                    # truly slow ranks: injected factor × persistent offset at or past the floor (1/0.7)
                    truth = set(np.flatnonzero(net * persistent >= 1 / 0.7).tolist())
                    fast_flagged += int(fast in flagged)
                    if f >= 1.5:
                        ranks_pooled["tp"] += len(flagged & truth)
                        ranks_pooled["fp"] += len(flagged - truth)
                        ranks_pooled["fn"] += len(truth - flagged)
                        by_factor.setdefault(f, [0, 0])
                        by_factor[f][0] += tp
                        by_factor[f][1] += tp + fn
                        by_noise.setdefault(sigma, [0, 0])
                        by_noise[sigma][0] += tp
                        by_noise[sigma][1] += tp + fn
                        rank_cases += 1
                        rank_found += int(bad_rank in {x["rank"] for x in res["slow_ranks"]})
    p = pooled["tp"] / max(pooled["tp"] + pooled["fp"], 1)
    r = pooled["tp"] / max(pooled["tp"] + pooled["fn"], 1)
    print(f"quality: {seed} fleets of {R} ranks, {steps} sampled steps each; pooled f>=1.5 {pooled}; f=1.25 {below}",
          file=sys.stderr)
    figure("slow_nodes_precision_f_ge_1.5", p, "")
    figure("slow_nodes_recall_f_ge_1.5", r, "")
    for f, (tp, n) in sorted(by_factor.items()):
        figure(f"slow_nodes_recall_f_{f:g}", tp / max(n, 1), "")
    for s, (tp, n) in sorted(by_noise.items()):
        figure(f"slow_nodes_recall_noise_{s:g}", tp / max(n, 1), "")
    figure("slow_nodes_recall_f_1.25_below_floor", below["tp"] / max(below["tp"] + below["fn"], 1), "")
    figure("false_slow_nodes_f_1.25", float(below["fp"]), "nodes")
    figure("false_slow_nodes_on_fleets_without_one", false_on_clean / max(clean_fleets, 1), "nodes/fleet")
    figure("single_slow_rank_named_f_ge_1.5", rank_found / max(rank_cases, 1), "")
    figure("slow_ranks_precision_f_ge_1.5", ranks_pooled["tp"] / max(ranks_pooled["tp"] + ranks_pooled["fp"], 1), "")
    figure("slow_ranks_recall_f_ge_1.5", ranks_pooled["tp"] / max(ranks_pooled["tp"] + ranks_pooled["fn"], 1), "")
    figure("fast_compute_rank_flagged_network_slow", fast_flagged / max(seed, 1), "share of fleets")
    figure("network_health_analysis_1024_ranks", statistics.median(times) * 1e3, "ms")


def synthetic_cross_check(args: argparse.Namespace) -> None:
    """One fleet made by fleetscope.synthetic (RunSpec.slow_nodes) through the same analysis."""
    from fleetscope.server.analysis.network import network_health, summary_network
    from fleetscope.server.codec import dim_code

    from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

    R = args.nodes * 8
    spec = RunSpec(name="xcheck", family="llm-70b", world_size=R, steps=16, seed=7, straggler={5: 1.3},
                   slow_nodes={"node0042": 2.0, "node0100": 1.6})
    blocks = []
    for step, rows in rank_step_rows(spec):
        cr = collective_rows(spec, step, rows)
        blocks.append((step, {"rank": np.array([c[0] for c in cr]), "op": np.array([OP[c[3]] for c in cr]),
                              "group_size": np.array([c[4] for c in cr]), "bytes": np.array([float(c[5]) for c in cr]),
                              "calls": np.array([c[6] for c in cr]), "total_s": np.array([c[7] for c in cr]),
                              "dim": np.array([dim_code(c[10]) for c in cr])}))
    hosts = {r: (spec.host_of(r), spec.host_of(r)) for r in range(R)}
    res = summary_network(network_health(blocks, hosts))
    named = [n["node"] for n in res["slow_nodes"]]
    print(f"synthetic cross-check: slow_nodes {res['slow_nodes']}", file=sys.stderr)
    figure("synthetic_fleet_slow_nodes_exact", float(sorted(named) == ["node0042", "node0100"]), "bool")


# ------------------------------------------------------------------------------------------------ cost


def big_batches(rid: int, ranks: int, steps: int, chunk: int, slow_node: int, straggler: int) -> Any:
    """Binary msgpack batches of the bench/analysis.py run plus four collective records per rank-step."""
    from fleetscope.wire import RANK_STEP_FIELDS

    rng = np.random.default_rng(0)
    ts = 1.7e9
    net = np.ones(ranks)
    net[slow_node * 8:(slow_node + 1) * 8] = 2.0
    ints = {f.name for f in RANK_STEP_FIELDS if f.type == "int"}
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
        exposed = (own + wait) * net
        total = (0.3 * jitter + wait) * net
        step_s = work + exposed
        start = ts + np.cumsum(np.r_[0, (work.max(axis=1) + own[:, 0])[:-1]])
        ts = float(start[-1] + work.max(axis=1)[-1] + own[-1, 0])
        n = k * ranks
        cols = {
            "rank": np.tile(np.arange(ranks), k), "step": np.repeat(np.arange(lo, lo + k), ranks),
            "step_s": step_s.ravel(), "ts": np.repeat(start, ranks), "data_s": data.ravel(),
            "compute_s": compute.ravel(), "forward_s": compute.ravel() / 3, "backward_s": compute.ravel() * 0.6,
            "optimizer_s": compute.ravel() * (1 - 1 / 3 - 0.6), "comm_exposed_s": exposed.ravel(),
            "comm_total_s": total.ravel(), "other_s": other.ravel(),
            "tokens": rng.integers(7000, 8192, n), "padded_tokens": np.full(n, 8192), "samples": np.full(n, 4),
            "flops": np.full(n, 3.4e15), "mem_allocated_bytes": np.full(n, 60 << 30),
            "mem_reserved_bytes": np.full(n, 72 << 30), "mem_peak_bytes": np.full(n, 66 << 30),
            "alloc_retries": np.zeros(n, dtype=np.int64), "flags": np.zeros(n, dtype=np.int64),
        }  # fmt: skip
        rs = {f.name: np.ascontiguousarray(cols[f.name], dtype="<i8" if f.name in ints else "<f8").tobytes()
              for f in RANK_STEP_FIELDS if f.name in cols}  # optional fields left out: not measured
        m = len(RECORDS)
        rank4 = np.repeat(cols["rank"], m)
        share = np.tile([r[3] for r in RECORDS], n)
        tot4 = np.repeat(total.ravel(), m) * share
        coll = {
            "rank": rank4, "step": np.repeat(cols["step"], m), "seq": np.tile(np.arange(m), n),
            "group_size": np.full(n * m, ranks), "bytes": np.tile([r[1] * r[2] for r in RECORDS], n),
            "calls": np.tile([r[2] for r in RECORDS], n), "total_s": tot4,
            "exposed_s": np.repeat(exposed.ravel(), m) * share, "start_ts": np.repeat(cols["ts"], m),
        }
        cb: dict[str, Any] = {c: np.ascontiguousarray(v, dtype="<f8" if c in ("total_s", "exposed_s", "start_ts")
                                                      else "<i8").tobytes() for c, v in coll.items()}
        cb["op"] = [r[0] for r in RECORDS] * n
        cb["dim"] = ["dp" if r[4] == DIM_DP else "world" for r in RECORDS] * n
        yield {"v": 1, "run_id": rid, "rank_steps": rs, "collectives": cb}


def load_big(base: str, ranks: int, steps: int, slow_node: int, straggler: int) -> int:
    from analysis import wait_compacted

    from fleetscope.client import Client

    c = Client(base, timeout=600)
    rid = c.register_run({"name": "big-net", "model_family": "llm-70b", "world_size": ranks, "device_type": "H100",
                          "peak_flops": 989e12, "config": {"tp": 1}, "meta": {"flops_source": "estimated"}})
    hosts = [{"rank": r, "host": f"node{r // 8:04d}", "node": f"node{r // 8:04d}", "local_rank": r % 8}
             for r in range(ranks)]
    c.ingest({"v": 1, "run_id": rid, "ranks": hosts})
    t0 = time.monotonic()
    for b in big_batches(rid, ranks, steps, max(1, 30_000 // ranks), slow_node, straggler):
        c.ingest(b)
    c.finish_run(rid)
    sent = time.monotonic() - t0
    comp = wait_compacted(base, rid, ranks * steps, steps, timeout=7200)
    print(f"big run: {ranks * steps:,} rank-steps + {4 * ranks * steps:,} collectives sent in {sent:.0f}s, "
          f"compacted {comp:.0f}s later", file=sys.stderr)
    figure("big_run_ingest_and_compaction", sent + comp, "s")
    return rid


def cost(base: str, url: str, rid: int, slow_node: int) -> None:
    from fleetscope.server import reports
    from fleetscope.server.analysis.network import network_health
    from fleetscope.server.db import make_engine
    from fleetscope.server.reports import network as net_report
    from fleetscope.server.reports import runs as runs_report
    from fleetscope.server.store import nodes as node_store
    from fleetscope.server.store import ranks as rank_store
    from fleetscope.server.store import runs as run_store

    s = httpx.get(f"{base}/api/v1/runs/{rid}/summary", timeout=120).json()
    named = [n["node"] for n in s["network"]["slow_nodes"]]
    print(f"big run network: slow_nodes {s['network']['slow_nodes']}, source {s['network']['source']}", file=sys.stderr)
    figure("big_run_slow_node_named_alone", float(named == [f"node{slow_node:04d}"]), "bool")
    with httpx.Client(base_url=base, timeout=60) as h:
        h.get(f"/api/v1/runs/{rid}/summary").raise_for_status()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            h.get(f"/api/v1/runs/{rid}/summary").raise_for_status()
            ts.append(time.perf_counter() - t0)
    figure("summary_warm_http_with_network", statistics.median(ts) * 1e3, "ms")

    eng = make_engine(url, pool_size=2)
    real = runs_report.run_network
    res: dict[str, list[float]] = {k: [] for k in ("cold_with", "cold_without", "warm_with", "warm_without")}
    try:
        for _ in range(7):  # interleaved rounds: with and without the field alike
            for variant in ("with", "without"):
                runs_report.run_network = real if variant == "with" else (lambda e, r, s: {})  # type: ignore[assignment]
                reports.clear_caches()
                t0 = time.perf_counter()
                reports.run_summary(eng, rid)
                res[f"cold_{variant}"].append(time.perf_counter() - t0)
                for _ in range(3):
                    t0 = time.perf_counter()
                    reports.run_summary(eng, rid)
                    res[f"warm_{variant}"].append(time.perf_counter() - t0)
        runs_report.run_network = real
        for k, v in res.items():
            figure(f"summary_{k}_network_inprocess", statistics.median(v) * 1e3, "ms")
        # the parts of a cold network computation
        run = run_store.get_run(eng, rid, pending=False)
        assert run is not None
        stride, n = net_report.sample_plan(run)
        q, a = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            blocks = node_store.sampled_comm_blocks(eng, rid, stride=stride, limit=n)
            hosts = rank_store.hosts(eng, rid)
            q.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            network_health(blocks, hosts)
            a.append(time.perf_counter() - t0)
        records = sum(len(b["rank"]) for _, b in blocks)
        print(f"sample: every {stride}th step, {len(blocks)} steps, {records:,} records", file=sys.stderr)
        figure("network_sample_steps", float(len(blocks)), "steps")
        figure("network_sample_records", float(records), "records")
        figure("network_cold_query_and_decode", statistics.median(q) * 1e3, "ms")
        figure("network_cold_analysis", statistics.median(a) * 1e3, "ms")
    finally:
        runs_report.run_network = real
        eng.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=128, help="nodes of 8 ranks per simulated fleet")
    ap.add_argument("--fleets-per-case", type=int, default=2, help="fleets per (factor, noise, k) case")
    ap.add_argument("--big-ranks", type=int, default=1024)
    ap.add_argument("--big-steps", type=int, default=5000)
    ap.add_argument("--skip-big", action="store_true", help="only the finder's quality")
    ap.add_argument("--skip-quality", action="store_true", help="only the cost on the large run")
    ap.add_argument("--database-url", default=None, help="an empty Postgres database (default: embedded)")
    args = ap.parse_args()

    if not args.skip_quality:
        quality(args)
        synthetic_cross_check(args)
    if not args.skip_big:
        from analysis import start_server
        from fleetscope.server.db import upgrade

        pg = None
        url = args.database_url
        if url is None:
            from fleetscope.server.db import EmbeddedPostgres

            pg_dir = tempfile.mkdtemp(prefix="fsn-", dir="/tmp")
            atexit.register(shutil.rmtree, pg_dir, True)
            pg = EmbeddedPostgres(pg_dir)
            pg.start()
            url = pg._server.get_uri("postgres")
        upgrade(url)
        proc, base = start_server(url)
        slow_node, straggler = 42, 317
        try:
            rid = load_big(base, args.big_ranks, args.big_steps, slow_node, straggler)
            cost(base, url, rid, slow_node)
        finally:
            proc.terminate()
            proc.wait(30)
            if pg is not None:
                pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}".rstrip())


if __name__ == "__main__":
    main()
