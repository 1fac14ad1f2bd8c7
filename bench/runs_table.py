"""Runs table and training scalars at research scale (issue 23):

* ``GET /api/v1/runs`` filter + sort + page, filter + group, and a config-key sort over 10,000 runs
  with 50 config keys each (real server, embedded Postgres, figures in ``run_stats`` as the pages leave
  them) — median of ``--reps`` wall-clock round trips (target ≤ 200 ms);
* the ``/runs-table`` page in headless chromium: URL load with a filter and a group to the table and
  the groups drawn (median of 3, after one warm-up load);
* the training-thread cost of ``run.log`` of 10 scalars (a real agent run, real transport, offline)
  next to references in the same process: prometheus_client's 10 ``Gauge.set`` and, when importable,
  wandb's offline ``run.log`` of the same 10 keys.

    python bench/runs_table.py [--runs 10000] [--keys 50] [--reps 7] [--no-browser] [--log-steps 20000]

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
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

ROOT = Path(__file__).resolve().parents[1]
_pc = time.perf_counter_ns


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="fs-benchrt-", dir="/tmp"))
        atexit.register(shutil.rmtree, self.dir, True)
        self.figures: list[tuple[str, float, str]] = []

    def fig(self, name: str, value: float, unit: str) -> None:
        self.figures.append((name, value, unit))
        print(f"  {name}: {value:.4g} {unit}", flush=True)

    # ---------------------------------------------------------------- server
    def start(self) -> None:
        import psycopg
        import uvicorn
        from fleetscope.server.auth import create_token
        from fleetscope.server.db import EmbeddedPostgres
        from fleetscope.server.settings import Settings

        from fleetscope.webapp import create_web_app

        self.pg = EmbeddedPostgres(str(self.dir / "pg"))
        self.pg.start()
        admin = self.pg._server.get_uri("postgres")
        name = "bench_" + uuid.uuid4().hex[:8]
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        head, _, query = admin.partition("?")
        url = f"{head.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")
        # the health pass off: it would judge 10,000 synthetic runs every 5 s, noise beside the measured queries
        self.app = create_web_app(Settings(database_url=url, port=0, health_enabled=False))
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
        self.engine = self.app.state.fs.engine
        self.token = create_token(self.engine, "bench", scope="admin", replace=True)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.pg.stop()

    # ---------------------------------------------------------------- load
    def load(self) -> None:
        """N runs × K config keys, tags, commits; figures stored as the pages store them (run_stats at
        the runs' counters: fresh); a loss scalar on every 10th run."""
        from fleetscope.server.analysis.figures import RunFigures
        from fleetscope.server.db import raw_connection

        rng = random.Random(0)
        n, k = self.args.runs, self.args.keys
        t = time.perf_counter()
        runs, stats, scalars = [], [], []
        for i in range(n):
            cfg: dict[str, Any] = {"tp": rng.choice([1, 2, 4, 8]), "pp": rng.choice([1, 2, 4]),
                                   "lr": rng.choice([1e-4, 3e-4, 1e-3, 3e-3]), "seq_len": rng.choice([2048, 4096, 8192]),
                                   "optimizer": rng.choice(["adamw", "lion", "sgd"]), "batch_size": rng.choice([256, 512])}
            for j in range(k - len(cfg)):
                cfg[f"knob_{j:02d}"] = rng.random() if j % 3 else rng.choice(["a", "b", "c"])
            tags = ["sweep-" + str(i % 20)] + (["ablation"] if i % 7 == 0 else [])
            runs.append((i + 1, f"run-{i:05d}", "llama", json.dumps(cfg), json.dumps({"tags": tags}),
                         f"{i % 97:02x}{rng.getrandbits(32):08x}", 1.7e9 + 60 * i, rng.choice([8, 64, 512])))
            step_s = rng.uniform(0.5, 3.0)
            f = RunFigures(steps=100, step_s=step_s, mfu=rng.uniform(0.2, 0.6), tokens_per_s=1e6 / step_s,
                           tokens_per_s_per_gpu=2e4 / step_s)
            stats.append((i + 1, json.dumps(f.to_json())))
            if i % 10 == 0:
                scalars.extend((i + 1, "loss", s, 0, 3.0 - s / 100 + rng.random() * 0.01) for s in range(100))
        with raw_connection(self.engine) as conn, conn.cursor() as cur:
            with cur.copy("COPY runs (id, name, model_family, config, meta, git_commit, started_at, world_size, status, "
                          "rank_steps) FROM STDIN") as cp:
                for rid, name, fam, cfg_s, meta_s, commit, ts, ws in runs:
                    cp.write_row((rid, name, fam, cfg_s, meta_s, commit,
                                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts)), ws, "finished", 100))
            cur.execute("SELECT setval(pg_get_serial_sequence('runs', 'id'), %s)", (n + 1,))
            with cur.copy("COPY run_stats (run_id, rank_steps, status, stats) FROM STDIN") as cp:
                for rid, s in stats:
                    cp.write_row((rid, 100, "finished", s))
            with cur.copy("COPY run_scalars (run_id, name, step, rank, value) FROM STDIN") as cp:
                for row in scalars:
                    cp.write_row(row)
            cur.execute("INSERT INTO run_scalar_names (run_id, name, last_step, last_rank, last_value, min_value) "
                        "SELECT DISTINCT ON (run_id, name) run_id, name, step, rank, value, "
                        "min(value) OVER (PARTITION BY run_id, name) FROM run_scalars ORDER BY run_id, name, step DESC, rank")
            cur.execute("ANALYZE")
            conn.commit()
        self.fig("load_s", time.perf_counter() - t, f"s ({n:,} runs × {k} config keys, {len(scalars):,} scalar points)")

    # ---------------------------------------------------------------- API
    def api(self) -> None:
        queries = {
            "filter_sort_page": "config.tp=4&config.lr>0.0005&tag=sweep-3&sort=-mfu&limit=50",
            "filter_in_sort_config_key": "config.seq_len=in:4096,8192&config.optimizer!=sgd&sort=-config.lr,config.knob_01&limit=50",
            "group_two_keys": "config.lr>0.0005&group_by=config.tp,config.seq_len",
            "group_all_runs": "group_by=config.optimizer",
            "scalar_column_sort": "sort=scalar.loss.min&columns=scalar.loss.last,config.tp&limit=50",
            "figures_page_50": "sort=-started_at&limit=50&figures=true&columns=config.tp,config.lr",
        }
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for name, qs in queries.items():
                c.get("/api/v1/runs?" + qs).raise_for_status()  # warm
                times = []
                for _ in range(self.args.reps):
                    t = time.perf_counter()
                    r = c.get("/api/v1/runs?" + qs)
                    times.append(time.perf_counter() - t)
                    r.raise_for_status()
                body = r.json()
                what = f"{len(body.get('groups') or [])} groups" if body.get("groups") else \
                    f"{body.get('total')} match, {len(body['runs'])} returned"
                self.fig(f"api_{name}_ms", 1000 * statistics.median(times), f"ms (median of {self.args.reps}; {what}; "
                         f"target ≤ 200)")

    # ---------------------------------------------------------------- browser
    def browser(self) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "dashboard"))
        from browser_util import start_browser, wait_for

        d = start_browser()
        try:
            url = f"{self.url}/runs-table?filter=config.tp%3D4%20config.lr%3E0.0005&group=config.seq_len" \
                  "&columns=config.lr,scalar.loss.last&sort=mfu:desc"
            cond = ("document.querySelector('#rt-count') && document.querySelector('#rt-count').innerText.includes('runs match')"
                    " && document.querySelectorAll('#rt-table tr').length > 10"
                    " && document.querySelectorAll('#rt-groups tr').length > 1")
            d.get(url)
            wait_for(d, cond, timeout=120, what="runs table")
            times = []
            for _ in range(3):
                t = time.perf_counter()
                d.get(url)
                wait_for(d, cond, timeout=120, what="runs table")
                times.append(time.perf_counter() - t)
            self.fig("runs_table_page_s", statistics.median(times), "s (URL load with filter + group + columns to table "
                                                                    "and groups drawn, median of 3)")
            box = d.find_element("id", "rt-filter")
            from selenium.webdriver.common.keys import Keys

            t = time.perf_counter()
            box.send_keys(" tag=ablation" + Keys.ENTER)
            wait_for(d, "window.location.search.includes('ablation') && !document.querySelector('#rt-loading "
                        "[data-dash-is-loading]')", timeout=60, what="the new filter")
            wait_for(d, "document.querySelector('#rt-count').innerText.includes('runs match')", what="count")
            self.fig("runs_table_refilter_s", time.perf_counter() - t, "s (one more filter clause typed → table redrawn)")
        finally:
            d.quit()

    # ---------------------------------------------------------------- run.log
    def run_log(self) -> None:
        os.environ.pop("FLEETSCOPE_DISABLED", None)
        import fleetscope.agent as fs

        n = self.args.log_steps
        run = fs.init("bench-log", offline=True, spool_dir=str(self.dir / "spool"), collectives=False)
        keys = [f"train/metric_{i}" for i in range(10)]
        log = run.log

        def agent(m: int) -> list[int]:
            out: list[int] = []
            for i in range(m):
                v = i * 0.001
                with run.step(tokens=1):
                    pass
                t0 = _pc()
                log({k: v for k in keys})
                out.append(_pc() - t0)
            return out

        from prometheus_client import CollectorRegistry, Gauge

        reg = CollectorRegistry()
        sets = [Gauge(f"train_metric_{i}", "bench", registry=reg).set for i in range(10)]

        def prom(m: int) -> list[int]:
            out: list[int] = []
            for i in range(m):
                v = i * 0.001
                t0 = _pc()
                for s in sets:
                    s(v)
                out.append(_pc() - t0)
            return out

        contenders: dict[str, Any] = {"agent": agent, "prometheus": prom}
        finish_wandb = None
        try:
            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(self.dir), WANDB_CONSOLE="off")
            import wandb

            wrun = wandb.init(project="fleetscope-bench", dir=str(self.dir), settings=wandb.Settings(console="off"))
            wlog = wrun.log

            def wb(m: int) -> list[int]:
                out: list[int] = []
                for i in range(m):
                    v = i * 0.001
                    t0 = _pc()
                    wlog({k: v for k in keys})
                    out.append(_pc() - t0)
                return out

            contenders["wandb"] = wb
            finish_wandb = wrun.finish
        except ImportError:
            print("wandb not importable: compared with prometheus_client only", file=sys.stderr)
        res: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(5):  # interleaved rounds: the same machine state for every contender
            for name, fn in contenders.items():
                m = min(n, 2_000) if name == "wandb" else n
                xs = sorted(fn(m + 200)[200:])
                res[name].append(xs[len(xs) // 2] / 1000)
        run.finish()
        if finish_wandb is not None:
            finish_wandb()
        med = {k: statistics.median(v) for k, v in res.items()}
        self.fig("run_log_10_scalars_us", med["agent"], "µs (median over 5 interleaved rounds of per-call medians; "
                                                         "training thread)")
        self.fig("prometheus_10_gauge_sets_us", med["prometheus"], "µs (same run)")
        self.fig("run_log_over_prometheus", med["agent"] / med["prometheus"], "×")
        if "wandb" in med:
            self.fig("wandb_log_10_keys_us", med["wandb"], "µs (offline, same run)")
            self.fig("wandb_over_run_log", med["wandb"] / med["agent"], "× (target ≥ 20)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--log-steps", type=int, default=20_000)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--only-log", action="store_true", help="only the run.log comparison (no server)")
    args = ap.parse_args()
    b = Bench(args)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    if not args.only_log:
        b.start()
        try:
            b.load()
            b.api()
            if not args.no_browser:
                b.browser()
        finally:
            b.stop()
    b.run_log()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print("---")
    for name, value, unit in b.figures:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
