"""Issue #12 items 3–5 benchmark: the FLOP meter's model/hardware split, the kernel-hotspot fold, token balance.

    python bench/kernels_hfu.py [--ranks 256] [--windows 8] [--reps 15]

1. FLOP meter (same-run ratios): one training step of an activation-checkpointed MLP timed bare, under
   torch's plain ``FlopCounterMode`` and under the agent's split counter (``agent/mfu.py``), interleaved,
   medians; the split's cost is ``split / plain`` (the measured step is one step per run).
2. Kernel hotspots: ``--ranks`` × ``--windows`` ``trace_summary`` events (reduced from the real Kineto
   traces in tests/data/kineto, varied per rank) ingested in-process into embedded Postgres; the first
   ``GET /kernels`` report folds them all (windows folded per second), a second one folds nothing (the
   steady read), one more window per rank is the incremental fold; rows and bytes stored per rank.
3. Token balance: the summary's ``token_balance`` over a simulated run (``--ranks`` × 120 steps with a
   token skew), computed cold.

Prints ``name: value unit`` lines last, with the 1-minute load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))


def bench_flop_meter(reps: int) -> None:
    import torch
    from fleetscope.agent.mfu import FlopMeter
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(1)

    class Block(torch.nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    blocks = torch.nn.ModuleList(Block(256) for _ in range(6))
    x = torch.randn(8, 128, 256)

    def step() -> None:
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        h.square().mean().backward()

    def bare() -> None:
        step()

    def plain() -> None:
        with FlopCounterMode(display=False):
            step()

    def split() -> None:
        m = FlopMeter()
        m.start()
        step()
        m.stop()

    times: dict[str, list[float]] = {"bare": [], "plain": [], "split": []}
    for fn in (bare, plain, split):
        fn()  # warm
    for _ in range(reps):
        for name, fn in (("bare", bare), ("plain", plain), ("split", split)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    figure("flop_step_bare_ms", med["bare"] * 1e3, "ms")
    figure("flop_step_plain_counter_ratio", med["plain"] / med["bare"], "x bare")
    figure("flop_step_split_counter_ratio", med["split"] / med["bare"], "x bare")
    figure("flop_split_vs_plain_counter", med["split"] / med["plain"], "x")


def _summaries() -> list[dict[str, Any]]:
    from fleetscope.agent.tracing import json_safe

    from fleetscope.traces import reduce_trace

    d = ROOT / "tests" / "data" / "kineto"
    files = [d / "hta_sampled_2rank" / "sampled_rank-0.json.gz", d / "hta_sampled_2rank" / "sampled_rank-1.json.gz",
             d / "hta_nccl_2rank_r0_a100" / "nccl_data.json.gz"]
    return [json_safe(reduce_trace(f, include_last_step=True)) for f in files]


def _events(summaries: list[dict[str, Any]], ranks: int, windows: range, seq0: int) -> list[dict[str, Any]]:
    out = []
    for r in range(ranks):
        for w in windows:
            s = copy.deepcopy(summaries[(r + w) % len(summaries)])
            for k in s["top_kernels"]:
                k["sum_us"] *= 1.0 + 0.01 * ((r * 7 + w * 3) % 11)
            out.append({"rank": r, "seq": seq0 + w, "kind": "trace_summary", "ts": 1.7e9 + w, "step": 100 * (w + 1),
                        "data": {"first_step": 100 * (w + 1), "active_steps": 2, "summary": s}})
    return out


def bench_kernels(engine: Any, ranks: int, windows: int) -> None:
    from fleetscope.server import reports
    from fleetscope.server.ingest import IngestService
    from fleetscope.server.runs import RunRegistration, register_run
    from sqlalchemy import text

    run = register_run(engine, RunRegistration(name="kernels-bench", world_size=ranks))
    ing = IngestService(engine)
    summaries = _summaries()
    evs = _events(summaries, ranks, range(windows), 10)
    for i in range(0, len(evs), 200):
        ing.ingest({"run_id": run["id"], "events": evs[i:i + 200]})
    t0 = time.perf_counter()
    rep = reports.run_kernels(engine, run["id"])
    t_first = time.perf_counter() - t0
    assert rep["folded_now"] == ranks * windows, rep["folded_now"]
    steady = []
    for _ in range(5):
        t0 = time.perf_counter()
        reports.run_kernels(engine, run["id"])
        steady.append(time.perf_counter() - t0)
    more = _events(summaries, ranks, range(windows, windows + 1), 10)
    for i in range(0, len(more), 200):
        ing.ingest({"run_id": run["id"], "events": more[i:i + 200]})
    t0 = time.perf_counter()
    rep = reports.run_kernels(engine, run["id"])
    t_inc = time.perf_counter() - t0
    with engine.connect() as c:
        rows = c.execute(text("SELECT count(*) FROM run_kernels WHERE run_id = :r"), {"r": run["id"]}).scalar()
        size = sum(int(c.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar() or 0)
                   for t in ("run_kernels", "run_kernel_ranks", "run_kernel_windows"))
        ev_size = int(c.execute(text("SELECT pg_total_relation_size('run_events')")).scalar() or 0)
    figure("kernel_windows", ranks * (windows + 1), "windows")
    figure("kernel_fold_first_read_s", t_first, "s")
    figure("kernel_fold_windows_per_s", ranks * windows / t_first, "windows/s")
    figure("kernel_report_steady_ms", statistics.median(steady) * 1e3, "ms")
    figure("kernel_fold_one_window_per_rank_ms", t_inc * 1e3, "ms")
    figure("kernel_rows_per_rank", float(rows) / ranks, "rows")
    figure("kernel_names_kept", float(rep["names"]), "names")
    figure("kernel_tables_bytes_per_rank", size / ranks, "B")
    figure("kernel_tables_vs_events_bytes", size / max(ev_size, 1), "x")


def bench_tokens(engine: Any, base: str, ranks: int) -> None:
    from fleetscope.server import reports
    from fleetscope.server.reports import _cache
    from fleetscope.server.reports.tokens import run_token_balance
    from fleetscope.server.store import runs as run_store

    from fleetscope.simulate import run_simulation

    run_simulation(server=base, token=None, run="tokens-bench", family="vla-7b", ranks=ranks, steps=120, seed=1,
                   token_skew={ranks // 3: 1.4}, skew_modality="vision")
    deadline = time.monotonic() + 600
    rid = None
    while time.monotonic() < deadline:
        runs = reports.list_runs(engine, name="tokens-bench")
        if runs and runs[0]["steps"] >= 120:
            rid = runs[0]["id"]
            break
        time.sleep(0.5)
    assert rid is not None, "simulated run was not compacted"
    run = run_store.get_run(engine, rid)
    assert run is not None
    times = []
    for _ in range(5):
        _cache.clear()
        t0 = time.perf_counter()
        tb = run_token_balance(engine, run)
        times.append(time.perf_counter() - t0)
    assert tb is not None and tb["heaviest_rank"]["rank"] == ranks // 3, tb
    figure("token_balance_cold_ms", statistics.median(times) * 1e3, "ms")
    figure("token_balance_rank_steps", float(ranks * tb["steps"]), "rank-steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    bench_flop_meter(args.reps)

    from fleetscope.server.db import EmbeddedPostgres, make_engine, upgrade

    pg_dir = tempfile.mkdtemp(prefix="fsk-", dir="/tmp")
    atexit.register(shutil.rmtree, pg_dir, True)
    pg = EmbeddedPostgres(pg_dir)
    pg.start()
    url = pg._server.get_uri("postgres")
    upgrade(url)
    engine = make_engine(url, pool_size=4)
    sys.path.insert(0, str(ROOT / "bench"))
    from analysis import start_server  # the same `fleetscope serve` subprocess as bench/analysis.py

    proc, base = start_server(url)
    try:
        bench_kernels(engine, args.ranks, args.windows)
        bench_tokens(engine, base, min(args.ranks, 128))
    finally:
        proc.terminate()
        proc.wait(30)
        engine.dispose()
        pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
