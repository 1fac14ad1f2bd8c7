"""Alert quality of the whole lifecycle (#30 item 4): false pages per 1,000 simulated run-hours, and the time
from each alert transition to its delivery at every sink with one sink (Slack) down.

    python bench/alert_quality.py [--run-hours 1000] [--sec-per-hour 4] [--concurrency 25]
                                  [--restart-every 30] [--seed 7]

A real server (``server.app.create_app`` under uvicorn on a fixed loopback port, embedded Postgres) with
local receivers for Slack, the generic webhook and Alertmanager's ``/api/v2/alerts``. **Slack answers 500
for the whole fleet**; the webhook and Alertmanager are up. Settings: the health pass every 0.5 s, a run
stalls after 20 s without a step (``stall_min_s``; steps every 0.5 s, batches every second), compaction
every 0.2 s; the notifier scans its table every 2 s and re-posts firing alerts to Alertmanager every 5 s;
retries and backoff at their defaults.

**The fleet.** Jobs are drawn until their simulated durations add up to ``--run-hours``: 4-16 h each,
replayed at ``--sec-per-hour`` real seconds per simulated hour, ``--concurrency`` at a time, each with
its own family and a 5 % lognormal step-time jitter. Per job, as a fleet has them: a declared checkpoint
pause (3-8 s); with probability 0.25 a failure (a rank raises) followed by a torchrun restart — attempt 1
of the same job registers 3-20 s later and runs to the end; with probability 0.1 a true hang (no step
for 45 s, then it resumes); the job finishes, and half of the jobs then get a trace attached the way
``fleetscope import-trace --run NAME`` does (join the run by name, post the traces). A person, every 2 s,
takes the alerts firing for more than 3 s: acknowledges 40 % (and resolves 60 % of those 3 s later) and
resolves 20 % at once, by hand. The server is stopped and started again (same database and port) every
``--restart-every`` seconds.

**Pages** are the "fired" / "reopened" messages delivered: at the webhook, and an alert's first post to
Alertmanager (its re-posts are not pages). A **false page** is a page for anything but an injected
incident (one hang alert per injected hang, one failure alert per injected failure), a second alert for
one incident, or the same page delivered twice to one sink. A **false resolution** is an Alertmanager post
with ``endsAt`` ≤ its arrival for an alert not resolved by then; an **expiry** is a moment, between an
alert's first post and its resolution, that no post's ``endsAt`` covers (Alertmanager would announce it
resolved: what a restart did when the set to re-send lived in memory). Also counted: injected incidents never
paged, failure alerts still open after the job's next attempt ran.

**Delivery time**: from the transition's time in the alerts table (``created_at``, ``acknowledged_at``,
``resolved_at``) to its first arrival at the webhook and at Alertmanager. At the end Slack comes back
(200): the time until every transition it missed has reached it, each once.

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shutil
import socket
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

FIGURES: list[tuple[str, float, str]] = []


def figure(name: str, value: float, unit: str) -> None:
    FIGURES.append((name, value, unit))
    print(f"  {name}: {value:.4g} {unit}", file=sys.stderr)


class Sink:
    """A loopback receiver recording (arrival, path, body, status answered)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.records: list[tuple[float, str, Any, int]] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                st = rec.status
                rec.records.append((time.time(), self.path, json.loads(raw or b"null"), st))
                self.send_response(st)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def ok(self) -> list[tuple[float, str, Any]]:
        return [(t, p, b) for t, p, b, st in self.records if 200 <= st < 300]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Server:
    """The app under uvicorn in a thread on a fixed port; stop() and start() again on the same database."""

    def __init__(self, url: str, port: int, sinks: dict[str, Sink]) -> None:
        from fleetscope.server.settings import Settings

        self.url = f"http://127.0.0.1:{port}"
        self.settings = Settings(
            database_url=url, port=port, compact_interval_s=0.2, compact_grace_s=1.0, health_interval_s=0.5,
            stall_min_s=20.0, stall_factor=10.0, stall_first_s=20.0, alert_interval_s=1.0,
            slack_webhook_url=sinks["slack"].base + "/services/T0/B0/x", alert_webhook_url=sinks["webhook"].base + "/hook",
            alertmanager_url=sinks["alertmanager"].base, public_url="https://fleet.example")
        self.srv: Any = None
        self.thread: threading.Thread | None = None
        self.restarts = 0
        self.down_s = 0.0

    def start(self) -> None:
        import uvicorn
        from fleetscope.server.app import create_app
        from fleetscope.server.serve import uvicorn_config

        app = create_app(self.settings)
        self.srv = uvicorn.Server(uvicorn_config(app, self.settings, host="127.0.0.1", log_level="warning",
                                                 timeout_graceful_shutdown=5))
        self.srv.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.srv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        n = app.state.fs.notifier
        n.scan_s, n.alertmanager_resend_s = 2.0, 5.0
        n.wake()
        self.app = app

    def stop(self) -> None:
        self.srv.should_exit = True
        assert self.thread is not None
        self.thread.join(60)

    def restart(self) -> None:
        t = time.monotonic()
        self.stop()
        self.start()
        self.restarts += 1
        self.down_s = max(self.down_s, time.monotonic() - t)


