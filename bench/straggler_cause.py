"""Straggler-cause precision and recall on simulated fleets with mixed causes (issue 32's benchmark).

    python bench/straggler_cause.py [--fleets 8] [--steps 40] [--seed 0]

Each fleet is one ``fleetscope simulate`` run (``fleetscope.simulate.run_simulation``: the agent transport,
real ingest, compaction) of 64, 128 or 256 ranks sent to a real server (``fleetscope serve`` on embedded
Postgres, loopback HTTP) with 3–6 culprit ranks of different kinds drawn by the fleet's seed:

- a GPU throttled for ``power``, ``thermal`` or ``hw_slowdown`` (``--throttle RANK:REASON``: its compute
  1.4×, 1.25×, 1.6× slower and every rank's device telemetry showing it),
- ``network``: one rank whose collectives take 1.6–2.5× as long (``--slow-link RANK=FACTOR``: a bad NIC or
  cable; its work is unchanged),
- ``data``: one rank whose data loading takes 12–25× as long (``--slow-loader RANK=FACTOR``; data is ~2 % of
  the step, so the rank is ~1.25–1.5× slower).

Confounders in every fleet (they must not change what is named): 1–2 healthy ranks whose GPU throttles
(power) about half the time without being slower (power capping that costs nothing), and every other
``data`` culprit's GPU also throttles (power) half the time — its excess is in data loading, which no GPU
clock explains, so its cause must stay ``data``. ``--no-confounders`` leaves them out.

What the server names, read from the run summary (``GET /api/v1/runs/{id}/summary``): each straggler with
its ``cause`` — a throttle reason when its device throttled (the reason is the named kind), else its late
component (``data``, ``compute``, ``other``) — and each network-slow rank (``network.slow_ranks``, and the
ranks of any ``network.slow_nodes``) as ``network``. Every (rank, kind) named counts once.

- precision = named (rank, kind) pairs that match an injected culprit and its kind / all pairs named;
- recall = injected culprits named with their kind / all injected culprits.

Prints a table per fleet and per kind, then ``name: value unit`` lines (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("power", "thermal", "hw_slowdown", "network", "data")
SIZES = (64, 128, 256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def draw(seed: int, ranks: int) -> dict[int, tuple[str, float]]:
    """The fleet's culprits: rank -> (kind, factor); 3–6 of them, at least three kinds."""
    rng = random.Random(f"straggler-cause:{seed}")
    n = rng.randint(3, 6)
    kinds = rng.sample(KINDS, 3) + [rng.choice(KINDS) for _ in range(n - 3)]
    picks = rng.sample(range(ranks), n)
    out: dict[int, tuple[str, float]] = {}
    for r, k in zip(picks, kinds, strict=True):
        f = round(rng.uniform(1.6, 2.5), 2) if k == "network" else round(rng.uniform(12, 25), 1) if k == "data" else 1.0
        out[r] = (k, f)
    return out


def bystanders(seed: int, ranks: int, culprits: dict[int, tuple[str, float]]) -> list[int]:
    """Ranks whose GPU throttles (power) with no slowdown: 1–2 healthy ranks and every other ``data`` culprit."""
    rng = random.Random(f"straggler-cause-bystanders:{seed}")
    healthy = [r for r in range(ranks) if r not in culprits]
    data = sorted(r for r, (k, _) in culprits.items() if k == "data")
    return rng.sample(healthy, rng.randint(1, 2)) + data[::2]


def throttle_windows(ranks: list[int], world: int, t_lo: float, t_hi: float) -> list[dict[str, Any]]:
    """``device`` windows over [t_lo, t_hi) of ``ranks`` whose GPU sat at its power cap (as the agent sends)."""
    from fleetscope.simulate import _Events, device_events

    ev = _Events()
    for r in ranks:
        ev.seq[r] = 5_000_000  # apart from the simulation's own device events
    evs = device_events(world, {r: "power" for r in ranks}, t_lo, t_hi, ev, max_windows=1, window_s=t_hi - t_lo)
    return [e for e in evs if e["rank"] in set(ranks)]


def named(summary: dict[str, Any]) -> set[tuple[int, str]]:
    """(rank, kind) pairs the run summary names (see the module docstring)."""
    out: set[tuple[int, str]] = set()
    for it in summary.get("stragglers") or []:
        cause = it.get("cause") or {}
        kind = cause.get("reason") or it.get("component") or "unknown"
        out.add((int(it["rank"]), str(kind)))
    net = summary.get("network") or {}
    for it in net.get("slow_ranks") or []:
        out.add((int(it["rank"]), "network"))
    for nd in net.get("slow_nodes") or []:
        for r in nd.get("ranks") or []:
            out.add((int(r), "network"))
    return out


