"""The server at its bounds (issue "Bounded everywhere, runs owned"): every stored quantity at the
largest size server/limits.py allows, then the server's peak memory and the slowest read and page.

    python bench/edge.py --bounds [--before PATH_TO_OLD_FLEETSCOPE] [--ranks 16384] [--no-browser]

One embedded Postgres; each build serves its own database (``--database-url``), one after the other,
on loopback. Part 1, both builds (same payloads): an honest 16,384-rank job whose every rank
describes its tensor-parallel group (8 ranks) and its data-parallel group (ranks/8 ranks, listed):
ingest rate, stored bytes, summary time and server RSS. Part 2, this build only (the old one has no
bounds to be at): each bound filled (and overrun, to show the fold/refusal), then the summary, the
read endpoints and — in headless chromium — every page of those runs, with RSS sampled throughout.
Prints ``name: value unit`` lines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One build's `fleetscope serve` on its own database, with an RSS sampler."""

    def __init__(self, exe: str, db_url: str, tmp: Path, label: str) -> None:
        self.exe, self.db_url, self.label = exe, db_url, label
        env = {**os.environ, "FLEETSCOPE_DATABASE_URL": db_url}
        tok = subprocess.run([exe, "token", "create", "--name", f"bounds-{label}", "--scope", "admin",
                              "--database-url", db_url], capture_output=True, text=True, env=env, timeout=180)
        if tok.returncode != 0:
            raise SystemExit(f"{label}: token create failed: {tok.stderr[-2000:]}")
        self.token = tok.stdout.strip().splitlines()[-1]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"serve-{label}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([exe, "serve", "--port", str(self.port), "--database-url", db_url],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise SystemExit(f"{label}: server did not start")
        time.sleep(1.0)
        self.idle = self.rss()
        self.peak = self.idle
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self.client = httpx.Client(base_url=self.url, timeout=300,
                                   headers={"Authorization": f"Bearer {self.token}"})

    def rss(self) -> float:
        try:
            p = psutil.Process(self.proc.pid)
            return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
        except psutil.Error:
            return float("nan")

    def _sample(self) -> None:
        while not self._stop.is_set():
            r = self.rss()
            if r == r:
                self.peak = max(self.peak, r)
            time.sleep(0.05)

    def reset_peak(self) -> None:
        self.peak = self.rss()

    def register(self, name: str, world: int) -> int:
        r = self.client.post("/api/v1/runs", json={"name": name, "model_family": "bounds", "world_size": world})
        r.raise_for_status()
        return int(r.json()["id"])

    def ingest(self, doc: dict[str, Any]) -> httpx.Response:
        for _ in range(200):
            r = self.client.post("/api/v1/ingest", content=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
            if r.status_code not in (429, 503):
                return r
            time.sleep(float(r.headers.get("Retry-After", "1")))
        return r

    def stop(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


def _steps(rid: int, ranks: int, steps: int, t0: float) -> dict[str, Any]:
    """A few ordinary rank-steps so that the pages have something to draw."""
    rk = [r for s in range(steps) for r in range(ranks)]
    st = [s for s in range(steps) for _ in range(ranks)]
    return {"v": 1, "run_id": rid, "rank_steps": {
        "rank": rk, "step": st, "ts": [t0 + s for s in st], "step_s": [1.0] * len(rk),
        "data_s": [0.1] * len(rk), "compute_s": [0.7] * len(rk), "comm_exposed_s": [0.1] * len(rk)}}


def _db_bytes(db_url: str) -> int:
    import psycopg

    with psycopg.connect(db_url) as c:
        c.execute("CHECKPOINT")
        return int(c.execute("SELECT pg_database_size(current_database())").fetchone()[0])  # type: ignore[index]


def groups_case(srv: Server, ranks: int, figures: list[tuple[str, float, str]]) -> None:
    """Every rank of an honest `ranks`-rank job (tp=8) describes its TP and DP group."""
    tp = 8
    dp = ranks // tp
    rid = srv.register(f"groups-{ranks}", ranks)
    before = _db_bytes(srv.db_url)
    srv.reset_peak()
    per_batch = 64
    t = time.perf_counter()
    n_events = 0
    for lo in range(0, ranks, per_batch):
        evs = []
        for r in range(lo, min(ranks, lo + per_batch)):
            evs.append({"rank": r, "seq": 0, "kind": "comm_group", "ts": time.time(),
                        "data": {"dim": "tp", "size": tp, "ranks": list(range(r // tp * tp, r // tp * tp + tp)),
                                 "group": f"tp{r // tp}"}})
            evs.append({"rank": r, "seq": 1, "kind": "comm_group", "ts": time.time(),
                        "data": {"dim": "dp", "size": dp, "ranks": list(range(r % tp, ranks, tp)),
                                 "group": f"dp{r % tp}"}})
        resp = srv.ingest({"v": 1, "run_id": rid, "events": evs})
        if resp.status_code != 200:
            raise SystemExit(f"{srv.label}: group batch refused: {resp.status_code} {resp.text[:300]}")
        n_events += len(evs)
    dt = time.perf_counter() - t
    L = srv.label
    figures.append((f"{L}_groups_{ranks}_ingest", n_events / dt, f"group events/s ({n_events} events, {dt:.1f} s)"))
    figures.append((f"{L}_groups_{ranks}_stored", (_db_bytes(srv.db_url) - before) / 2**20, "MiB of database growth"))
    figures.append((f"{L}_groups_{ranks}_ingest_rss_peak_above_idle", srv.peak - srv.idle, "MiB"))
    srv.ingest(_steps(rid, 4, 3, time.time() - 100))
    srv.reset_peak()
    t = time.perf_counter()
    r = srv.client.get(f"/api/v1/runs/{rid}/summary")
    figures.append((f"{L}_groups_{ranks}_summary", time.perf_counter() - t, f"s (HTTP {r.status_code}, "
                    f"{len(r.content) // 1024} KB)"))
    figures.append((f"{L}_groups_{ranks}_summary_rss_peak_above_idle", srv.peak - srv.idle, "MiB"))


def _events_batches(rid: int, kind: str, n: int, data: Callable[[int], dict[str, Any]], world: int,
                    per_batch: int = 250) -> list[dict[str, Any]]:
    out = []
    for lo in range(0, n, per_batch):
        out.append({"v": 1, "run_id": rid, "events": [
            {"rank": i % world, "seq": 1000 + i // world, "kind": kind, "ts": time.time(), "data": data(i)}
            for i in range(lo, min(n, lo + per_batch))]})
    return out


def bound_runs(srv: Server, figures: list[tuple[str, float, str]]) -> dict[str, int]:
    """Each bound filled and overrun; returns {case: run id}."""
    from fleetscope.server import limits as L

    runs: dict[str, int] = {}
    t0 = time.time() - 3600

    def case(name: str, world: int, batches: list[dict[str, Any]] | Callable[[int], list[dict[str, Any]]]) -> None:
        rid = srv.register(f"bound-{name}", world)
        runs[name] = rid
        srv.ingest(_steps(rid, min(world, 8), 5, t0))
        docs = batches(rid) if callable(batches) else batches
        codes: dict[int, int] = {}
        srv.reset_peak()
        t = time.perf_counter()
        for d in docs:
            d["run_id"] = rid
            c = srv.ingest(d).status_code
            codes[c] = codes.get(c, 0) + 1
        figures.append((f"bound_{name}_ingest", time.perf_counter() - t,
                        "s (" + ", ".join(f"{n}×HTTP {c}" for c, n in sorted(codes.items())) + ")"))
        figures.append((f"bound_{name}_ingest_rss_peak_above_idle", srv.peak - srv.idle, "MiB"))

    big = {f"k{j}": j for j in range(L.MAX_EVENT_VALUES - 1)}  # an object of MAX_EVENT_VALUES values
    case("events_per_kind", 64, lambda rid: _events_batches(rid, "note", L.MAX_EVENTS_PER_KIND + 500,
                                                            lambda i: big, 64, per_batch=100))
    case("pp_stage", 4096, lambda rid: _events_batches(
        rid, "pp_stage", L.MAX_EVENTS_PER_KIND, lambda i: {"stage": i % L.MAX_PIPELINE_STAGES,
                                                           "num_stages": L.MAX_PIPELINE_STAGES,
                                                           "group_rank": i % 4096, "group_size": 4096}, 4096))
    reason = "x" * 65_000
    case("compile_reasons", 64, lambda rid: _events_batches(rid, "graph_break", 2000,
                                                            lambda i: {"reason": reason + str(i), "count": 1}, 64,
                                                            per_batch=50))

    def phases(rid: int) -> list[dict[str, Any]]:
        out = []
        for b in range(100):
            names = [f"phase-{b}-{j}" for j in range(1000)]
            out.append({"v": 1, "run_id": rid, "phases": {"rank": [0] * 1000, "step": [b % 5] * 1000,
                                                          "phase": names, "seconds": [1e-4] * 1000}})
        return out

    case("phase_names", 8, phases)

    def colls(rid: int) -> list[dict[str, Any]]:
        out = []
        n = L.MAX_COLLECTIVES_PER_RANK_STEP
        for r in range(8):
            out.append({"v": 1, "run_id": rid, "collectives": {
                "rank": [r] * n, "step": [2] * n, "seq": list(range(n)), "op": ["all_reduce"] * n,
                "group_size": [8] * n, "bytes": [1 << 20] * n, "calls": [1] * n, "total_s": [1e-5] * n,
                "exposed_s": [1e-6] * n, "dim": ["dp"] * n}})
        return out

    case("collectives_per_rank_step", 8, colls)

    def nodes(rid: int) -> list[dict[str, Any]]:
        world = 131_072
        out = []
        for lo in range(0, world, 8192):
            out.append({"v": 1, "run_id": rid, "ranks": [
                {"rank": r, "host": f"host-{r}", "node": f"node-{r}", "local_rank": 0} for r in range(lo, lo + 8192)]})
        return out

    case("nodes", 131_072, nodes)
    return runs


def reads(srv: Server, runs: dict[str, int], figures: list[tuple[str, float, str]]) -> None:
    paths = []
    for name, rid in runs.items():
        paths += [(f"{name}_summary", f"/api/v1/runs/{rid}/summary"), (f"{name}_overlap", f"/api/v1/runs/{rid}/overlap")]
    paths += [("nodes", "/api/v1/nodes"), ("runs", "/api/v1/runs?limit=1000")]
    worst = 0.0
    srv.reset_peak()
    for label, p in paths:
        t = time.perf_counter()
        r = srv.client.get(p)
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        figures.append((f"read_{label}", dt, f"s (HTTP {r.status_code}, {len(r.content) / 1e3:.0f} kB)"))
    figures.append(("read_slowest", worst, "s"))
    figures.append(("read_rss_peak_above_idle", srv.peak - srv.idle, "MiB"))


def pages(srv: Server, runs: dict[str, int], figures: list[tuple[str, float, str]]) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "dashboard"))
    from browser_util import start_browser, wait_for, wait_for_charts

    d = start_browser()
    srv.reset_peak()
    worst = ("", 0.0)
    try:
        d.get(f"{srv.url}/?token={srv.token}")
        wait_for(d, "document.querySelectorAll('#fleet-table a').length > 0", timeout=120, what="fleet")
        todo: list[tuple[str, str, Callable[[], Any]]] = [
            ("fleet", "/", lambda: wait_for(d, "document.querySelectorAll('#fleet-table a').length > 0", timeout=120,
                                            what="fleet")),
            ("cluster", "/cluster", lambda: wait_for(d, "document.getElementById('cluster-table') && "
                                                        "document.getElementById('cluster-table').innerText.length > 0",
                                                     timeout=120, what="cluster")),
            ("compare", "/compare?runs=" + ",".join(map(str, runs.values())),
             lambda: wait_for_charts(d, ["compare-series"], timeout=120)),
        ]
        todo += [(f"run_{n}", f"/runs/{rid}", lambda: wait_for_charts(d, ["run-decomposition"], timeout=120))
                 for n, rid in runs.items()]
        for name, path, ready in todo:
            t = time.perf_counter()
            d.get(srv.url + path)
            try:
                ready()
                dt = time.perf_counter() - t
                figures.append((f"page_{name}", dt, "s (load to drawn, headless chromium)"))
            except AssertionError as e:
                dt = time.perf_counter() - t
                figures.append((f"page_{name}", dt, f"s NOT DRAWN: {str(e)[:80]}"))
            if dt > worst[1]:
                worst = (name, dt)
    finally:
        d.quit()
    figures.append(("page_slowest", worst[1], f"s ({worst[0]})"))
    figures.append(("pages_rss_peak_above_idle", srv.peak - srv.idle, "MiB"))


def main(args: Any) -> None:
    import pgserver

    tmp = Path(tempfile.mkdtemp(prefix="fs-bounds-", dir="/tmp"))
    pg = pgserver.get_server(tmp / "pg", cleanup_mode=None)
    figures: list[tuple[str, float, str]] = []
    try:
        builds = [("after", args.fleetscope)]
        if args.before:
            builds.insert(0, ("before", args.before))
        for label, exe in builds:
            pg.psql(f"CREATE DATABASE bounds_{label};")
            url = pg.get_uri(database=f"bounds_{label}")
            srv = Server(exe, url, tmp, label)
            try:
                figures.append((f"{label}_server_rss_idle", srv.idle, "MiB"))
                groups_case(srv, args.ranks, figures)
                if label == "after":
                    runs = bound_runs(srv, figures)
                    time.sleep(3)  # the compactor's pass
                    reads(srv, runs, figures)
                    if not args.no_browser:
                        pages(srv, runs, figures)
                    t = time.perf_counter()
                    for rid in runs.values():
                        srv.client.delete(f"/api/v1/runs/{rid}")
                    figures.append(("delete_bound_runs", time.perf_counter() - t, "s"))
                    time.sleep(2)
                    figures.append(("after_delete_rss_above_idle", srv.rss() - srv.idle, "MiB"))
            finally:
                srv.stop()
    finally:
        try:
            pg.cleanup()
        except Exception:  # noqa: BLE001 - best effort
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for name, v, unit in figures:
        print(f"{name}: {v:.3g} {unit}")