def _retry(fn: Any, *, timeout: float = 120.0) -> Any:
    """Call ``fn`` until it succeeds (the server may be restarting), at most ``timeout`` seconds."""
    from fleetscope.client import ApiError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (httpx.TransportError, ApiError) as e:
            if isinstance(e, ApiError) and e.status is not None and e.status < 500 and e.status != 429:
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


class Job:
    """One job of the fleet, replayed in real time (see the module doc)."""

    def __init__(self, i: int, rng: random.Random, sec_per_hour: float) -> None:
        self.name = f"job-{i:04d}"
        self.family = f"fam-{i % 7}"
        self.hours = rng.uniform(4, 16)
        self.real_s = self.hours * sec_per_hour
        self.fail_at = rng.uniform(0.2, 0.7) if rng.random() < 0.25 else None
        self.hang_at = rng.uniform(0.2, 0.8) if rng.random() < 0.10 else None
        self.pause_at = rng.uniform(0.1, 0.9)
        self.pause_s = rng.uniform(3, 8)
        self.trace = rng.random() < 0.5
        self.restart_s = rng.uniform(3, 20)  # rendezvous of the restarted job
        self.seed = rng.randrange(1 << 30)
        self.run_ids: list[int] = []
        self.failed_run: int | None = None
        self.hung_run: int | None = None
        self.error: str | None = None
        self.log: list[tuple[float, str]] = []  # (unix time, what happened): printed for a false page

    def note(self, what: str) -> None:
        self.log.append((time.time(), what))


def _batch(run_id: int, steps: range, step_s: list[float], ts: float) -> dict[str, Any]:
    cols: dict[str, list[Any]] = {"rank": [], "step": [], "step_s": [], "ts": [], "data_s": []}
    for k, s in enumerate(steps):
        for r in range(2):
            cols["rank"].append(r)
            cols["step"].append(s)
            cols["step_s"].append(step_s[k])
            cols["ts"].append(ts - (len(steps) - k) * 0.5)
            cols["data_s"].append(0.01)
    return {"v": 1, "run_id": run_id, "rank_steps": cols}


_SEQ = iter(range(1, 1 << 40))


def _event(rank: int, kind: str, data: dict[str, Any], step: int) -> dict[str, Any]:
    return {"rank": rank, "seq": next(_SEQ), "kind": kind, "ts": time.time(), "step": step, "data": data}