def run_fleet(base: str, token: str, i: int, seed: int, steps: int, confounders: bool = True) -> dict[str, Any]:
    import httpx

    from fleetscope.simulate import run_simulation

    ranks = SIZES[i % len(SIZES)]
    culprits = draw(seed, ranks)
    throttle = {r: k for r, (k, _) in culprits.items() if k in ("power", "thermal", "hw_slowdown")}
    links = {r: f for r, (k, f) in culprits.items() if k == "network"}
    loaders = {r: f for r, (k, f) in culprits.items() if k == "data"}
    name = f"cause-{seed}"
    run_simulation(server=base, token=token, run=name, family="llm-70b", ranks=ranks, steps=steps, seed=seed,
                   step_ms=1000.0, throttle=throttle, slow_links=links, slow_loaders=loaders, flush_timeout_s=300)
    h = {"Authorization": f"Bearer {token}"}
    runs = httpx.get(f"{base}/api/v1/runs", params={"name": name}, headers=h, timeout=60).json()
    rid = next(r["id"] for r in runs["runs"] if r["name"] == name)
    by = bystanders(seed, ranks, culprits) if confounders else []
    if by:  # after the steps' span (1 s steps from RunSpec's start): half of each such rank's telemetry time
        from fleetscope.synthetic import RunSpec

        t1 = RunSpec(name=name, family="llm-70b", world_size=ranks, steps=steps).start_ts + steps * 1.0 + 5.0
        evs = throttle_windows(by, ranks, t1, t1 + steps)
        httpx.post(f"{base}/api/v1/ingest", json={"v": 1, "run_id": rid, "events": evs}, headers=h,
                   timeout=120).raise_for_status()
    deadline = time.monotonic() + 300
    summary: dict[str, Any] = {}
    while time.monotonic() < deadline:  # compaction lands the rollups the straggler report reads
        summary = httpx.get(f"{base}/api/v1/runs/{rid}/summary", headers=h, timeout=300).json()
        if summary.get("steps", 0) >= steps:
            time.sleep(1.0)  # then once more: anything that landed with the last steps
            summary = httpx.get(f"{base}/api/v1/runs/{rid}/summary", headers=h, timeout=300).json()
            break
        time.sleep(1.0)
    got = named(summary)
    truth = {(r, k) for r, (k, _) in culprits.items()}
    extra = int((summary.get("network") or {}).get("slow_ranks_total") or 0) - len(
        (summary.get("network") or {}).get("slow_ranks") or [])
    return {"seed": seed, "ranks": ranks, "culprits": culprits, "named": got, "bystanders": by, "tp": len(got & truth),
            "fp": len(got - truth) + max(extra, 0), "fn": len(truth - got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleets", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0, help="first fleet's seed (the others follow)")
    ap.add_argument("--no-confounders", action="store_true", help="no throttling GPUs besides the culprits'")
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)

    import httpx
    from fleetscope.server.auth import create_token
    from fleetscope.server.db import EmbeddedPostgres, make_engine, upgrade

    tmp = Path(tempfile.mkdtemp(prefix="fs-cause-", dir="/tmp"))
    pg = EmbeddedPostgres(tmp)
    url = pg.start()
    server = None
    results = []
    try:
        upgrade(url)
        eng = make_engine(url, pool_size=1)
        token = create_token(eng, "bench", scope="admin", replace=True)
        eng.dispose()
        port = _free_port()
        env = {**os.environ, "FLEETSCOPE_COMPACT_GRACE_S": "1", "FLEETSCOPE_COMPACT_INTERVAL_S": "0.5"}
        server = subprocess.Popen([sys.executable, "-m", "fleetscope.cli", "serve", "--database-url", url, "--port",
                                   str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        for i in range(args.fleets):
            res = run_fleet(base, token, i, args.seed + i, args.steps, not args.no_confounders)
            results.append(res)
            inj = ", ".join(f"{r}:{k}" for r, (k, _) in sorted(res["culprits"].items()))
            wrong = sorted(p for p in res["named"] if p not in {(r, k) for r, (k, _) in res["culprits"].items()})
            print(f"fleet seed={res['seed']:<3} ranks={res['ranks']:<4} injected [{inj}]  tp={res['tp']} fp={res['fp']} "
                  f"fn={res['fn']}" + (f"  bystanders {res['bystanders']}" if res["bystanders"] else "")
                  + (f"  wrong {wrong}" if wrong else ""), flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{'kind':<12} {'injected':>8} {'found':>6} {'named':>6} {'precision':>9} {'recall':>6}")
    for k in KINDS:
        inj = sum(1 for r in results for _, (kk, _) in r["culprits"].items() if kk == k)
        found = sum(1 for r in results for rk, (kk, _) in r["culprits"].items() if kk == k and (rk, k) in r["named"])
        nm = sum(1 for r in results for _, kk in r["named"] if kk == k)
        print(f"{k:<12} {inj:>8} {found:>6} {nm:>6} {found / max(nm, 1):>9.3f} {found / max(inj, 1):>6.3f}")
    others = sum(1 for r in results for _, kk in r["named"] if kk not in KINDS)
    print(f"{'other kinds':<12} {0:>8} {0:>6} {others:>6}")
    tp = sum(r["tp"] for r in results)
    fp = sum(r["fp"] for r in results)
    fn = sum(r["fn"] for r in results)
    print(f"load after: {os.getloadavg()}")
    print(f"straggler_cause_fleets: {len(results)} fleets ({', '.join(str(r['ranks']) for r in results)} ranks)")
    print(f"straggler_cause_culprits: {tp + fn}")
    print(f"straggler_cause_precision: {tp / max(tp + fp, 1):.3f}")
    print(f"straggler_cause_recall: {tp / max(tp + fn, 1):.3f}")


if __name__ == "__main__":
    main()
