"""Reads that cannot stall the store (issue 29): the worst reads a URL can make, ``/healthz`` while ten of
them run at once, and the ingest rate beside them — each against the same server in the same run.

    python bench/reads.py [--runs 360] [--seconds 20] [--fleetscope PATH]

A real ``fleetscope serve`` (embedded Postgres in a temp dir) on loopback is filled with ``--runs`` runs
(20 config keys and 8 training scalars each). Then:

* **worst accepted read**: 8 training-scalar filters, 24 config filters holding 512 ``in:`` values, 8 sort
  keys, 64 extra columns, ``limit=10000``; and a two-key ``group_by`` over the same filters — wall time of
  each (median of 3); target ≤ 5 s;
* **refused reads**: the tester's 64-clause scalar URL and 1,700 repeated ``sort=`` keys — status and time
  (a 4xx naming the cap);
* **/healthz p50/p99 while ten worst-case reads loop** (target p99 ≤ 50 ms), and every read's slowest answer;
* **ingest rate** (rank-steps/s accepted, a 64-rank run) for ``--seconds`` with no reads, then with the ten
  worst-case readers: the ratio is the cost of reads to ingest (reads have a pool of their own).

Loopback only; every loop is bounded by ``--seconds``. Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fill(url: str, token: str, runs: int) -> None:
    h = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=h, timeout=60) as c:
        for i in range(runs):
            cfg = {f"k{j}": (i * 7 + j) % 13 for j in range(20)}
            r = c.post("/api/v1/runs", json={"name": f"r{i}", "model_family": f"fam{i % 5}", "world_size": 8,
                                             "config": cfg})
            rid = r.json()["id"]
            ev = [{"kind": "scalars", "rank": 0, "seq": 0, "step": 1, "ts": 1.7e9,
                   "data": {f"s{j}": float((i + j) % 17) for j in range(8)}}]
            c.post("/api/v1/ingest", json={"v": 1, "run_id": rid, "events": ev})


def _worst_params() -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = [(f"scalar.s{j}.last", "lt:100") for j in range(8)]
    vals = ",".join(str(v) for v in range(21))  # 24 filters × 21 values = 504 values + 8 = 512
    p += [(f"config.k{j % 20}", f"in:{vals}") for j in range(24)]
    p += [("sort", f"-config.k{j}") for j in range(4)] + [("sort", f"scalar.s{j}.min") for j in range(4)]
    p += [("columns", ",".join([f"config.k{j}" for j in range(20)] + [f"scalar.s{j}.last" for j in range(8)]
                               + [f"meta.m{j}" for j in range(36)])), ("limit", "10000")]
    return p


def _timed_get(c: httpx.Client, path: str, params: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = c.get(path, params=params)
    return r.status_code, time.perf_counter() - t0


def _ingest_batches(n: int) -> list[tuple[list[tuple], Any]]:
    """``n`` batches of 50 steps × 64 ranks, generated before any clock starts: the load generator must
    not be what the figures measure (it shares the machine's cores with the server)."""
    from fleetscope.synthetic import RunSpec, rank_step_rows

    spec = RunSpec(name="ingest", family="bench", world_size=64, steps=100_000)
    gen = rank_step_rows(spec)
    out: list[tuple[list[tuple], Any]] = []
    for _ in range(n):
        rows: list[tuple] = []
        for _ in range(50):
            _s, rs = next(gen)
            rows += rs
        out.append((rows, spec))
    return out


def _prepare(url: str, token: str, batches: list[tuple[list[tuple], Any]]) -> list[tuple[int, bytes, dict[str, str]]]:
    """A new 64-rank run and its batches encoded for it: (rank-steps, body, headers) each."""
    from fleetscope.client import columnar
    from fleetscope.synthetic import RunSpec
    from fleetscope.wire import RANK_STEP_FIELDS, encode_batch

    spec = RunSpec(name=f"ingest-{time.time_ns()}", family="bench", world_size=64, steps=100_000)
    rid = httpx.post(f"{url}/api/v1/runs", json=spec.run_info(), headers={"Authorization": f"Bearer {token}"},
                     timeout=60).json()["id"]
    return [(len(rows), *encode_batch({"v": 1, "run_id": rid, "rank_steps": columnar(rows, RANK_STEP_FIELDS)}))
            for rows, _spec in batches]


def _ingest_loop(url: str, token: str, seconds: float, out: list[int], bodies: list[tuple[int, bytes, dict[str, str]]]) -> None:
    h = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=h, timeout=60) as c:
        end = time.monotonic() + seconds
        sent = 0
        i = 0
        while time.monotonic() < end and i < len(bodies):
            n, body, headers = bodies[i]
            i += 1
            r = c.post("/api/v1/ingest", content=body, headers=headers)
            if r.status_code == 200:
                sent += n
        if i == len(bodies):
            print(f"warning: all {len(bodies)} prepared batches were sent before the phase ended", file=sys.stderr)
        out.append(sent)