def play(job: Job, url: str, token: str) -> None:
    """Register, run (steps every 0.5 s, sent each second), pause, fail and restart, hang, finish, attach."""
    from fleetscope.client import Client

    rng = np.random.default_rng(job.seed)
    c = Client(url, token)
    try:
        reg = {"name": job.name, "world_size": 2, "model_family": job.family, "job_id": f"jid-{job.name}",
               "config": {"recipe": job.family}}
        attempt, step = 0, 0
        rid = _retry(lambda: c.register_run({**reg, "attempt": 0, "started_at": time.time()}))
        job.run_ids.append(rid)
        job.note(f"registered attempt 0: run {rid}")
        t_start = time.monotonic()
        paused = hung = failed = False
        while True:
            frac = (time.monotonic() - t_start) / job.real_s
            if frac >= 1.0:
                break
            if job.fail_at is not None and not failed and frac >= job.fail_at:
                failed = True
                ev = _event(1, "failure", {"source": "exception", "exception": "RuntimeError", "message": "boom",
                                           "frames": [], "phase": "forward", "rank": 1, "exit_code": 1}, step)
                _retry(lambda doc={"v": 1, "run_id": rid, "events": [ev]}: c.ingest(doc))
                job.failed_run = rid
                job.note(f"run {rid} failed")
                time.sleep(job.restart_s)  # torchrun restarts the job: the next attempt resumes from a checkpoint
                t_start += job.restart_s
                attempt += 1
                step = max(0, step - 4)
                rid = _retry(lambda a=attempt: c.register_run({**reg, "attempt": a, "started_at": time.time()}))
                job.run_ids.append(rid)
                job.note(f"registered attempt {attempt}: run {rid}")
                continue
            if job.hang_at is not None and not hung and frac >= job.hang_at:
                hung = True
                job.hung_run = rid
                job.note(f"run {rid} hangs")
                time.sleep(45.0)  # a true hang: no step for 45 s (the threshold is 20 s), then it resumes
                t_start += 45.0
                job.note(f"run {rid} resumes")
            if not paused and frac >= job.pause_at:
                paused = True
                begin = [_event(r, "pause", {"reason": "checkpoint_save", "state": "begin", "expected_s": 5.0}, step)
                         for r in range(2)]
                _retry(lambda doc={"v": 1, "run_id": rid, "events": begin}: c.ingest(doc))
                time.sleep(job.pause_s)
                t_start += job.pause_s
                end = [_event(r, "pause", {"reason": "checkpoint_save", "state": "end", "duration_s": job.pause_s},
                              step) for r in range(2)]
                _retry(lambda doc={"v": 1, "run_id": rid, "events": end}: c.ingest(doc))
            times = [float(0.5 * np.exp(rng.normal(0, 0.05))) for _ in range(2)]
            b = _batch(rid, range(step, step + 2), times, time.time())
            _retry(lambda doc=b: c.ingest(doc))
            step += 2
            time.sleep(1.0)
        _retry(lambda: c.finish_run(rid, "finished"))
        job.note(f"run {rid} finished")
        if job.trace:  # `fleetscope import-trace traces/ --run NAME`: join the run by name, attach
            time.sleep(random.uniform(1, 5))
            body = {"ranks": {"0": {"source": "rank0.pt.trace.json", "kernel_time_us": 1.0}}, "source": "traces/"}

            def attach() -> None:
                found = [r for r in c.run_list(name=job.name) if r.get("name") == job.name]
                tid = c.register_run({"name": job.name, "world_size": 2, "meta": {} if found else {"x": 1},
                                      "attempt": attempt, "job_id": f"jid-{job.name}"})
                r = httpx.post(f"{url}/api/v1/runs/{tid}/traces", json=body,
                               headers={"Authorization": f"Bearer {token}"}, timeout=30)
                r.raise_for_status()

            _retry(attach)
            job.note("trace attached")
    except Exception as e:  # noqa: BLE001 - recorded, the fleet goes on
        job.error = f"{type(e).__name__}: {e}"
    finally:
        c.close()


def pager(url: str, token: str, stop: threading.Event, rng: random.Random, seen: dict[int, float],
          acted: dict[int, list[str]]) -> None:
    """A person: of the alerts firing for more than 3 s, acknowledges 40 % (and resolves 60 % of those 3 s
    later) and resolves 20 % at once."""
    hdr = {"Authorization": f"Bearer {token}"}
    while not stop.wait(2.0):
        try:
            alerts = httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["alerts"]
        except Exception:  # noqa: BLE001 - restarting
            continue
        now = time.monotonic()
        for a in alerts:
            first = seen.setdefault(a["id"], now)
            done = acted.setdefault(a["id"], [])
            try:
                if a["state"] == "firing" and now - first > 3 and "considered" not in done:
                    done.append("considered")
                    x = rng.random()
                    if x < 0.4:
                        httpx.post(f"{url}/api/v1/alerts/{a['id']}/ack", headers=hdr, timeout=10).raise_for_status()
                        done.append("ack")
                        seen[a["id"]] = now
                    elif x < 0.6:
                        httpx.post(f"{url}/api/v1/alerts/{a['id']}/resolve", headers=hdr, timeout=10).raise_for_status()
                        done.append("resolve")
                elif a["state"] == "acknowledged" and "ack" in done and now - first > 3 and "resolve?" not in done:
                    done.append("resolve?")
                    if rng.random() < 0.6:
                        httpx.post(f"{url}/api/v1/alerts/{a['id']}/resolve", headers=hdr, timeout=10).raise_for_status()
                        done.append("resolve")
            except Exception:  # noqa: BLE001 - restarting: try again on the next round
                done.remove(done[-1])


