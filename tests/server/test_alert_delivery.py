"""Alert delivery driven by the alerts table (``alert_deliveries``), over real servers on loopback and real
Postgres, with local receivers standing in for Slack, the webhook and Alertmanager's ``/api/v2/alerts``:

- acknowledging and resolving by hand reach every sink once (Alertmanager: the resolution once, endsAt ≤ now);
- a restart (stop, start on the same database) re-posts firing alerts with endsAt ahead, never as resolved;
- two servers on one database deliver each transition once;
- a dead Slack never delays Alertmanager (one queue and worker per sink), counted on /metrics;
- a trace attached to a finished run neither reopens it nor raises a hang;
- a later attempt of a job that runs resolves the failure alert of the attempt that failed;
- a regression of a family's setup switch is not resolved by a run of another setup; messages are worded
  per kind (stalled, hung, straggler, regression …).

The notifier's intervals are shortened on the live servers (``_fast``); every wait is bounded."""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from fleetscope.server.store import alerts as alert_store
from health_util import FAST, event, state_is, steps_batch, wait_for


class Sink:
    """A loopback HTTP receiver recording (arrival time, path, JSON body); ``status`` is what it answers."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.records: list[tuple[float, str, Any]] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rec.records.append((time.time(), self.path, json.loads(raw or b"null")))
                self.send_response(rec.status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = self.base + "/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def bodies(self) -> list[Any]:
        return [b for _, _, b in self.records]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sinks() -> Iterator[dict[str, Sink]]:
    s = {"slack": Sink(), "webhook": Sink(), "alertmanager": Sink()}
    yield s
    for r in s.values():
        r.close()


def _start(db_url: str, sinks: dict[str, Sink], **settings: Any) -> Any:
    from conftest import start_server

    # a run registered without steps (the tests' stand-ins) is not stalled for 10 min
    srv = start_server(db_url, slack_webhook_url=sinks["slack"].url, alert_webhook_url=sinks["webhook"].url,
                       alertmanager_url=sinks["alertmanager"].base, **{**FAST, "stall_first_s": 600.0, **settings})
    _fast(srv)
    return srv


def _fast(srv: Any, **kw: Any) -> None:
    """Short notifier intervals on a live server (scan, re-send, retry), applied at once."""
    n = srv.state.notifier
    params = {"scan_s": 0.2, "alertmanager_resend_s": 0.5, "backoff_s": 0.05, "redeliver_s": 0.5,
              "redeliver_max_s": 1.0, **kw}
    for k, v in params.items():
        setattr(n, k, v)
    n.wake()


def _raise(srv: Any, run_id: int, name: str, kind: str = "hang", state: str = "hung",
           notify: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Raise a run-health alert the way the health pass does (reconcile, then hand the event to the
    notifier); returns it. Its series is not ``health:<run>``, which the live health pass reconciles."""
    series = f"test-health:{run_id}"
    details = {"series": series, "unit": "s", "state": state, "run_name": name,
               "finding": f"run {name} {state} at step 3: rank 1 never arrived"}
    w = alert_store.AlertWrite(key=(kind, series, "run_state"), dedup_key=f"{kind}:{series}:1",
                               run_id=run_id, before=60.0, after=90.0, change=0.5, significance=None,
                               first_bad_json=json.dumps({"step": 3}), details_json=json.dumps(details),
                               url=f"https://fleet.example/runs/{run_id}")
    (ev, alert), = alert_store.reconcile(srv.state.engine, [w], [series])
    for s in notify or (srv,):
        s.state.notifier.notify(alert, ev)
    return alert


def _run(srv: Any, name: str, **extra: Any) -> int:
    with srv.client() as c:
        return c.register_run({"name": name, "world_size": 2, **extra})


def _am(sink: Sink, alert_id: int) -> list[tuple[float, dict[str, Any]]]:
    """(arrival, alert) of every Alertmanager post naming ``alert_id``."""
    return [(t, a) for t, path, body in sink.records if path == "/api/v2/alerts" for a in body
            if a["labels"].get("alert_id") == str(alert_id)]


def _ended(t: float, a: dict[str, Any]) -> bool:
    """Posted as resolved: endsAt at or before the post arrived."""
    return "endsAt" in a and dt.datetime.fromisoformat(a["endsAt"]).timestamp() <= t