def _readers(url: str, params: Any, n: int, stop: Any, q: Any) -> None:
    """``n`` threads looping on the worst read until ``stop``; puts ("readers", (slowest_s, {status: count}))."""
    slowest = [0.0]
    codes: dict[int, int] = {}

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                s, t = _timed_get(c, "/api/v1/runs", params)
                slowest[0] = max(slowest[0], t)
                codes[s] = codes.get(s, 0) + 1

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(150)
    q.put(("readers", (slowest[0], codes)))


def _probe(url: str, seconds: float, q: Any) -> None:
    """``/healthz`` every 50 ms for ``seconds`` on one keep-alive connection; puts ("probe", [ms, ...])."""
    lat: list[float] = []
    end = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=30) as c:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.get("/healthz")
            lat.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.05)
    q.put(("probe", lat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleetscope", default=shutil.which("fleetscope") or str(Path(sys.executable).parent / "fleetscope"))
    ap.add_argument("--runs", type=int, default=360)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each timed phase")
    ap.add_argument("--batches", type=int, default=800, help="ingest batches (3,200 rank-steps each) prepared "
                                                            "before the timed phases")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="fs-reads-", dir="/tmp"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLEETSCOPE_DATABASE_URL": ""}
    tok = subprocess.run([args.fleetscope, "token", "create", "--name", "reads-bench", "--scope", "admin",
                          "--data-dir", str(tmp)], capture_output=True, text=True, env=env, timeout=120)
    token = tok.stdout.strip().splitlines()[-1]
    srv = subprocess.Popen([args.fleetscope, "serve", "--port", str(port), "--data-dir", str(tmp)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    figures: list[tuple[str, float, str]] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        _fill(url, token, args.runs)
        time.sleep(2.0)  # let compaction settle
        worst = _worst_params()
        group = [p for p in worst if p[0] not in ("sort", "columns", "limit")] + [("group_by", "config.k0,config.k1")]
        with httpx.Client(base_url=url, timeout=120) as c:
            for name, params in (("worst_list", worst), ("worst_group", group)):
                res = [_timed_get(c, "/api/v1/runs", params) for _ in range(3)]
                assert all(s == 200 for s, _ in res), res
                figures.append((f"{name}_read_s", statistics.median(t for _, t in res), "s (median of 3)"))
            s, t = _timed_get(c, "/api/v1/runs", [(f"scalar.loss{i}.min", "lt:1") for i in range(64)])
            figures.append(("refused_64_scalar_clauses_s", t, f"s (HTTP {s})"))
            s, t = _timed_get(c, "/api/v1/runs", [("sort", f"config.k{i}") for i in range(1700)])
            figures.append(("refused_1700_sort_keys_s", t, f"s (HTTP {s})"))

        # ingest alone
        alone: list[int] = []
        batches = _ingest_batches(int(args.batches))
        bodies_alone, bodies_loaded = _prepare(url, token, batches), _prepare(url, token, batches)
        del batches
        _ingest_loop(url, token, args.seconds, alone, bodies_alone)
        # ten worst-case readers looping (a process of their own), /healthz probed from another process,
        # ingest beside them: the probe and the readers do not wait for this process's GIL, so what the
        # probe measures is the server, as a load balancer on another machine would see it.
        ctx = multiprocessing.get_context("spawn")
        q: Any = ctx.Queue()
        stop = ctx.Event()
        rproc = ctx.Process(target=_readers, args=(url, worst, 10, stop, q))
        rproc.start()
        time.sleep(1.0)  # the readers are looping before the probe and ingest start
        pproc = ctx.Process(target=_probe, args=(url, args.seconds, q))
        pproc.start()
        loaded: list[int] = []
        _ingest_loop(url, token, args.seconds, loaded, bodies_loaded)
        pproc.join(args.seconds + 60)
        stop.set()
        rproc.join(180)
        got = dict(q.get(timeout=10) for _ in range(2))
        lat = got["probe"]
        slowest, codes = got["readers"]
        lat.sort()
        figures.append(("healthz_p50_under_10_worst_reads", statistics.median(lat), "ms"))
        figures.append(("healthz_p95_under_10_worst_reads", lat[min(len(lat) - 1, int(0.95 * len(lat)))], "ms"))
        figures.append(("healthz_p99_under_10_worst_reads", lat[min(len(lat) - 1, int(0.99 * len(lat)))], "ms"))
        figures.append(("healthz_over_50ms", sum(x > 50 for x in lat), f"of {len(lat)} probes"))
        figures.append(("slowest_worst_read_under_load", slowest, "s"))
        figures.append(("worst_reads_answered", sum(codes.values()), f"({codes})"))
        figures.append(("ingest_alone", alone[0] / args.seconds, "rank-steps/s"))
        figures.append(("ingest_with_10_worst_reads", loaded[0] / args.seconds, "rank-steps/s"))
        figures.append(("ingest_ratio_with_vs_without_reads", loaded[0] / max(1, alone[0]), "x"))
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for name, v, unit in figures:
        print(f"{name}: {v:.3f} {unit}")


if __name__ == "__main__":
    main()
