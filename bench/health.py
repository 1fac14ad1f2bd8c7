"""Run health (#21): hang detection latency on simulated fleets, false hang alerts on normal runs, and the
cost of the health pass.

    python bench/health.py [--ranks 1024,16384] [--step-ms 1000] [--stall-min-s 10] [--interval-s 5]
                           [--run-hours 1000] [--pass-runs 200]

1. **Detection latency.** A real server (``fleetscope serve``, embedded Postgres, a local Slack
   receiver) with the health pass every ``--interval-s`` seconds and ``stall_min_s`` = ``--stall-min-s``
   (default thresholds otherwise: 10 × p99 step time). ``fleetscope simulate --hang RANK@5`` (the real
   agent transport) sends 5 steps of ``--step-ms`` on each fleet size, then every rank's position every
   5 s (the others blocked in the step's all_reduce, RANK in its data loader). Hang start = the end of
   the last step (its ``ts + step_s`` as stored); ``/health`` is polled every 0.2 s. Figures: seconds
   from hang start to state ``hung`` and to the Slack message, the threshold the server used, and what
   is left after the threshold (detection overhead: agent flush, pass interval, Slack delivery).
2. **False hang alerts** of the state machine (``analysis.health.evaluate``, the function the pass
   calls) on ``--run-hours`` simulated hours of normal runs: step times 0.5-10 s with 5 % lognormal
   jitter and 1 in 1,000 steps 3× slow, 0-10 s of agent flush delay on each step's arrival, a declared
   checkpoint pause every 20-60 min lasting 30-900 s (a quarter of them 1.5× longer than declared),
   a declared evaluation every 1-3 h lasting 2-20 min, and their first step minutes after registration.
   The pass is evaluated every ``--interval-s`` seconds wherever the run has gone ``stall_min_s`` (60 s)
   without progress; faster gaps cannot stall by construction (the threshold is never below it).
   Target 0.
3. **Pass cost.** One health pass over ``--pass-runs`` running runs (ms per run), and one assessment of
   the hung 16,384-rank run (its wavefront computed in SQL, ``store.health.wave_summary``).
   ``bench/health_scale.py`` measures the same at 262,144 ranks, and failure detection beside it.

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetscope.client import Client  # noqa: E402

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))
    print(f"  {name}: {value:.4g} {unit}", file=sys.stderr)


class Slack:
    """A local Slack stand-in recording (arrival time, body) of each POST."""

    def __init__(self) -> None:
        self.got: list[tuple[float, Any]] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rec.got.append((time.time(), json.loads(body or b"null")))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/slack"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(url: str, slack: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_COMPACT_GRACE_S": "2",
           "FLEETSCOPE_ALERTS_ENABLED": "false", "FLEETSCOPE_SLACK_WEBHOOK_URL": slack,
           "FLEETSCOPE_HEALTH_INTERVAL_S": str(args.interval_s), "FLEETSCOPE_STALL_MIN_S": str(args.stall_min_s),
           "FLEETSCOPE_PUBLIC_URL": "https://fleet.example"}
    p = subprocess.Popen([sys.executable, "-m", "fleetscope", "serve", "--database-url", url, "--port", str(port),
                          "--insecure-no-auth"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    Client(base).wait_ready(120)
    return p, base


def latency(base: str, url: str, slack: Slack, ranks: int, args: argparse.Namespace) -> None:
    from sqlalchemy import create_engine, text

    from fleetscope.simulate import run_simulation

    name = f"hang-{ranks}"
    stuck = ranks // 2 + 3
    done = threading.Event()
    err: list[BaseException] = []

    def job() -> None:
        try:
            run_simulation(server=base, token=None, run=name, family="llm-70b", ranks=ranks, steps=8, seed=1,
                           step_ms=args.step_ms, hang=(stuck, 5), hold_s=args.hold_s, flush_timeout_s=600)
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)
        finally:
            done.set()

    t_call = time.time()
    threading.Thread(target=job, daemon=True).start()
    rid = None
    while rid is None and time.time() - t_call < 600:
        runs = httpx.get(f"{base}/api/v1/runs", params={"name": name}, timeout=30).json()["runs"]
        rid = runs[0]["id"] if runs else None
        time.sleep(0.2)
    assert rid is not None, "the simulated run never registered"
    n_slack = len(slack.got)
    t_hung = None
    h: dict[str, Any] = {}
    deadline = time.time() + args.hold_s
    while time.time() < deadline and not err:
        h = httpx.get(f"{base}/api/v1/runs/{rid}/health", timeout=60).json()
        if h["state"] == "hung":
            t_hung = time.time()
            break
        time.sleep(0.2)
    if err:
        raise err[0]
    assert t_hung is not None, f"not hung within {args.hold_s} s: {h}"
    while len(slack.got) == n_slack and time.time() < t_hung + 120:
        time.sleep(0.05)
    eng = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with eng.connect() as c:
        hang_start = float(c.execute(text("SELECT max(ts + step_s) FROM steps WHERE run_id = :r"), {"r": rid}).scalar())
        landed = c.execute(text("SELECT extract(epoch FROM progress_at) FROM run_health WHERE run_id = :r"),
                           {"r": rid}).scalar()
    eng.dispose()
    ok = h["missing_ranks"] == [stuck]
    print(f"{ranks} ranks: {h['finding']}", file=sys.stderr)
    figure(f"hang_{ranks}_named_right", float(ok), "bool")
    figure(f"hang_{ranks}_threshold_s", float(h["threshold_s"]), "s")
    figure(f"hang_{ranks}_last_step_seen_after_s", float(landed) - hang_start, "s")
    figure(f"hang_{ranks}_to_state_hung_s", t_hung - hang_start, "s")
    figure(f"hang_{ranks}_overhead_after_threshold_s", t_hung - hang_start - float(h["threshold_s"]), "s")
    if len(slack.got) > n_slack:
        t_slack, body = slack.got[n_slack]
        figure(f"hang_{ranks}_to_slack_s", t_slack - hang_start, "s")
        print(f"  slack: {body['text'][:300]}", file=sys.stderr)
    done.wait(args.hold_s + 60)


# ------------------------------------------------------------------------------------------ false alarms


class _Pause:
    def __init__(self, reason: str, since: float, expected: float) -> None:
        self.rank, self.reason, self.open_since, self.expected_s = 0, reason, since, expected


def false_alarms(run_hours: float, interval_s: float, seed: int = 7) -> None:
    """The state machine on simulated normal runs (see the module doc)."""
    from fleetscope.server.analysis.health import HealthParams, evaluate

    p = HealthParams()  # the defaults a server runs with
    rng = np.random.default_rng(seed)
    hours = 0.0
    false, evaluations, runs, pauses_n = 0, 0, 0, 0
    t_start = time.perf_counter()
    while hours < run_hours:
        runs += 1
        dur = float(rng.uniform(5, 20)) * 3600
        step = float(rng.uniform(0.5, 10.0))
        t = float(rng.uniform(60, 480))  # the first step after registration (init)
        # a timeline of (arrival time of a step's record, pause begin, pause end)
        ckpt_next = t + rng.uniform(1200, 3600)
        eval_next = t + rng.uniform(3600, 10800)
        recent: list[float] = []
        progress = 0.0  # registration: the first step's minimum applies
        n_steps = 0
        last_end: float | None = None  # when the last declared pause ended
        while t < dur:
            # an ordinary step (jitter, rare slow ones), its record arriving 0-10 s later
            s = step * rng.lognormal(0, 0.05) * (3.0 if rng.random() < 1e-3 else 1.0)
            arrival = t + s + rng.uniform(0, 10)
            gap_events: list[tuple[float, float, _Pause | None]] = []
            t += s
            pause: _Pause | None = None
            if t >= ckpt_next or t >= eval_next:
                is_ckpt = t >= ckpt_next
                expected = float(rng.uniform(30, 900)) if is_ckpt else float(rng.uniform(120, 1200))
                actual = expected * (1.5 if rng.random() < 0.25 else rng.uniform(0.7, 1.0))
                pause = _Pause("checkpoint_save" if is_ckpt else "eval", t, expected)
                gap_events.append((t, t + actual, pause))
                pauses_n += 1
                t += actual
                if is_ckpt:
                    ckpt_next = t + rng.uniform(1200, 3600)
                else:
                    eval_next = t + rng.uniform(3600, 10800)
            # evaluate every interval wherever the run has gone stall_min_s without progress
            prev = progress
            next_arrival = max(arrival, t + rng.uniform(0, 10)) if pause else arrival
            if next_arrival - max(prev, last_end or 0.0) >= p.stall_min_s:
                p99 = float(np.percentile(recent[-1000:], 99)) if recent else None
                tick = prev + p.stall_min_s
                while tick < next_arrival:
                    open_ = [q for b, e, q in gap_events if q is not None and b <= tick < e]
                    ended = [e for b, e, q in gap_events if e <= tick]
                    le = max([*ended, last_end or 0.0]) or None
                    v = evaluate(name="r", status="running", world_size=8, steps=n_steps, current_step=n_steps - 1,
                                 now=tick, progress_at=prev, p99_step_s=p99, failures=[], n_failed_ranks=0,
                                 finished_at=None, pauses=open_, positions=[], nodes={}, params=p, last_pause_end=le)
                    evaluations += 1
                    if v.state != "running":
                        false += 1
                        break
                    tick += interval_s
            for _b, e, _q in gap_events:
                last_end = e + rng.uniform(0, 10)  # the pause's end arrives with the agent's next flush
            progress = next_arrival
            recent.append(s)
            n_steps += 1
        hours += dur / 3600
    figure("false_hang_runs_simulated", float(runs), "runs")
    figure("false_hang_run_hours", hours, "h")
    figure("false_hang_pauses_declared", float(pauses_n), "pauses")
    figure("false_hang_evaluations", float(evaluations), "passes")
    figure("false_hang_alerts_per_1000_run_hours", false * 1000.0 / hours, "alerts")
    figure("false_hang_sim_seconds", time.perf_counter() - t_start, "s")


# ------------------------------------------------------------------------------------------ pass cost


def pass_cost(base: str, url: str, n_runs: int, hung_name: str) -> None:
    from fleetscope.server.analysis.health import HealthParams
    from fleetscope.server.db import make_engine
    from fleetscope.server.health_pass import HealthWorker, assess
    from fleetscope.server.store import health as store

    c = Client(base)
    t0 = time.time() - 30
    for i in range(n_runs):
        rid = c.register_run({"name": f"busy-{i}", "world_size": 8})
        cols: dict[str, list[Any]] = {"rank": [], "step": [], "step_s": [], "ts": []}
        for s in range(3):
            for r in range(8):
                cols["rank"].append(r)
                cols["step"].append(s)
                cols["step_s"].append(1.0)
                cols["ts"].append(t0 + s)
        c.ingest({"v": 1, "run_id": rid, "rank_steps": cols})
    eng = make_engine(url, pool_size=2)
    try:
        w = HealthWorker(eng, HealthParams(stall_min_s=3600.0, stall_first_s=3600.0), interval_s=3600)
        w.run_once()  # first pass writes every health row
        times = []
        for _ in range(5):
            t = time.perf_counter()
            w.run_once()
            times.append(time.perf_counter() - t)
        per = float(np.median(times)) / max(w.last_runs, 1)
        figure("health_pass_runs", float(w.last_runs), "runs")
        figure("health_pass_ms_per_running_run", per * 1e3, "ms")
        rid = int(httpx.get(f"{base}/api/v1/runs", params={"name": hung_name}).json()["runs"][0]["id"])
        (rp,) = store.progress(eng, [rid], active_only=False)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            a = assess(eng, rp, HealthParams(stall_min_s=1.0, silence_s=1e9), full=True)
            ts.append(time.perf_counter() - t)
        figure("health_assess_hung_16384_rank_run_ms", float(np.median(ts)) * 1e3, "ms")
        figure("health_assess_hung_16384_named_right", float(a.verdict.missing_ranks == [16384 // 2 + 3]), "bool")
    finally:
        eng.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024,16384")
    ap.add_argument("--step-ms", type=float, default=1000.0)
    ap.add_argument("--stall-min-s", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--hold-s", type=float, default=90.0, help="how long the hung job keeps reporting positions")
    ap.add_argument("--run-hours", type=float, default=1000.0)
    ap.add_argument("--pass-runs", type=int, default=200)
    ap.add_argument("--skip-server", action="store_true", help="only the false-alarm simulation")
    args = ap.parse_args()
    figure("health_pass_interval_s", args.interval_s, "s")
    figure("server_stall_min_s", args.stall_min_s, "s")
    false_alarms(args.run_hours, args.interval_s)
    if not args.skip_server:
        from fleetscope.server.db import EmbeddedPostgres, upgrade

        pg_dir = tempfile.mkdtemp(prefix="fsh-", dir="/tmp")
        atexit.register(shutil.rmtree, pg_dir, True)
        pg = EmbeddedPostgres(pg_dir)
        pg.start()
        url = pg._server.get_uri("postgres")
        upgrade(url)
        slack = Slack()
        proc, base = start_server(url, slack.url, args)
        try:
            sizes = [int(x) for x in args.ranks.split(",") if x]
            for n in sizes:
                latency(base, url, slack, n, args)
            if 16384 in sizes:
                pass_cost(base, url, args.pass_runs, "hang-16384")
        finally:
            proc.terminate()
            proc.wait(30)
            slack.close()
            pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