def _events(hook: Sink, alert_id: int) -> list[str]:
    return [b["event"] for b in hook.bodies if b["alert"]["id"] == alert_id]


def _slack(slack: Sink, alert_id: int) -> list[str]:
    """The headers of the Slack messages about ``alert_id``."""
    return [b["blocks"][0]["text"]["text"] for b in slack.bodies if f"alert #{alert_id} " in str(b["blocks"][-1])]


def _admin(srv: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {srv.token}"}


def test_ack_and_resolve_by_hand_reach_every_sink_once(db_url: str, sinks: dict[str, Sink]) -> None:
    slack, hook, am = sinks["slack"], sinks["webhook"], sinks["alertmanager"]
    srv = _start(db_url, sinks)
    try:
        rid = _run(srv, "by-hand")
        a = _raise(srv, rid, "by-hand")
        wait_for(lambda: _slack(slack, a["id"]) and _events(hook, a["id"]) and _am(am, a["id"]), timeout=20)
        assert _slack(slack, a["id"]) == ["Run hung · fleetscope"] and _events(hook, a["id"]) == ["fired"]
        t, first = _am(am, a["id"])[0]
        assert {k: first["labels"][k] for k in ("alert_id", "kind", "run")} == {
            "alert_id": str(a["id"]), "kind": "hang", "run": "by-hand"}
        assert not _ended(t, first) and dt.datetime.fromisoformat(first["endsAt"]).timestamp() > t

        r = httpx.post(f"{srv.url}/api/v1/alerts/{a['id']}/ack", headers=_admin(srv))
        assert r.status_code == 200 and r.json()["state"] == "acknowledged"
        wait_for(lambda: len(_events(hook, a["id"])) == 2 and len(_slack(slack, a["id"])) == 2, timeout=20)
        assert _events(hook, a["id"]) == ["fired", "acknowledged"]
        assert _slack(slack, a["id"])[1] == "Acknowledged · fleetscope"
        wait_for(lambda: any("acknowledged_at" in x["annotations"] for _, x in _am(am, a["id"])), timeout=20)

        r = httpx.post(f"{srv.url}/api/v1/alerts/{a['id']}/resolve", headers=_admin(srv))
        assert r.status_code == 200 and r.json()["state"] == "resolved"
        wait_for(lambda: len(_events(hook, a["id"])) == 3 and any(_ended(*p) for p in _am(am, a["id"])), timeout=20)
        time.sleep(1.5)  # several scans and re-send intervals later: nothing more
        assert _events(hook, a["id"]) == ["fired", "acknowledged", "resolved"]
        assert _slack(slack, a["id"]) == ["Run hung · fleetscope", "Acknowledged · fleetscope",
                                          "Resolved by hand · fleetscope"]
        posts = _am(am, a["id"])
        ended = [i for i, p in enumerate(posts) if _ended(*p)]
        assert len(ended) == 1 and ended[0] == len(posts) - 1, "the resolution is posted once, and last"
        assert all(not _ended(*p) for p in posts[:-1])
        # resolving again changes nothing and tells nobody
        assert httpx.post(f"{srv.url}/api/v1/alerts/{a['id']}/resolve", headers=_admin(srv)).json()["state"] == "resolved"
        time.sleep(0.6)
        assert len(_events(hook, a["id"])) == 3 and len(_am(am, a["id"])) == len(posts)
        from fleetscope.server.store import alert_deliveries

        told = {r["sink"]: (r["seq"], r["state"]) for r in alert_deliveries.told(srv.state.engine, [a["id"]])}
        assert told == {s: (2, "resolved") for s in ("slack", "webhook", "alertmanager")}
        assert srv.state.notifier.failed == 0
    finally:
        srv.stop()


def test_a_restart_reposts_firing_alerts_with_endsat_ahead_never_as_resolved(db_url: str,
                                                                            sinks: dict[str, Sink]) -> None:
    slack, am = sinks["slack"], sinks["alertmanager"]
    srv = _start(db_url, sinks)
    try:
        rid1, rid2 = _run(srv, "keeps-firing"), _run(srv, "resolved-before")
        firing = _raise(srv, rid1, "keeps-firing")
        done = _raise(srv, rid2, "resolved-before", kind="failure", state="failed")
        httpx.post(f"{srv.url}/api/v1/alerts/{done['id']}/resolve", headers=_admin(srv)).raise_for_status()
        wait_for(lambda: _am(am, firing["id"]) and any(_ended(*p) for p in _am(am, done["id"])), timeout=20)
    finally:
        srv.stop()
    mark, slack_mark = len(am.records), len(slack.records)
    time.sleep(1.0)  # longer than the re-send interval: nobody re-sends while no server runs
    assert len(am.records) == mark

    srv = _start(db_url, sinks)
    try:
        def reposted() -> list[tuple[float, dict[str, Any]]]:
            return [(t, a) for t, a in _am(am, firing["id"]) if t > am.records[mark - 1][0]]

        wait_for(lambda: len(reposted()) >= 2, timeout=20)
        assert all(not _ended(t, a) and dt.datetime.fromisoformat(a["endsAt"]).timestamp() > t for t, a in reposted())
        assert reposted()[0][1]["labels"] == _am(am, firing["id"])[0][1]["labels"]  # the same alert to Alertmanager
        listed = [x["id"] for x in httpx.get(f"{srv.url}/api/v1/alerts", params={"state": "firing"}).json()["alerts"]]
        assert listed == [firing["id"]]
        # what was resolved before the restart is not posted again, and Slack hears nothing twice
        assert len([p for p in _am(am, done["id"]) if p[0] > am.records[mark - 1][0]]) == 0
        assert len(slack.records) == slack_mark
    finally:
        srv.stop()


def test_two_servers_on_one_database_deliver_each_transition_once(db_url: str, sinks: dict[str, Sink]) -> None:
    slack, hook, am = sinks["slack"], sinks["webhook"], sinks["alertmanager"]
    a_srv = _start(db_url, sinks)
    b_srv = _start(db_url, sinks)
    try:
        rid = _run(a_srv, "two-instances")
        # both instances hear of the transition (the worst case: each believes it should deliver it)
        al = _raise(a_srv, rid, "two-instances", notify=(a_srv, b_srv))
        wait_for(lambda: _events(hook, al["id"]), timeout=20)
        httpx.post(f"{b_srv.url}/api/v1/alerts/{al['id']}/ack", headers=_admin(b_srv)).raise_for_status()
        wait_for(lambda: len(_events(hook, al["id"])) >= 2, timeout=20)
        httpx.post(f"{a_srv.url}/api/v1/alerts/{al['id']}/resolve", headers=_admin(a_srv)).raise_for_status()
        wait_for(lambda: len(_events(hook, al["id"])) >= 3 and any(_ended(*p) for p in _am(am, al["id"])), timeout=20)
        time.sleep(1.5)  # both instances scan every 0.2 s and re-send every 0.5 s meanwhile
        assert _events(hook, al["id"]) == ["fired", "acknowledged", "resolved"]
        assert len(_slack(slack, al["id"])) == 3
        assert len([p for p in _am(am, al["id"]) if _ended(*p)]) == 1
    finally:
        a_srv.stop()
        b_srv.stop()


def test_a_dead_slack_never_delays_alertmanager(db_url: str, sinks: dict[str, Sink]) -> None:
    slack, am = sinks["slack"], sinks["alertmanager"]
    slack.status = 500
    srv = _start(db_url, {**sinks, "webhook": _Closed()})
    try:
        # Slack's delivery retries for > 30 s (backoff 2, 4, 8, 16 s); the webhook's port is closed
        _fast(srv, retries=4, backoff_s=2.0, max_backoff_s=30.0)
        rid = _run(srv, "slack-down")
        a = _raise(srv, rid, "slack-down", kind="failure", state="failed")
        wait_for(lambda: _am(am, a["id"]), timeout=10)
        n = srv.state.notifier
        # structural: Alertmanager got it while Slack's worker is still retrying its first delivery
        assert slack.records and n.sinks["slack"].failed == 0 and n.sinks["alertmanager"].sent >= 1
        text = httpx.get(f"{srv.url}/metrics").text
        assert 'fleetscope_alert_deliveries_total{outcome="sent",sink="alertmanager"}' in text
        assert 'fleetscope_alert_queue_depth{sink="slack"}' in text
        assert 'fleetscope_alert_backlog{sink="webhook"}' in text
    finally:
        srv.stop()
    assert not srv._thread.is_alive()  # closing is not held up by the dead sinks' retries


class _Closed:
    """A sink URL nothing listens on."""

    def __init__(self) -> None:
        self.url = f"http://127.0.0.1:{_closed_port()}/hook"


def test_a_trace_attached_to_a_finished_run_neither_reopens_it_nor_raises_a_hang(db_url: str,
                                                                                sinks: dict[str, Sink]) -> None:
    slack = sinks["slack"]
    srv = _start(db_url, sinks)
    try:
        t0 = time.time() - 30
        with srv.client() as c:
            rid = c.register_run({"name": "traced", "world_size": 2, "started_at": t0})
            c.ingest(steps_batch(rid, 2, range(6), t0=t0))
            srv.compact()
            wait_for(state_is(srv, rid, "running"))
            c.finish_run(rid, "finished")
            wait_for(state_is(srv, rid, "finished"))
            wait_for(lambda: _concluded(srv, rid) == "finished")  # the pass has concluded it ended, too
            body = {"ranks": {"0": {"source": "rank0.json", "kernel_time_us": 1.0}}, "source": "traces/"}
            r = httpx.post(f"{srv.url}/api/v1/runs/{rid}/traces", json=body, headers=_admin(srv))
            assert r.status_code == 200, r.text
            assert c.get(f"/api/v1/runs/{rid}")["status"] == "finished"
            # what `fleetscope import-trace --run traced` does: join the run by name, then attach
            c.register_run({"name": "traced", "world_size": 2, "meta": {}})
            httpx.post(f"{srv.url}/api/v1/runs/{rid}/traces", json=body, headers=_admin(srv)).raise_for_status()
        time.sleep(6.0)  # three stall thresholds (2 s), thirty health passes
        assert [x for x in httpx.get(f"{srv.url}/api/v1/alerts").json()["alerts"] if x["run_id"] == rid] == []
        assert slack.records == []
    finally:
        srv.stop()


def _concluded(srv: Any, run_id: int) -> str | None:
    """What the health pass last stored about the run (``run_health.state``)."""
    from sqlalchemy import text

    with srv.state.engine.connect() as c:
        return c.execute(text("SELECT state FROM run_health WHERE run_id = :r"), {"r": run_id}).scalar()


def test_a_later_attempt_that_runs_resolves_the_failure_of_the_attempt_before(db_url: str,
                                                                              sinks: dict[str, Sink]) -> None:
    slack, hook = sinks["slack"], sinks["webhook"]
    srv = _start(db_url, sinks)
    try:
        t0 = time.time() - 60
        job = {"name": "elastic", "world_size": 2, "job_id": "torchrun-77"}
        with srv.client() as c:
            a0 = c.register_run({**job, "attempt": 0, "started_at": t0})
            c.ingest(steps_batch(a0, 2, range(5), t0=t0))
            srv.compact()
            wait_for(state_is(srv, a0, "running"))
            c.ingest({"v": 1, "run_id": a0, "events": [event(1, "failure", {
                "source": "signal", "signal": "SIGKILL", "exit_code": -9, "rank": 1}, step=5)]})
            wait_for(state_is(srv, a0, "failed"))
            (fail,) = wait_for(lambda: [x for x in httpx.get(f"{srv.url}/api/v1/alerts").json()["alerts"]
                                        if x["kind"] == "failure" and x["run_id"] == a0])
            assert fail["state"] == "firing"
            # torchrun restarts the job: attempt 1 registers and makes steps
            a1 = c.register_run({**job, "attempt": 1, "started_at": time.time() - 5})
            c.ingest(steps_batch(a1, 2, range(5, 9), t0=time.time() - 4))
            srv.compact()
        got = wait_for(lambda: (x := httpx.get(f"{srv.url}/api/v1/alerts/{fail['id']}").json())["state"] == "resolved"
                       and x)
        assert got["details"]["resolution"]["by"] == "recovery" and got["details"]["resolution"]["run_id"] == a1
        wait_for(lambda: _events(hook, fail["id"]) == ["fired", "resolved"], timeout=20)
        msg = wait_for(lambda: [b for b in slack.bodies if b["text"].startswith("Resolved: the failure of run elastic")])
        assert f"attempt 1 of the job (run {a1}) runs" in msg[0]["text"]
    finally:
        srv.stop()


def test_a_family_switch_regression_is_resolved_only_by_a_run_of_its_own_setup(db_url: str) -> None:
    from analysis_util import load
    from conftest import start_server

    from fleetscope.synthetic import RunSpec

    srv = start_server(db_url, alert_interval_s=0.1, alert_step_check_interval_s=0.0)
    day = 86400.0
    n = [0]

    def run(cfg: str, ws: int, slow: float) -> int:
        n[0] += 1
        spec = RunSpec(name=f"sw-{n[0]:02d}", family="vla-7b", world_size=ws, steps=6, seed=n[0], slow_factor=slow,
                       start_ts=1.7e9 + n[0] * day, config={"recipe": cfg})
        return load(srv, spec, collectives=False)

    def family_alerts() -> list[dict[str, Any]]:
        return [a for a in httpx.get(f"{srv.url}/api/v1/alerts", params={"kind": "run_series"}).json()["alerts"]
                if a["details"].get("scope") == "family"]

    try:
        for _ in range(6):
            run("a", 8, 1.0)
        for _ in range(5):
            run("b", 8, 1.3)  # the switch to setup b made it slower
        srv.state.alerts.run_once(everything=True)

        (a,) = family_alerts()
        assert a["state"] == "firing" and a["details"]["switch"]["to"]["world_size"] == 8
        run("c", 8, 1.3)  # another setup of the family: says nothing about setup b
        srv.state.alerts.run_once(everything=True)
        assert {x["id"]: x["state"] for x in family_alerts()}[a["id"]] == "firing"
        # a run of setup b recovers: now it resolves
        for _ in range(3):
            run("b", 8, 1.0)
        srv.state.alerts.run_once(everything=True)
        assert {x["id"]: x["state"] for x in family_alerts()}[a["id"]] == "resolved"
    finally:
        srv.stop()


def test_messages_are_worded_per_kind_and_event() -> None:
    from fleetscope.server.notifier import alertmanager_alert, slack_message, webhook_payload

    base = {"id": 5, "metric": "run_state", "state": "firing", "run_id": 2, "url": "https://fleet.example/runs/2"}
    stalled = {**base, "kind": "hang", "details": {"state": "stalled", "run_name": "r",
                                                   "finding": "run r stalled at step 4: no step finished for 5 min"}}
    hung = {**base, "kind": "hang", "details": {**stalled["details"], "state": "hung"}}
    head = lambda m: m["blocks"][0]["text"]["text"]  # noqa: E731
    assert head(slack_message(stalled, "fired")) == "Run stalled · fleetscope"
    assert head(slack_message(hung, "fired")) == "Run hung · fleetscope"
    assert head(slack_message({**base, "kind": "node_lost", "details": {}}, "fired")) == "Node lost · fleetscope"
    by_hand = {**stalled, "state": "resolved", "details": {**stalled["details"], "resolution": {"by": "hand"}}}
    assert slack_message(by_hand, "resolved")["text"].startswith("Resolved by hand: the stall of run r was resolved by hand")
    assert head(slack_message({**hung, "state": "acknowledged"}, "acknowledged")) == "Acknowledged · fleetscope"
    reg = {**base, "metric": "straggler_slowdown", "before": 1.0, "after": 1.3, "change": 0.3, "significance": None,
           "first_bad": {"rank": 3}, "details": {"unit": "x"}}
    assert head(slack_message({**reg, "kind": "straggler"}, "fired")) == "Straggler · fleetscope"
    assert head(slack_message({**reg, "kind": "slow_node"}, "fired")) == "Slow node · fleetscope"
    assert head(slack_message({**reg, "kind": "run_series", "metric": "step_s", "details": {"unit": "s"}},
                              "fired")) == "Regression · fleetscope"
    assert head(slack_message({**reg, "kind": "run_series", "metric": "step_s", "details": {"unit": "s"}},
                              "reopened")) == "Reopened: Regression · fleetscope"
    assert webhook_payload({**reg, "kind": "straggler"}, "acknowledged")["event"] == "acknowledged"
    # Alertmanager: the same labels whatever the event; endsAt ahead only when asked, ≤ now when resolved
    ahead = "2999-01-01T00:00:00+00:00"
    fired = alertmanager_alert(stalled, "fired", run=("r", "f"), ends_at=ahead)
    done = alertmanager_alert({**stalled, "state": "resolved", "resolved_at": "2026-01-01T00:00:00+00:00"},
                              "resolved", run=("r", "f"), ends_at=ahead)
    assert fired["labels"] == done["labels"] and fired["endsAt"] == ahead
    assert done["endsAt"] == "2026-01-01T00:00:00+00:00"
