"""Dashboard benchmark (docs/benchmarks.md "Targets", "Queries and pages"): 500 runs of history plus one run of
1,024 ranks × 5,000 steps, loaded through the real ingest; then query latencies, chart payloads and
the run page in headless chromium, each side by side with the naive path it replaces.

    python bench/dashboard.py [--runs 500] [--ranks 1024] [--steps 5000] [--screenshots docs/img]
    python bench/dashboard.py --quick          # 60 runs + 128 × 400, a minute or two
    python bench/dashboard.py --pg-dir /tmp/fs-bench-pg --run-page-only   # again on kept data: the run page only

The run page is timed in chromium as a direct URL load until every chart is drawn (the training-scalars
chart included: the large run logs loss, lr and grad_norm every step): first the view after a server
start (the in-process caches emptied), then ``--reps`` more (their median), with the number of Dash
callback requests and the bytes they returned.

Loading: the server runs in this process (uvicorn on a thread, embedded Postgres) and batches go to
its ``IngestService.ingest`` directly — the same validation, landing and compaction as
``POST /api/v1/ingest``, without msgpack/HTTP (bench/ingest.py measures that path). Rows come from a
vectorised version of the synthetic model (fleetscope/synthetic.py). History runs carry rank-steps
only; the large run and a 128-rank showcase run (straggler node, per-modality tokens, events, a
declared topology) carry 4 collective records per rank-step; the large run also logs 3 training
scalars per step on rank 0 (``scalars`` events, as ``run.log`` sends them). Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {  # name -> (params, tokens per rank-step, base MFU, modalities)
    "llm-70b": (70e9, 8192, 0.42, ("text",)),
    "vla-7b": (7e9, 16384, 0.48, ("vision", "text", "action")),
    "vit-h": (0.63e9, 65536, 0.38, ("vision",)),
    "video-dit-3b": (3e9, 32768, 0.44, ("video", "text")),
}
PEAK = 989e12  # H100 SXM dense bf16 (docs/metrics.md)
SCALING_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)  # the scaling target: a family with 8 cluster sizes
OPS = ("all_reduce", "all_reduce", "all_gather", "barrier")


def _model(family: str, n: int, comm_bound: bool = False) -> dict[str, float]:
    params, tokens, mfu, _ = FAMILIES[family]
    compute = 6 * params * tokens / (PEAK * mfu)
    busbw = 350e9 if n <= 8 else 45e9
    comm = 2 * (n - 1) / n * params * 2 / busbw / 8 * (1 + 0.12 * math.log2(max(n / 8, 1)))
    overlap = 0.15 if comm_bound else max(0.35, 0.92 - 0.06 * math.log2(max(n / 8, 1)))
    return {"compute": compute, "comm": comm, "overlap": overlap, "data": 0.02 * compute, "other": 0.03 * compute,
            "tokens": tokens, "flops": 6 * params * tokens}


def _block(m: dict[str, float], lo: int, hi: int, n: int, rng: np.random.Generator, slow: np.ndarray, t0: float,
           collectives: bool) -> tuple[dict[str, Any], dict[str, Any] | None, float]:
    """Steps [lo, hi) of a synchronous job as packed columns (little-endian float64/int64 bytes)."""
    s = hi - lo
    jit = rng.lognormal(0, 0.03, (s, 1))
    compute = m["compute"] * jit * rng.lognormal(0, 0.01, (s, n)) * slow[None, :]
    data = m["data"] * rng.lognormal(0, 0.3, (s, n))
    other = m["other"] * rng.lognormal(0, 0.1, (s, n))
    work = data + compute + other
    slowest = work.max(axis=1, keepdims=True)
    comm_total = m["comm"] * jit
    own = comm_total * (1 - m["overlap"])
    wait = slowest - work
    exposed = own + wait
    step_dur = (slowest + own)[:, 0]
    ts = t0 + np.concatenate([[0.0], np.cumsum(step_dur)[:-1]])
    tokens = np.floor(m["tokens"] * (0.86 + 0.1 * rng.random((s, n))))
    f8 = lambda a: np.ascontiguousarray(a, dtype="<f8").tobytes()  # noqa: E731
    i8 = lambda a: np.ascontiguousarray(a, dtype="<i8").tobytes()  # noqa: E731
    rank = np.broadcast_to(np.arange(n), (s, n))
    step = np.broadcast_to(np.arange(lo, hi)[:, None], (s, n))
    cols = {
        "rank": i8(rank), "step": i8(step), "step_s": f8(work + exposed), "ts": f8(np.broadcast_to(ts[:, None], (s, n))),
        "data_s": f8(data), "compute_s": f8(compute), "forward_s": f8(compute / 3), "backward_s": f8(compute * 0.6),
        "optimizer_s": f8(compute * (1 - 1 / 3 - 0.6)), "comm_exposed_s": f8(exposed), "comm_total_s": f8(comm_total + wait),
        "other_s": f8(other), "tokens": i8(tokens), "padded_tokens": i8(np.full((s, n), m["tokens"])),
        "samples": i8(np.full((s, n), 8)), "flops": f8(m["flops"] * tokens / m["tokens"]),
        "mem_allocated_bytes": i8(np.full((s, n), 60 << 30)), "mem_reserved_bytes": i8(np.full((s, n), 72 << 30)),
        "mem_peak_bytes": i8((66 << 30) + (rng.random((s, n)) * (2 << 30)).astype(np.int64) // 512 * 512),
        "alloc_retries": i8(np.zeros((s, n))), "flags": i8(np.zeros((s, n))),
    }  # fmt: skip
    coll = None
    if collectives:
        k = len(OPS)
        grad = m["flops"] / 6 / 16384 * 2 / 8  # gradient bytes per bucket
        share = np.array([0.7, 0.2, 0.08, 0.02])
        nbytes = np.array([grad * 6, grad * 2 / 4, 4 << 20, 0])
        calls = np.array([6, 2, 1, 1])
        tot = (comm_total + wait)[:, :, None] * share
        exp = exposed[:, :, None] * share
        coll = {
            "rank": i8(np.broadcast_to(rank[:, :, None], (s, n, k))), "step": i8(np.broadcast_to(step[:, :, None], (s, n, k))),
            "seq": i8(np.broadcast_to(np.arange(k), (s, n, k))), "op": list(OPS) * (s * n),
            "group_size": i8(np.full((s, n, k), n)), "bytes": i8(np.broadcast_to(nbytes.astype(np.int64), (s, n, k))),
            "calls": i8(np.broadcast_to(calls, (s, n, k))), "total_s": f8(tot), "exposed_s": f8(exp),
            "start_ts": f8(np.broadcast_to(ts[:, None, None], (s, n, k))),
        }  # fmt: skip
    return cols, coll, float(ts[-1] + step_dur[-1])


SCALARS = ("loss", "lr", "grad_norm")  # what the large run logs with run.log on rank 0, every step


def _scalar_events(lo: int, hi: int, t_lo: float, t_hi: float) -> list[dict[str, Any]]:
    """``scalars`` events (run.log) of steps [lo, hi): a decaying loss with noise and a spike every 997
    steps, a warm-up-then-cosine learning rate, a gradient norm."""
    out = []
    for st in range(lo, hi):
        noise = 0.05 * math.sin(st * 12.9898) + (0.8 if st % 997 == 500 else 0.0)
        out.append({"rank": 0, "seq": 10_000_000 + st, "kind": "scalars", "step": st,
                    "ts": t_lo + (t_hi - t_lo) * (st - lo) / max(hi - lo, 1),
                    "data": {"loss": 2.0 + 8.0 / math.sqrt(1 + st / 50) + noise,
                             "lr": 3e-4 * min(1.0, (st + 1) / 200) * (0.5 + 0.5 * math.cos(math.pi * st / 10_000)),
                             "grad_norm": 1.0 + 0.3 * math.cos(st * 78.233) + (5.0 if st % 997 == 500 else 0.0)}})
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="fs-benchdash-", dir="/tmp"))
        atexit.register(shutil.rmtree, self.dir, True)  # the temp dir goes with the run
        self.figures: list[tuple[str, float, str]] = []

    # ---------------------------------------------------------------- server
    def start(self) -> None:
        import psycopg
        import uvicorn
        from fleetscope.server.auth import create_token
        from fleetscope.server.db import EmbeddedPostgres
        from fleetscope.server.settings import Settings

        from fleetscope.webapp import create_web_app

        pg_dir = Path(self.args.pg_dir) if self.args.pg_dir else self.dir / "pg"
        self.pg = EmbeddedPostgres(str(pg_dir))
        self.pg.start()
        admin = self.pg._server.get_uri("postgres")
        name = "bench_dashboard" if self.args.pg_dir else "bench_" + uuid.uuid4().hex[:8]
        with psycopg.connect(admin, autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                c.execute(f"CREATE DATABASE {name}")
        head, _, query = admin.partition("?")
        url = f"{head.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")
        settings = Settings(database_url=url, compact_interval_s=0.5, compact_grace_s=2.0, backlog_max_rows=3_000_000,
                            max_batch_records=2_000_000, port=0)
        self.app = create_web_app(settings)
        import socket

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        self.state = self.app.state.fs
        self.engine = self.state.engine
        self.token = create_token(self.engine, "bench", scope="admin", replace=True)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.pg.stop()

    # ---------------------------------------------------------------- load
    def _ingest(self, doc: dict[str, Any]) -> None:
        from fleetscope.server.ingest import Overloaded

        while True:
            try:
                self.state.ingest.ingest(doc)
                return
            except Overloaded:
                time.sleep(0.5)

    def _register(self, info: dict[str, Any]) -> int:
        from fleetscope.server.runs import RunRegistration, register_run

        return int(register_run(self.engine, RunRegistration(**info))["id"])

    def load_run(self, name: str, family: str, n: int, steps: int, *, t0: float, seed: int, slow: dict[int, float] | None = None,
                 slow_factor: float = 1.0, collectives: bool = False, modalities: bool = False, events: bool = False,
                 commit: str | None = None, meta: dict[str, Any] | None = None, comm_bound: bool = False,
                 scalars: bool = False) -> int:
        m = _model(family, n, comm_bound)
        m["compute"] *= slow_factor
        fam = FAMILIES[family]
        rid = self._register({
            "name": name, "model_family": family, "world_size": n, "device_type": "H100", "device_count": n,
            "peak_flops": PEAK, "git_commit": commit, "started_at": t0,
            "config": {"global_batch_tokens": fam[1] * n, "bucket_mb": 5 if comm_bound else 25, "overlap": not comm_bound,
                       "precision": "bf16"},
            "meta": {"flops_source": "estimated", "synthetic": True, **(meta or {})},
        })
        rng = np.random.default_rng(seed)
        slowv = np.ones(n)
        for r, f in (slow or {}).items():
            slowv[r] = f
        per_batch = max(1, (40_000 if collectives else 200_000) // n)
        t = t0 + 60.0
        first = True
        for lo in range(0, steps, per_batch):
            hi = min(steps, lo + per_batch)
            t_lo = t
            cols, coll, t = _block(m, lo, hi, n, rng, slowv, t, collectives)
            doc: dict[str, Any] = {"v": 1, "run_id": rid, "rank_steps": cols}
            if coll is not None:
                doc["collectives"] = coll
            if first:
                doc["ranks"] = [{"rank": r, "host": f"node{r // 8:04d}", "node": f"node{r // 8:04d}", "local_rank": r % 8,
                                 "device": "H100"} for r in range(n)]
                first = False
            if modalities:
                k = len(fam[3])
                s = hi - lo
                doc["modality_tokens"] = {
                    "rank": np.broadcast_to(np.arange(n)[None, :, None], (s, n, k)).ravel().tolist(),
                    "step": np.broadcast_to(np.arange(lo, hi)[:, None, None], (s, n, k)).ravel().tolist(),
                    "modality": list(fam[3]) * (s * n),
                    "tokens": (np.array([0.55, 0.4, 0.05][:k]) * fam[1] * 0.9).astype(int).tolist() * (s * n),
                }
            if events:
                doc["events"] = [{"rank": 0, "seq": st, "kind": "checkpoint", "step": st,
                                  "ts": t_lo + (t - t_lo) * (st - lo) / max(hi - lo, 1),
                                  "data": {"duration_s": 12.0}} for st in range(lo, hi) if st % 100 == 99]
            if scalars:
                doc.setdefault("events", []).extend(_scalar_events(lo, hi, t_lo, t))
            self._ingest(doc)
        from fleetscope.server.runs import finish_run

        finish_run(self.engine, rid)
        return rid

    def compact_all(self) -> None:
        while True:
            res = self.state.compactor.run_once(force=True)
            if not res.more and res.steps == 0:
                return

    def reuse(self) -> bool:
        """With --pg-dir: use the data a previous run loaded there (measure again without reloading)."""
        from sqlalchemy import text

        if not self.args.pg_dir:
            return False
        with self.engine.connect() as c:
            rows = dict(c.execute(text("SELECT name, id FROM runs")).fetchall())
        large = f"llm-70b-{self.args.ranks}-large"
        if large not in rows:
            return False
        self.ids = {"large": rows[large], "showcase": rows["vla-7b-128-straggler-node"]}
        self.fig("load_reused_runs", len(rows), "runs (loaded by an earlier run into --pg-dir)")
        with self.engine.connect() as c:  # a --pg-dir loaded before the large run logged scalars: add them
            has = c.execute(text("SELECT 1 FROM run_scalar_names WHERE run_id = :r LIMIT 1"), {"r": self.ids["large"]}).first()
        if not has:
            for lo in range(0, self.args.steps, 500):
                self._ingest({"v": 1, "run_id": self.ids["large"],
                              "events": _scalar_events(lo, min(lo + 500, self.args.steps), 0.0, 0.0)})
            self.compact_all()
        return True

    def load(self) -> None:
        a = self.args
        now = time.time()  # runs are finished now (finish_run), so their steps must lie in the past
        t0 = now - 30 * 86400
        t = time.perf_counter()
        self.ids: dict[str, int] = {}
        i = 0
        specs: list[dict[str, Any]] = []
        # a scaling family at 8 cluster sizes, 3 runs each
        for rep in range(3):
            for n in SCALING_SIZES:
                specs.append({"name": f"llm-70b-scale-{n}-r{rep}", "family": "llm-70b", "n": n})
        # nightly runs of vla-7b at 64 GPUs with a regression from commit c0de0018 on
        for d in range(30):
            specs.append({"name": f"vla-7b-nightly-{d:02d}", "family": "vla-7b", "n": 64, "commit": f"c0de{d:04d}",
                          "slow_factor": 1.18 if d >= 18 else 1.0})
        fams = ["vit-h", "video-dit-3b", "vla-7b", "llm-70b"]
        while len(specs) < a.runs - 2:
            f = fams[len(specs) % 4]
            n = (8, 16, 32, 64)[len(specs) // 4 % 4]
            specs.append({"name": f"{f}-exp-{len(specs):04d}", "family": f, "n": n, "comm_bound": len(specs) % 17 == 0})
        for sp in specs:
            i += 1
            self.load_run(sp["name"], sp["family"], sp["n"], a.history_steps, t0=t0 + i * 3600 * 24 * 28 / len(specs),
                          seed=i, commit=sp.get("commit"), slow_factor=sp.get("slow_factor", 1.0),
                          comm_bound=sp.get("comm_bound", False))
        topo = {"gpus_per_node": 8, "intra_node_bytes_per_s": 450e9, "inter_node_bytes_per_s": 80e9}
        self.ids["showcase"] = self.load_run(
            "vla-7b-128-straggler-node", "vla-7b", 128, a.showcase_steps, t0=now - a.showcase_steps * 2.2 - 600, seed=7,
            slow={r: 1.25 for r in range(40, 48)}, collectives=True, modalities=True, events=True, commit="c0de0031",
            meta={"topology": topo})
        history_s = time.perf_counter() - t
        t = time.perf_counter()
        step_s = _model("llm-70b", a.ranks)["compute"] * 1.2
        self.ids["large"] = self.load_run(f"llm-70b-{a.ranks}-large", "llm-70b", a.ranks, a.steps, t0=now - a.steps * step_s - 600,
                                          seed=11, slow={a.ranks * 517 // 1024: 1.3}, collectives=True, meta={"topology": topo},
                                          scalars=True)
        large_load_s = time.perf_counter() - t
        t = time.perf_counter()
        self.compact_all()
        compact_s = time.perf_counter() - t
        rs = a.ranks * a.steps
        self.fig("load_history_runs", len(specs) + 1, "runs")
        self.fig("load_history_s", history_s, "s")
        self.fig("load_large_rank_steps_per_s", rs / (large_load_s + compact_s), "rank-steps/s (ingest + compaction, 4 collectives each)")
        self.post_benchmarks(now)

    def post_benchmarks(self, now: float) -> None:
        pts = []
        for cluster, base in (("h100-pod-a", 1.0), ("h100-pod-b", 0.93)):
            for d in range(21):
                ts = now - (21 - d) * 86400
                drop = 0.85 if (cluster == "h100-pod-b" and d >= 15) else 1.0
                pts.append({"name": "matmul_tflops", "params": {"n": 8192, "dtype": "bf16"}, "unit": "TFLOP/s",
                            "value": 720.0 * base * (1 + 0.01 * math.sin(d)), "ts": ts, "git_commit": f"c0de{d:04d}"})
                for b in (1 << 20, 1 << 23, 1 << 26, 1 << 29):
                    peak = 180.0 * base * (1 - math.exp(-b / (1 << 24)))
                    pts.append({"name": "all_reduce_busbw", "params": {"bytes": b, "world": 8}, "unit": "GB/s",
                                "value": peak * drop * (1 + 0.01 * math.cos(d)), "ts": ts, "git_commit": f"c0de{d:04d}"})
            r = httpx.post(f"{self.url}/api/v1/benchmarks", json={"cluster": cluster, "points": pts},
                           headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
            r.raise_for_status()
            pts = []

    # ---------------------------------------------------------------- measure
    def fig(self, name: str, value: float, unit: str) -> None:
        self.figures.append((name, value, unit))

    @staticmethod
    def _time(fn: Any, reps: int = 5) -> tuple[float, float]:
        """(first call, median of the next ``reps``) in ms."""
        t = time.perf_counter()
        fn()
        first = (time.perf_counter() - t) * 1e3
        xs = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t) * 1e3)
        return first, statistics.median(xs)

    def queries(self) -> None:
        from fleetscope.server import rank_matrix, reports
        from fleetscope.server.store.steps import rank_step_matrix

        eng = self.engine
        big = self.ids["large"]
        with httpx.Client(base_url=self.url, timeout=120) as c:
            first, warm = self._time(lambda: c.get(f"/api/v1/runs/{big}/summary").raise_for_status())
        self.fig("summary_large_run_cold_ms", first, "ms")
        self.fig("summary_large_run_warm_ms", warm, "ms (target ≤ 300)")

        reports.clear_caches()
        first, warm = self._time(lambda: reports.fleet_rows(eng))
        n_runs = len(reports.fleet_rows(eng))
        self.fig("fleet_page_data_cold_ms", first, f"ms ({n_runs} runs, one batched query; target ≤ 200)")
        self.fig("fleet_page_data_warm_ms", warm, "ms (per-run cache of unchanged runs)")
        runs = reports.run_options(eng, limit=10_000)
        reports.clear_caches()
        t = time.perf_counter()
        for r in runs:
            reports.run_summary(eng, r["id"])
        naive = (time.perf_counter() - t) * 1e3
        self.fig("fleet_reference_per_run_summaries_ms", naive, f"ms ({len(runs)} × run_summary)")
        self.fig("fleet_batched_speedup", naive / first, "× vs per-run summaries (cold)")

        first, warm = self._time(lambda: reports.scaling_view(eng, "llm-70b"))
        self.fig("scaling_page_data_ms", first, f"ms (family with {len(SCALING_SIZES)} cluster sizes; target ≤ 500)")
        self.fig("scaling_page_data_warm_ms", warm, "ms")

        # run page data of the large run: the heatmap matrix cold (decode every step block) and cached
        rank_matrix.clear_cache()
        t = time.perf_counter()
        hm = reports.rank_heatmap(eng, big)
        self.fig("heatmap_cold_ms", (time.perf_counter() - t) * 1e3, f"ms (decode {hm['n_steps']:,} blocks of {hm['n_ranks']:,} ranks)")
        _, warm = self._time(lambda: reports.rank_heatmap(eng, big))
        self.fig("heatmap_warm_ms", warm, f"ms (cached; reduced to {hm['values'].shape[0]}×{hm['values'].shape[1]}, "
                                           f"{hm['step_factor']} steps × {hm['rank_factor']} ranks per cell)")
        t = time.perf_counter()
        rank_step_matrix(eng, big, "step_s")
        self.fig("heatmap_reference_rank_step_matrix_ms", (time.perf_counter() - t) * 1e3,
                 "ms (store.steps.rank_step_matrix, full decode)")

        def run_page_data() -> None:  # what the run page's callbacks call (the façade caches per run)
            s = reports.run_page_summary(eng, big)
            reports.run_series(eng, big)
            reports.bottleneck_report(eng, big, s)
            reports.modality_series(eng, big)
            reports.rank_heatmap(eng, big, field="work_s")
            reports.rank_slowdown(eng, big)
            reports.straggler_view(eng, big)
            reports.collectives_view(eng, big)
            reports.goodput(eng, big)
            reports.run_events(eng, big)
            reports.run_traces(eng, big)

        reports.clear_caches()
        first, warm = self._time(run_page_data, reps=3)
        self.fig("run_page_data_large_first_ms", first, "ms (every section's query; heatmap matrix already cached)")
        self.fig("run_page_data_large_ms", warm, "ms (again: finished run, page caches valid)")
        self.payloads(big)

    def payloads(self, rid: int) -> None:
        from fleetscope.dashboard import figures as F
        from fleetscope.dashboard import scalars_panel as S
        from fleetscope.server import reports
        from fleetscope.server.reports import research
        from plotly.io.json import to_json_plotly

        eng = self.engine
        ser = reports.run_series(eng, rid)
        figs = {
            "decomposition": F.decomposition_figure(ser), "throughput": F.throughput_figure(ser), "memory": F.memory_figure(ser),
            "heatmap": F.heatmap_figure(reports.rank_heatmap(eng, rid)), "stragglers": F.slowdown_figure(reports.rank_slowdown(eng, rid)),
            "collectives": F.collectives_figure(reports.collectives_view(eng, rid)["rows"]),
            "modality": F.modality_figure(reports.modality_series(eng, rid), ser.get("packing")),
            "scalars": S.scalars_figure(research.run_scalars(eng, rid, ["loss"], S.MAX_POINTS)["scalars"],
                                        [int(x) for x in ser["step_s"].x], [float(y) for y in ser["step_s"].y],
                                        S._marks(eng, rid)),
        }
        sizes = {k: len(to_json_plotly(f)) for k, f in figs.items()}  # the bytes a callback sends
        for k, v in sizes.items():
            self.fig(f"payload_{k}_kb", v / 1e3, "kB")
        self.fig("payload_max_kb", max(sizes.values()) / 1e3, "kB per chart (target ≤ 2,000)")

    def browser(self) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "dashboard"))
        from browser_util import start_browser, wait_for, wait_for_charts
        from fleetscope.server import rank_matrix, reports

        charts = ["run-decomposition", "run-heatmap", "run-stragglers", "run-throughput", "run-memory",
                  "run-collectives", "run-modality", "run-scalars"]  # the large run logs scalars: its panel is drawn too
        d = start_browser()
        try:
            big = self.ids["large"]
            d.get(f"{self.url}/")  # load the app's scripts once (a user arriving from the fleet page)
            wait_for(d, "document.querySelectorAll('#fleet-table a').length > 0", timeout=60, what="fleet")
            reports.clear_caches()  # as after a server start: nothing of the run computed in this process yet
            rank_matrix.clear_cache()
            js_cb = ("return Math.max(0, ...performance.getEntriesByType('resource')"
                     ".filter(e => e.name.includes('_dash-update-component')).map(e => e.responseEnd)) / 1000")
            js_n = ("return performance.getEntriesByType('resource')"
                    ".filter(e => e.name.includes('_dash-update-component')).length")
            js_kb = ("return performance.getEntriesByType('resource').filter(e => e.name.includes('_dash-update-component'))"
                     ".reduce((a, e) => a + (e.encodedBodySize || 0), 0) / 1000")
            times, cbs, ncb, kb = [], [], [], []
            for _ in range(1 + self.args.reps):
                t = time.perf_counter()
                d.get(f"{self.url}/runs/{big}")
                wait_for_charts(d, charts, timeout=120)
                times.append(time.perf_counter() - t)
                cbs.append(d.execute_script(js_cb))
                ncb.append(d.execute_script(js_n))
                kb.append(d.execute_script(js_kb))
            load = f"load {os.getloadavg()[0]:.1f}"
            self.fig("run_page_all_charts_cold_s", times[0], f"s (direct URL load, first view after a server start: "
                                                             f"in-process caches empty; {load})")
            self.fig("run_page_all_charts_s", statistics.median(times[1:]),
                     f"s (direct URL load, median of {self.args.reps}: {', '.join(f'{x:.2f}' for x in times[1:])}; "
                     f"target ≤ 2; {load})")
            self.fig("run_page_last_callback_cold_s", cbs[0], "s (first view: until the last callback answered)")
            self.fig("run_page_last_callback_s", statistics.median(cbs[1:]), "s (of which: until the last callback answered)")
            self.fig("run_page_callbacks", ncb[-1], "callback requests on load")
            self.fig("run_page_callback_kb", kb[-1], "kB of callback responses on load (compressed as sent)")
            if self.args.run_page_only:
                return
            nav = []
            for _ in range(3):
                d.get(f"{self.url}/")
                wait_for(d, "document.querySelectorAll('#fleet-table a').length > 0", timeout=60, what="fleet")
                link = d.find_element("css selector", f"#fleet-table a[href='/runs/{big}']")
                t = time.perf_counter()
                link.click()  # in-app navigation (no reload), as a user clicking through from the fleet
                wait_for_charts(d, charts, timeout=120)
                nav.append(time.perf_counter() - t)
            self.fig("run_page_from_fleet_click_s", statistics.median(nav), "s (fleet → run click to all charts drawn, median of 3)")
            t = time.perf_counter()
            d.get(f"{self.url}/")
            wait_for(d, "document.querySelectorAll('#fleet-table a').length > 0", timeout=60, what="fleet")
            self.fig("fleet_page_in_browser_s", time.perf_counter() - t, "s (navigation to table filled)")
            if self.args.screenshots:
                self.screenshots(d)
        finally:
            d.quit()

    def screenshots(self, d: Any) -> None:
        from browser_util import wait_for, wait_for_charts

        out = ROOT / self.args.screenshots
        out.mkdir(parents=True, exist_ok=True)
        with self.engine.connect() as c:
            from sqlalchemy import text

            alert = c.execute(text("SELECT id FROM alerts WHERE kind = 'run_series' ORDER BY id LIMIT 1")).scalar()
            nightly = [r[0] for r in c.execute(text(
                "SELECT id FROM runs WHERE name IN ('vla-7b-nightly-16', 'vla-7b-nightly-20') ORDER BY name"))]
        pages = [
            ("fleet", "/", None, "document.querySelectorAll('#fleet-table a').length > 0"),
            ("run", f"/runs/{self.ids['showcase']}", ["run-decomposition", "run-heatmap", "run-stragglers"], None),
            ("run-large", f"/runs/{self.ids['large']}", ["run-decomposition", "run-heatmap", "run-stragglers"], None),
            ("scaling", "/scaling?family=llm-70b", ["scaling-throughput", "scaling-efficiency"], None),
            ("compare", "/compare?runs=" + ",".join(map(str, nightly)), ["compare-series"], None),
            ("regressions", "/regressions?state=all" + (f"&alert={alert}" if alert else ""), ["regressions-chart"], None),
            ("benchmarks", "/benchmarks", ["benchmarks-size"], None),
        ]
        for name, path, charts, cond in pages:
            d.set_window_size(1440, 900)
            d.get(self.url + path)
            if charts:
                wait_for_charts(d, charts, timeout=120)
            if cond:
                wait_for(d, cond, timeout=60, what=name)
            time.sleep(0.8)
            d.save_screenshot(str(out / f"{name}.png"))
            if name == "run":
                h = d.execute_script("return document.body.scrollHeight")
                d.set_window_size(1440, min(int(h) + 40, 6000))
                time.sleep(1.0)
                d.save_screenshot(str(out / "run-full.png"))
        self.fig("screenshots", len(pages) + 1, f"PNG files in {self.args.screenshots}")

    def wait_alerts(self, timeout: float = 60.0) -> int:
        from sqlalchemy import text

        deadline = time.monotonic() + timeout
        n = 0
        while time.monotonic() < deadline:
            with self.engine.connect() as c:
                n = int(c.execute(text("SELECT count(*) FROM alerts")).scalar() or 0)
            if n:
                break
            time.sleep(1)
        return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--history-steps", type=int, default=20)
    ap.add_argument("--showcase-steps", type=int, default=400)
    ap.add_argument("--screenshots", default=None, help="write 1440×900 PNGs of every page here (e.g. docs/img)")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--quick", action="store_true", help="60 runs and a 128 × 400 large run")
    ap.add_argument("--pg-dir", default=None, help="keep embedded Postgres here; a second run reuses the loaded data")
    ap.add_argument("--run-page-only", action="store_true",
                    help="time only the large run's page in chromium (no query or payload figures)")
    ap.add_argument("--reps", type=int, default=3, help="warm run-page loads after the first view (their median is reported)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.ranks, args.steps = 60, 128, 400
    b = Bench(args)
    b.start()
    try:
        if not b.reuse():
            b.load()
            b.fig("alerts_raised", b.wait_alerts(), "alerts (regression detector on the loaded history)")
        if not args.run_page_only:
            b.queries()
        if not args.no_browser:
            b.browser()
    finally:
        b.stop()
    load = os.getloadavg()
    print(json.dumps({"runs": args.runs, "ranks": args.ranks, "steps": args.steps, "cpus": os.cpu_count(),
                      "loadavg_1m_at_end": round(load[0], 1)}))
    for name, value, unit in b.figures:
        v = f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
        print(f"{name}: {v} {unit}")


if __name__ == "__main__":
    main()
