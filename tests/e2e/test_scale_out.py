"""Compaction that scales out: two `fleetscope serve` processes on one Postgres, receiving
interleaved batches of the same runs, both compact (partitioned by run) and the data is exact —
nothing lost, nothing folded twice; and `--compaction-workers N` compacts in worker processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from fleetscope.client import Client
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

FS = [sys.executable, "-m", "fleetscope.cli"]
RUNS, WS, STEPS = 12, 4, 12


def _start(db_url: str, port: int, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "FLEETSCOPE_COMPACT_INTERVAL_S": "0.1", "FLEETSCOPE_COMPACT_GRACE_S": "0.3",
           "FLEETSCOPE_ALERTS_ENABLED": "false"}
    log = open(tmp / f"serve-{port}.log", "w")  # noqa: SIM115 - closed by the process's end
    return subprocess.Popen([*FS, "serve", "--port", str(port), "--database-url", db_url, *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _compacted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'^fleetscope_compacted_records_total\{kind="rank_step"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _load(urls: list[str], token: str) -> dict[str, tuple[int, int, float]]:
    """Send every run's steps, batch by batch, alternating between the servers; returns
    {name: (rank-steps, collective records, collective bytes)} sent."""
    clients = [Client(u, token) for u in urls]
    want: dict[str, tuple[int, int, float]] = {}
    ids = {}
    specs = [RunSpec(name=f"so-{i}", family="f", world_size=WS, steps=STEPS, seed=i) for i in range(RUNS)]
    for k, spec in enumerate(specs):
        ids[spec.name] = clients[k % 2].register_run(spec.run_info())
    gens = {s.name: (s, iter(rank_step_rows(s))) for s in specs}
    sent = 0
    while gens:
        for name in list(gens):
            spec, it = gens[name]
            item = next(it, None)
            if item is None:
                del gens[name]
                continue
            step, rows = item
            colls = collective_rows(spec, step, rows)
            half = len(rows) // 2  # one step's ranks split over both servers
            for j, (rs, cs) in enumerate(((rows[:half], colls[: half * 4]), (rows[half:], colls[half * 4:]))):
                clients[(sent + j) % 2].ingest_rows(ids[name], rs, cs)
            sent += 1
            n, c, b = want.get(name, (0, 0, 0.0))
            want[name] = (n + len(rows), c + len(colls), b + sum(x[5] for x in colls))
    for cl in clients:
        cl.close()
    return want


def _wait_exact(url: str, want: dict[str, tuple[int, int, float]], timeout: float = 90) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        runs = {r["name"]: r for r in httpx.get(f"{url}/api/v1/runs", params={"limit": 100}, timeout=10).json()["runs"]}
        # the counters include what landed but is not compacted yet; `steps` counts compacted steps only
        done = all(runs.get(n, {}).get("rank_steps") == w[0] and runs[n].get("collective_records") == w[1]
                   and runs[n].get("steps") == STEPS for n, w in want.items())
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    out = []
    for name, (n, c, b) in want.items():
        r = runs[name]
        assert (r["rank_steps"], r["collective_records"], r["steps"]) == (n, c, STEPS), (name, r)
        colls = httpx.get(f"{url}/api/v1/runs/{r['id']}/collectives", timeout=10).json()["collectives"]
        assert sum(x["bytes"] for x in colls) == b, name
        out.append(r)
    return out


def test_two_serve_processes_compact_in_parallel_and_exactly(db_url: str, tmp_path: Path) -> None:
    from conftest import free_port, wait_healthy

    subprocess.run([*FS, "db", "upgrade", "--database-url", db_url], check=True, capture_output=True, timeout=120)
    tok = subprocess.run([*FS, "token", "create", "--name", "so", "--database-url", db_url],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    ports = [free_port(), free_port()]
    procs = [_start(db_url, p, tmp_path) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u, p in zip(urls, procs, strict=True):
            wait_healthy(u, p)
        want = _load(urls, tok)
        _wait_exact(urls[0], want)
        total = sum(w[0] for w in want.values())
        deadline = time.monotonic() + 60  # the last fold's records may still be on their way to /metrics
        while _compacted(urls[0]) + _compacted(urls[1]) < total and time.monotonic() < deadline:
            time.sleep(0.3)
        a, b = _compacted(urls[0]), _compacted(urls[1])
        # both compacted, and between them every rank-step exactly once (no run folded by both)
        assert a > 0 and b > 0, (a, b)
        assert a + b == total, (a, b)
    finally:
        _stop(procs)


def test_compaction_workers_compact_off_the_serving_process(db_url: str, tmp_path: Path) -> None:
    from conftest import free_port, wait_healthy

    subprocess.run([*FS, "db", "upgrade", "--database-url", db_url], check=True, capture_output=True, timeout=120)
    tok = subprocess.run([*FS, "token", "create", "--name", "so", "--database-url", db_url],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    port = free_port()
    proc = _start(db_url, port, tmp_path, "--compaction-workers", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        want = _load([url, url], tok)
        _wait_exact(url, want)
        # the workers report their passes to the serving process's /metrics (it compacts nothing itself)
        total = sum(v[0] for v in want.values())
        deadline = time.monotonic() + 30
        while _compacted(url) < total and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _compacted(url) == total
        children = [c for c in psutil.Process(proc.pid).children(recursive=True) if "spawn" in " ".join(c.cmdline())]
        assert len(children) >= 2  # the two compaction processes (plus multiprocessing's tracker)
    finally:
        _stop([proc])
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive  # the workers stopped with the server
