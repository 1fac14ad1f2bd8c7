"""Cost of the steady-state basis (issue 31) on the large run: the run's figures cold the way they were
computed before (one aggregate query over every step) and the way they are now (per-step times and
marking events read, the rule applied, the aggregate query without the set-apart steps), on the same
run in the same process, interleaved; then the run summary over HTTP, warm (p50 of 15) and cold.
With ``--compare-with PKG`` (a directory holding another checkout's ``fleetscope`` package, e.g. the
last commit's), a second server of that code serves the same database and the warm summaries of both
are timed interleaved: before and after, on the same run.

    python bench/steady_basis.py [--ranks 1024] [--steps 5000] [--compare-with /tmp/fs_head/pkg]

The large run is bench/analysis.py's (its loader, vectorised synthetic model, real ingest and
compaction), plus two compile events on its first steps so the basis sets something apart. Prints
``name: value unit`` lines last; ``load_average_1min`` gives the shared machine's load.
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis import FIGURES, figure, load_big_run, start_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compare-with", default=None, help="PYTHONPATH of another checkout's fleetscope package")
    args = ap.parse_args()

    from fleetscope.server.db import EmbeddedPostgres, make_engine, upgrade

    pg_dir = tempfile.mkdtemp(prefix="fsb-steady-", dir="/tmp")
    atexit.register(shutil.rmtree, pg_dir, True)
    pg = EmbeddedPostgres(pg_dir)
    pg.start()
    url = pg._server.get_uri("postgres")
    upgrade(url)
    procs = []
    proc, base = start_server(url)
    procs.append(proc)
    try:
        rid = load_big_run(base, args.ranks, args.steps, 317)
        from fleetscope.client import Client

        # two compile steps, as torch.compile reports them: the basis sets them apart
        Client(base).ingest({"v": 1, "run_id": rid, "events": [
            {"rank": 0, "seq": 10_000 + i, "kind": "compile", "ts": 1.7e9 + i, "step": i, "data": {"compile_s": 3.0}}
            for i in (0, 1)]})
        # events landed after the run's last compaction: measure on fresh servers, run_stats emptied
        proc.terminate()
        proc.wait(30)
        import psycopg
        from fleetscope.server.db import libpq_url

        with psycopg.connect(libpq_url(url)) as conn:
            conn.execute("DELETE FROM run_stats")
        proc, base = start_server(url)
        procs.append(proc)
        from fleetscope.server import reports
        from fleetscope.server.analysis.figures import run_figures
        from fleetscope.server.reports import runs as rr
        from fleetscope.server.store import aggregates
        from fleetscope.server.store import runs as run_store

        eng = make_engine(url, pool_size=2)
        try:
            run = run_store.get_run(eng, rid)
            assert run is not None

            def before() -> None:  # the figures as computed before the basis: every step
                run_figures(run, aggregates.load_aggregates(eng, [rid]).get(rid))

            def after() -> None:
                rr._steady_figures(eng, [run])

            tb, ta = [], []
            for _ in range(args.reps):  # interleaved: both see the same load
                t0 = time.perf_counter()
                before()
                tb.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                after()
                ta.append(time.perf_counter() - t0)
            b, a = statistics.median(tb), statistics.median(ta)
            figure("figures_cold_every_step_before", b * 1e3, "ms")
            figure("figures_cold_steady_basis_after", a * 1e3, "ms")
            figure("figures_cold_ratio_after_over_before", a / b, "x")
            basis = rr._steady_figures(eng, [run])[rid].basis or {}
            figure("basis_steps", float(basis.get("steps") or 0), f"of {basis.get('of')} steps")

            def cold_summary() -> None:
                reports.clear_caches()
                with eng.begin() as c:  # the run_stats row too: figures recomputed
                    from sqlalchemy import text

                    c.execute(text("DELETE FROM run_stats WHERE run_id = :r"), {"r": rid})
                reports.run_summary(eng, rid)

            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                cold_summary()
                ts.append(time.perf_counter() - t0)
            figure("summary_cold_in_process", statistics.median(ts) * 1e3, "ms")
        finally:
            eng.dispose()
        bases = {"after": base}
        if args.compare_with:
            old = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = args.compare_with
            try:
                p2, bases["before"] = start_server(url)
                procs.append(p2)
            finally:
                if old is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = old
        clients = {k: httpx.Client(base_url=b, timeout=120) for k, b in bases.items()}
        try:
            for h in clients.values():
                h.get(f"/api/v1/runs/{rid}/summary").raise_for_status()  # the cold one: caches filled
            ws: dict[str, list[float]] = {k: [] for k in clients}
            for _ in range(15):  # interleaved: both servers see the same load
                for k, h in clients.items():
                    t0 = time.perf_counter()
                    h.get(f"/api/v1/runs/{rid}/summary").raise_for_status()
                    ws[k].append(time.perf_counter() - t0)
            for k, v in ws.items():
                figure(f"summary_latency_warm_p50_{k}", statistics.median(v) * 1e3, "ms (target <= 300)")
            if "before" in ws:
                figure("summary_warm_ratio_after_over_before", statistics.median(ws["after"]) / statistics.median(ws["before"]), "x")
            print(f"basis: {clients['after'].get(f'/api/v1/runs/{rid}/summary').json()['basis']}", file=sys.stderr)
        finally:
            for h in clients.values():
                h.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
