"""Projection error on scaling families whose scaling we control (docs/benchmarks.md, targets.md:
"projection from a family's smallest run to its measured sizes: median error ≤ 15 %, worst ≤ 25 %").

    python bench/projection.py [--sizes 4,8,16,32] [--steps 16]

Simulated fleets (``fleetscope.synthetic``: ring all-reduce at 350 GB/s busbw within an 8-GPU node, 45 GB/s
across nodes with latency terms growing with log2(n/8), overlap falling past a node) through the real ingest
and compaction of a ``fleetscope serve`` on embedded Postgres. Per family:

1. **blind**: the smallest run is ingested and projected (``GET /runs/{id}/projection``) to every other
   size before any run of its configuration exists there (the families before it in the list are already
   in the fleet: their collectives are the cluster's other measurements); then the other runs are
   ingested and the track record checks each projection against them (``GET /projections/track_record``);
2. **with bench**: the same after ``fleetscope bench``-style all_reduce busbw points at every size are
   recorded (what a cluster bench would measure: the cross-node bandwidth the small run cannot show).

Families: ``vit-h`` (compute-bound), ``llm-70b`` comm-bound (exposed communication × 60). Prints the
median and worst |error| per world-size ratio, and ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from fleetscope.client import Client, columnar  # noqa: E402
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows  # noqa: E402
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []
FAMILIES: dict[str, dict[str, Any]] = {
    "vit-h": {},
    "llm-70b": {"comm_bound": True, "shift": {"comm_exposed_s": 60.0}},
}


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_COMPACT_GRACE_S": "1", "FLEETSCOPE_ALERTS_ENABLED": "false"}
    p = subprocess.Popen([sys.executable, "-m", "fleetscope", "serve", "--database-url", url, "--port", str(port),
                          "--insecure-no-auth"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    Client(base).wait_ready(120)
    return p, base


def load(c: Client, spec: RunSpec) -> int:
    """Register and ingest ``spec`` with its collectives; wait until every step is compacted."""
    reg = {**spec.run_info(), "started_at": spec.start_ts}
    rid = int(c.register_run(reg))
    rows: list[tuple] = []
    colls: list[tuple] = []
    for step, rs in rank_step_rows(spec):
        rows += rs
        colls += collective_rows(spec, step, rs)
    hosts = [{"rank": r, "host": spec.host_of(r), "node": spec.host_of(r), "local_rank": r % spec.gpus_per_node}
             for r in range(spec.world_size)]
    c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar(rows, RANK_STEP_FIELDS),
              "collectives": columnar(colls, COLLECTIVE_FIELDS), "ranks": hosts})
    deadline = time.monotonic() + 300
    while c.summary(rid).get("steps", 0) < spec.steps:
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {rid} not compacted in time")
        time.sleep(0.3)
    return rid


def bench_points(sizes: list[int], gpus_per_node: int = 8) -> list[dict[str, Any]]:
    """all_reduce busbw a cluster bench would measure on the simulated cluster (its own formula)."""
    out = []
    for n in sizes:
        if n < 2:
            continue
        bw = (350e9 if n <= gpus_per_node else 45e9) / (1 + 0.12 * math.log2(max(n / gpus_per_node, 1)))
        for nbytes in (1 << 24, 1 << 28, 1 << 32):
            out.append({"name": "all_reduce_busbw", "params": {"bytes": nbytes, "world": n, "backend": "nccl"},
                        "unit": "GB/s", "value": bw / 1e9})
    return out


def scenario(base: str, label: str, sizes: list[int], steps: int, with_bench: bool) -> list[dict[str, Any]]:
    errors: list[dict[str, Any]] = []
    with Client(base) as c:
        if with_bench:
            httpx.post(f"{base}/api/v1/benchmarks", json={"cluster": "sim", "points": bench_points(sizes)},
                       timeout=60).raise_for_status()
        for fam, kw in FAMILIES.items():
            family = fam  # the synthetic model's family; the scenario goes in the config (its own signature)
            small = load(c, RunSpec(f"{fam}-{label}-{sizes[0]}", family, world_size=sizes[0], steps=steps, seed=1,
                                    start_ts=time.time(), config={"scenario": label}, **kw))
            for n in sizes[1:]:
                out = c.projection(small, world_size=n)
                if out["status"] != "ok":
                    print(f"{family}: {sizes[0]} → {n}: {out['status']} {out['missing']}")
            for i, n in enumerate(sizes[1:]):
                load(c, RunSpec(f"{fam}-{label}-{n}", family, world_size=n, steps=steps, seed=2 + i,
                                start_ts=time.time() + 1, config={"scenario": label}, **kw))
            rec = c.projection_track_record(family)
            for e in [e for e in rec["checked"] if e["from_run"] == small]:
                errors.append({**e, "family": fam})
                print(f"{label:>10} {fam:>8} {e['from_world_size']:>3} → {e['world_size']:>3}: projected "
                      f"{e['projected_step_s']:.3f} s, measured {e['measured_step_s']:.3f} s, error {100 * e['error']:+.1f} %")
    return errors


def summarise(label: str, errors: list[dict[str, Any]]) -> None:
    by: dict[int, list[float]] = {}
    for e in errors:
        by.setdefault(e["world_size"] // e["from_world_size"], []).append(abs(e["error"]))
    allv = [abs(e["error"]) for e in errors]
    if allv:
        figure(f"projection_{label}_median_abs_error", 100 * statistics.median(allv), "%")
        figure(f"projection_{label}_worst_abs_error", 100 * max(allv), "%")
    for r, v in sorted(by.items()):
        figure(f"projection_{label}_ratio{r}x_median_abs_error", 100 * statistics.median(v), "%")
        figure(f"projection_{label}_ratio{r}x_worst_abs_error", 100 * max(v), "%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,8,16,32", help="world sizes of each family, smallest first")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--database-url", default=None, help="an empty Postgres database (default: embedded)")
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.sizes.split(","))
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
    t0 = time.monotonic()
    try:
        # blind first: no bench points yet, so the small run's own collectives are all the cluster measured
        summarise("blind", scenario(base, "blind", sizes, args.steps, with_bench=False))
        summarise("with_bench", scenario(base, "bench", sizes, args.steps, with_bench=True))
    finally:
        proc.terminate()
        proc.wait(30)
        if pg is not None:
            pg.stop()
    figure("wall_s", time.monotonic() - t0, "s")
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
