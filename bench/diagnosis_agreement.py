"""Diagnosis agreement: on a zoo of runs with one injected cause each, how often the diagnosis's first
ranked cause is the injected one, and how much advice it gives per ranked cause (issue 31, "Benchmarks").

    python bench/diagnosis_agreement.py [--world 4,16] [--steps 24] [--seeds 2] [--database-url URL]

The zoo (every case with and without two long warm-up steps — 8.1 s and 3.4 s of compile at steps 0 and 1,
every rank — and for each world size and seed):

* DDP jobs built rank-step by rank-step as the agent records them (data, forward, backward, optimizer,
  other, exposed and total comm; 25 MiB gradient buckets in backward; the agent's ``ddp`` facts sent),
  ±3 % noise per rank-step, one injected cause each:
  ``slow_loader`` (+45 ms data on every rank → data), ``late_rank`` (rank 1 computes 40 % longer; the
  others wait for it in the all-reduce → straggler_wait), ``gradient_bound`` (the last bucket's all-reduce
  left 40 ms after backward → comm_bandwidth), ``small_syncs`` (30 scalar all-reduces per step, 1.2 ms
  each → comm_sync), ``compute_bound`` (3× the compute, nothing else → compute: no ranked cause besides it);
* simulated fleets (``fleetscope.synthetic``, what ``fleetscope simulate`` sends): a straggler at 1.3×
  (→ straggler_wait) and a 15× slower loader (its data ~3 % of the step → ~30 %: → data).

Each run goes through the real ingest and compaction of ``fleetscope serve`` (embedded Postgres unless
``--database-url``), and the figures are read from ``GET /runs/{id}/summary`` — whatever the server
computes (its steady-state basis included, when it sets warm-up steps apart). The first ranked cause is
the largest ranked cause other than compute, else "compute" when compute is the largest part.

Prints per case the verdict, then ``name: value unit`` lines: ``agreement`` and ``agreement_warmup``
(share of cases, target 1.0), ``advice_per_ranked_cause`` (mean, target ≤ 1) and its maximum over runs,
and the 1-minute load average (docs/benchmarks.md, "Diagnosis agreement").
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from analysis import start_server  # noqa: E402

from fleetscope.client import Client  # noqa: E402
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows  # noqa: E402
from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
MB25 = 25 << 20
WARMUP_S = (8.1, 3.4)  # two compile steps, as in the issue
DDP_FACTS = {"bucket_cap_bytes": MB25, "first_bucket_bytes": MB25, "gradient_as_bucket_view": False, "params": 200,
             "grad_bytes": 4 * MB25, "largest_grad_bytes": 4 << 20, "buckets_estimated": 4}
#: case -> the cause the diagnosis must rank first
EXPECTED = {"slow_loader": "data", "late_rank": "straggler_wait", "gradient_bound": "comm_bandwidth",
            "small_syncs": "comm_sync", "compute_bound": "compute", "sim_straggler": "straggler_wait",
            "sim_slow_loader": "data"}

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))


def _row(rank: int, step: int, **v: float) -> tuple:
    compute = v["fwd"] + v["bwd"] + v["opt"]
    vals = {"rank": rank, "step": step, "ts": T0 + step, "data_s": v["data"], "compute_s": compute,
            "forward_s": v["fwd"], "backward_s": v["bwd"], "optimizer_s": v["opt"], "comm_exposed_s": v["exposed"],
            "comm_total_s": v["total"], "other_s": v["other"], "mem_peak_bytes": 2_000_000_000,
            "step_s": v["data"] + compute + v["exposed"] + v["other"]}
    row: list[Any] = [None] * len(NAMES)
    for k, x in vals.items():
        row[NAMES.index(k)] = x
    return tuple(row)


def ddp_case(case: str, world: int, steps: int, seed: int, warmup: bool) -> tuple[list[tuple], list[tuple]]:
    """Rank-step and collective rows of a DDP job with ``case`` injected (module docstring)."""
    rnd = random.Random(f"{case}-{world}-{seed}-{warmup}")
    rows: list[tuple] = []
    colls: list[tuple] = []
    for s in range(steps):
        # the slowest rank's extra work this step: everyone else waits for it in the all-reduce
        works: dict[int, dict[str, float]] = {}
        for r in range(world):
            j = lambda x: x * rnd.uniform(0.97, 1.03)  # noqa: E731
            w = {"data": j(0.003), "fwd": j(0.030), "bwd": j(0.060), "opt": j(0.010), "other": j(0.002)}
            if case == "slow_loader":
                w["data"] += j(0.045)
            if case == "late_rank" and r == 1:
                w["fwd"] *= 1.4
                w["bwd"] *= 1.4
            if case == "compute_bound":
                for k in ("fwd", "bwd", "opt"):
                    w[k] *= 3
            if warmup and s < 2:
                w["fwd"] += WARMUP_S[s]
            works[r] = w
        busy = {r: sum(w.values()) for r, w in works.items()}
        last = max(busy.values())
        for r, w in works.items():
            wait = last - busy[r]  # waiting for the slowest rank inside the gradient all-reduce
            tail = (0.040 if case == "gradient_bound" else 0.003) * rnd.uniform(0.97, 1.03)
            syncs = 30 if case == "small_syncs" else 0
            sync_each = 0.0012 * rnd.uniform(0.97, 1.03)
            exposed = wait + tail + syncs * sync_each
            bw_start = w["data"] + w["fwd"]
            rows.append(_row(r, s, exposed=exposed, total=4 * 0.015 + wait + syncs * sync_each, **w))
            for i in range(4):  # gradient buckets: the last one's all-reduce is the tail after backward
                exp = (tail + wait) if i == 3 else 0.0
                colls.append((r, s, i, "all_reduce", world, MB25, 1, 0.015 + exp, exp,
                              T0 + s + bw_start + w["bwd"] * (i + 1) / 4, "dp"))
            if syncs:
                colls.append((r, s, 4, "all_reduce", world, 4 * syncs, syncs, syncs * sync_each, syncs * sync_each,
                              T0 + s + bw_start + w["bwd"] + tail + w["opt"], None))
    return rows, colls


def sim_case(case: str, world: int, steps: int, seed: int, warmup: bool) -> tuple[dict[str, Any], list[tuple], list[tuple]]:
    """A simulated fleet (``fleetscope.synthetic``): a straggler at 1.3× or a 15× slower loader."""
    spec = RunSpec(name=f"{case}-{world}-{seed}-{int(warmup)}", family="vit-h", world_size=world, steps=steps,
                   seed=seed, straggler={1: 1.3} if case == "sim_straggler" else {},
                   shift={"data_s": 15.0} if case == "sim_slow_loader" else {})
    i_step, i_comp, i_fwd = NAMES.index("step_s"), NAMES.index("compute_s"), NAMES.index("forward_s")
    rows: list[tuple] = []
    colls: list[tuple] = []
    for step, rs in rank_step_rows(spec):
        if warmup and step < 2:
            extra = WARMUP_S[step]
            rs = [tuple(v + extra if k in (i_step, i_comp) or (k == i_fwd and v is not None) else v
                        for k, v in enumerate(row)) for row in rs]
        rows += rs
        colls += collective_rows(spec, step, rs)
    return spec.run_info(), rows, colls


def _first_cause(d: dict[str, Any]) -> str | None:
    parts = d.get("parts") or []
    share = {p["cause"]: p["share"] for p in parts}
    ranked = [c for c in d.get("ranked_causes") or [] if c != "compute"]
    if ranked:
        return max(ranked, key=lambda c: share.get(c, 0.0))
    return parts[0]["cause"] if parts else None


def _wait_summary(c: Client, rid: int, steps: int, timeout: float = 300) -> dict[str, Any]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = c.summary(rid)
        if (s.get("steps") or 0) >= steps and s.get("diagnosis"):
            return s
        time.sleep(0.5)
    raise TimeoutError(f"run {rid} not compacted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="4,16", help="world sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--database-url", default=None, help="an empty Postgres database (default: embedded)")
    args = ap.parse_args()
    worlds = [int(x) for x in args.world.split(",") if x]

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
    results: list[dict[str, Any]] = []
    try:
        c = Client(base)
        pending = []
        for warmup in (False, True):
            for case in EXPECTED:
                for world in worlds:
                    for seed in range(args.seeds):
                        name = f"{case}-w{world}-s{seed}-{'warm' if warmup else 'plain'}"
                        if case.startswith("sim_"):
                            info, rows, colls = sim_case(case, world, args.steps, seed, warmup)
                            info = {**info, "name": name}
                            events = []
                        else:
                            rows, colls = ddp_case(case, world, args.steps, seed, warmup)
                            info = {"name": name, "model_family": "zoo", "world_size": world}
                            events = [{"rank": 0, "seq": 0, "kind": "ddp", "ts": T0, "step": None, "data": DDP_FACTS}]
                        rid = c.register_run(info)
                        c.ingest_rows(rid, rows, colls, **({"events": events} if events else {}))
                        pending.append((rid, name, case, warmup))
        for rid, name, case, warmup in pending:
            s = _wait_summary(c, rid, args.steps)
            d = s["diagnosis"]
            first = _first_cause(d)
            ranked = [x for x in d["ranked_causes"]]
            n_adv = len(d["advice"])
            per = n_adv / max(len(ranked), 1)
            basis = s.get("basis") or {}
            results.append({"case": case, "warmup": warmup, "ok": first == EXPECTED[case], "per": per,
                            "advice": n_adv, "ranked": len(ranked)})
            print(f"{name:34s} first={first!s:16s} want={EXPECTED[case]:16s} {'ok ' if first == EXPECTED[case] else 'BAD'} "
                  f"ranked={ranked} advice={n_adv} set_apart={basis.get('set_apart', '-') if isinstance(basis, dict) else '-'}",
                  file=sys.stderr)
        # liveness of the read path: the server answers, nothing else timed here
        httpx.get(f"{base}/healthz", timeout=10).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(30)
        if pg is not None:
            pg.stop()
    for warm, label in ((False, "agreement"), (True, "agreement_warmup")):
        rs = [r for r in results if r["warmup"] == warm]
        figure(label, sum(r["ok"] for r in rs) / max(len(rs), 1), f"share of {len(rs)} cases")
    tot_adv = sum(r["advice"] for r in results)
    tot_ranked = sum(max(r["ranked"], 1) for r in results)
    figure("advice_per_ranked_cause", tot_adv / max(tot_ranked, 1), "items (mean over runs' ranked causes)")
    figure("advice_per_ranked_cause_max", max((r["per"] for r in results), default=0.0), "items (worst run)")
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