def _ts(v: str | None) -> float | None:
    return None if v is None else dt.datetime.fromisoformat(v).timestamp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-hours", type=float, default=1000.0)
    ap.add_argument("--sec-per-hour", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=25)
    ap.add_argument("--restart-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    from fleetscope.server.auth import create_token
    from fleetscope.server.db import EmbeddedPostgres, make_engine, upgrade

    tmp = Path(tempfile.mkdtemp(prefix="fsaq-", dir="/tmp"))
    pg = EmbeddedPostgres(tmp)
    db = pg.start()
    sinks = {"slack": Sink(status=500), "webhook": Sink(), "alertmanager": Sink()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    upgrade(db)
    eng = make_engine(db, pool_size=2)
    token = create_token(eng, "bench", scope="admin")
    server = Server(db, port, sinks)
    server.start()
    t0 = time.time()
    restarts_log: list[tuple[float, str]] = []
    try:
        rng = random.Random(args.seed)
        jobs: list[Job] = []
        while sum(j.hours for j in jobs) < args.run_hours:
            jobs.append(Job(len(jobs), rng, args.sec_per_hour))
        print(f"{len(jobs)} jobs, {sum(j.hours for j in jobs):.0f} simulated run-hours, "
              f"{sum(j.fail_at is not None for j in jobs)} failures + restarts, {sum(j.hang_at is not None for j in jobs)} "
              f"hangs, {sum(j.trace for j in jobs)} trace imports", file=sys.stderr)
        stop = threading.Event()
        seen: dict[int, float] = {}
        acted: dict[int, list[str]] = {}
        person = threading.Thread(target=pager, args=(server.url, token, stop, random.Random(args.seed + 1), seen, acted),
                                  daemon=True)
        person.start()

        def restarter() -> None:
            while not stop.wait(args.restart_every):
                t = time.time()
                server.restart()
                restarts_log.append((t, f"server stopped ({time.time() - t:.1f} s down)"))
                print(f"  server restarted ({server.restarts})", file=sys.stderr)

        rs = threading.Thread(target=restarter, daemon=True)
        rs.start()
        sem = threading.Semaphore(args.concurrency)
        threads = []
        for j in jobs:
            sem.acquire()

            def one(job: Job = j) -> None:
                try:
                    play(job, server.url, token)
                finally:
                    sem.release()

            t = threading.Thread(target=one, daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        fleet_s = time.time() - t0
        stop.set()
        rs.join(120)
        person.join(30)
        time.sleep(30)  # deliveries settle (re-sends, retries after the last restart)

        alerts = {a["id"]: a for a in httpx.get(f"{server.url}/api/v1/alerts", params={"limit": 10000},
                                                timeout=30).json()["alerts"]}
        hook = sinks["webhook"].ok()
        am = sinks["alertmanager"].ok()

        # Slack comes back: how long until every transition it missed has reached it
        back = time.time()
        sinks["slack"].status = 200

        def expected_slack() -> int:
            n = 0
            for a in alerts.values():
                n += 1 + (a.get("acknowledged_at") is not None) + (a["state"] == "resolved")
            return n

        want = expected_slack()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(sinks["slack"].ok()) < want:
            time.sleep(0.5)
        slack_drain = (sinks["slack"].ok()[-1][0] - back) if sinks["slack"].ok() else float("nan")
        time.sleep(3)
        slack_ok = sinks["slack"].ok()
    finally:
        try:
            server.stop()
        finally:
            for s in sinks.values():
                s.close()
            eng.dispose()
            pg.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    # ---------------------------------------------------------------------------------------------- scoring
    injected = {}
    for j in jobs:
        if j.failed_run is not None:
            injected[(j.failed_run, "failure")] = j
        if j.hung_run is not None:
            injected[(j.hung_run, "hang")] = j
    by_incident: dict[tuple[int, str], list[int]] = {}
    for a in alerts.values():
        kind = "hang" if a["kind"] in ("hang", "node_lost") else a["kind"]
        by_incident.setdefault((a["run_id"], kind), []).append(a["id"])

    hook_fired: dict[int, list[float]] = {}
    hook_ev: dict[tuple[int, str], list[float]] = {}
    for t, _p, b in hook:
        aid = b["alert"]["id"]
        hook_ev.setdefault((aid, b["event"]), []).append(t)
        if b["event"] in ("fired", "reopened"):
            hook_fired.setdefault(aid, []).append(t)
    am_first: dict[int, float] = {}
    am_end: dict[int, list[float]] = {}
    am_until: dict[int, list[tuple[float, float]]] = {}  # active posts: (arrival, endsAt)
    for t, _p, body in am:
        for x in body:
            aid = int(x["labels"]["alert_id"])
            am_first.setdefault(aid, t)
            ends = dt.datetime.fromisoformat(x["endsAt"]).timestamp() if "endsAt" in x else t + 300.0
            if ends <= t:
                am_end.setdefault(aid, []).append(t)
            else:
                am_until.setdefault(aid, []).append((t, ends))
    # Alertmanager ends an active alert by itself at its last endsAt (no endsAt: resolve_timeout, 5 min):
    # any moment between its first post and its resolution (or the end) not covered is an expiry
    end_obs = max(t for t, _p, _b in am) if am else 0.0
    expired = 0
    for aid, posts in am_until.items():
        stop_at = _ts(alerts[aid].get("resolved_at")) if alerts[aid]["state"] == "resolved" else end_obs
        covered = posts[0][0]
        for t, ends in sorted(posts):
            if t > covered + 0.5:
                break
            covered = max(covered, ends)
        expired += int(stop_at is not None and covered + 0.5 < stop_at)

    false_pages = 0
    why: list[str] = []
    for key, ids in by_incident.items():
        if key not in injected:
            false_pages += len([i for i in ids if i in hook_fired or i in am_first])
            why += [f"alert {i} ({alerts[i]['kind']}, run {key[0]}): not an injected incident" for i in ids]
        elif len(ids) > 1:
            false_pages += len(ids) - 1
            why.append(f"incident {key}: {len(ids)} alerts")
    dup = sum(len(ts) - 1 for ts in hook_fired.values() if len(ts) > 1)
    false_pages += dup
    if dup:
        why.append(f"{dup} duplicate webhook pages")
    slack_pages: dict[int, int] = {}
    for _t, _p, b in slack_ok:
        ctx = b["blocks"][-1]["elements"][0]["text"]
        aid = int(ctx.split("#", 1)[1].split(" ", 1)[0])
        head = b["blocks"][0]["text"]["text"]
        if not head.startswith(("Resolved", "Acknowledged")):
            slack_pages[aid] = slack_pages.get(aid, 0) + 1
    slack_dup = sum(n - 1 for n in slack_pages.values() if n > 1)
    false_pages += slack_dup
    missed = [k for k in injected if k not in by_incident or not any(i in hook_fired for i in by_incident[k])]
    false_res = 0
    for aid, ts in am_end.items():
        r = _ts(alerts[aid].get("resolved_at"))
        false_res += sum(1 for t in ts if r is None or r > t + 1.0)
    late_failures = [ids for (rid, kind), ids in by_incident.items() if kind == "failure"
                     if any(alerts[i]["state"] != "resolved" for i in ids)]
    am_dup_res = sum(len(ts) - 1 for ts in am_end.values() if len(ts) > 1)

    lat: dict[str, list[float]] = {}
    for a in alerts.values():
        aid = a["id"]
        for event, at in (("fired", a["created_at"]), ("acknowledged", a.get("acknowledged_at")),
                          ("resolved", a.get("resolved_at"))):
            t = _ts(at)
            if t is None:
                continue
            got = hook_ev.get((aid, event))
            if got:
                lat.setdefault(f"webhook {event}", []).append(min(got) - t)
        if aid in am_first:
            lat.setdefault("alertmanager fired", []).append(am_first[aid] - _ts(a["created_at"]))
        if a["state"] == "resolved" and aid in am_end:
            lat.setdefault("alertmanager resolved", []).append(min(am_end[aid]) - _ts(a["resolved_at"]))
    undelivered_res = sum(1 for a in alerts.values() if a["state"] == "resolved"
                          and ((a["id"], "resolved") not in hook_ev or a["id"] not in am_end))

    hours = sum(j.hours for j in jobs)
    print(f"\nfleet: {len(jobs)} jobs, {hours:.0f} simulated run-hours in {fleet_s:.0f} s; {server.restarts} server "
          f"restarts (longest {server.down_s:.1f} s); {len(alerts)} alerts; job errors: "
          f"{sum(j.error is not None for j in jobs)}", file=sys.stderr)
    for w in why[:20]:
        print(f"  false page: {w}", file=sys.stderr)
    job_of = {rid: j for j in jobs for rid in j.run_ids}
    suspect = [i for ids in by_incident.values() for i in ids
               if (alerts[i]["run_id"], "hang" if alerts[i]["kind"] in ("hang", "node_lost") else alerts[i]["kind"])
               not in injected] + [i for ids in late_failures for i in ids]
    for i in suspect[:10]:
        a = alerts[i]
        j = job_of.get(a["run_id"])
        print(f"  alert {i} {a['kind']} {a['state']} run {a['run_id']} created {_ts(a['created_at']):.1f} "
              f"resolved {a.get('resolved_at')} finding {(a.get('details') or {}).get('finding')!r} "
              f"resolution {(a.get('details') or {}).get('resolution')}", file=sys.stderr)
        for t, what in (j.log if j else []):
            print(f"      {t:.1f} {what}", file=sys.stderr)
        for t, what in restarts_log:
            if j and j.log and j.log[0][0] - 5 <= t <= j.log[-1][0] + 5:
                print(f"      {t:.1f} {what}", file=sys.stderr)
    for j in jobs:
        if j.error:
            print(f"  {j.name}: {j.error}", file=sys.stderr)
    figure("simulated_run_hours", hours, "h")
    figure("server_restarts", server.restarts, "")
    figure("injected_incidents", len(injected), "")
    figure("alerts_raised", len(alerts), "")
    by = [((a.get("details") or {}).get("resolution") or {}) for a in alerts.values() if a["state"] == "resolved"]
    figure("acknowledged_by_hand", sum(a.get("acknowledged_at") is not None for a in alerts.values()), "")
    figure("resolved_by_hand", sum(r.get("by") == "hand" for r in by), "")
    figure("resolved_by_recovery", sum(r.get("by") == "recovery" for r in by), "")
    figure("failures_resolved_by_next_attempt", sum(r.get("attempt") is not None for r in by), "")
    figure("false_pages", false_pages, "")
    figure("false_pages_per_1000_run_hours", 1000.0 * false_pages / hours, "")
    figure("false_resolutions_alertmanager", false_res, "")
    figure("alertmanager_expiries_while_firing", expired, "")
    figure("duplicate_resolutions_alertmanager", am_dup_res, "")
    figure("missed_incidents", len(missed), "")
    figure("failure_alerts_open_after_restart", len(late_failures), "")
    figure("resolutions_not_delivered_to_live_sinks", undelivered_res, "")
    for k in sorted(lat):
        v = np.array(lat[k])
        figure(f"latency_{k.replace(' ', '_')}_p50", float(np.median(v)), "s")
        figure(f"latency_{k.replace(' ', '_')}_max", float(v.max()), "s")
    figure("slack_down_attempts", sum(1 for r in sinks["slack"].records if r[3] != 200), "")
    figure("slack_back_messages", len(slack_ok), "")
    figure("slack_back_expected", want, "")
    figure("slack_back_duplicate_pages", slack_dup, "")
    figure("slack_back_drain", slack_drain, "s")
    print()
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.6g} {unit}".rstrip())


if __name__ == "__main__":
    main()
