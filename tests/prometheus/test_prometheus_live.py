"""The shipped Prometheus side as a whole, live: a real Prometheus (Debian's 2.42) configured from
docker/prometheus.yml scrapes a real fleetscope server on loopback every second, evaluates the shipped
rules (a test copy whose per-run alerts have ``for: 0s``; their real timing is unit-tested in
rules.test.yml) and sends to a real Alertmanager configured from docker/alertmanager.yml, to which the
server pushes its own alerts too (``--alertmanager-url``). Then:

* every query of the Grafana dashboard (panels and variables) runs through Prometheus' HTTP API: it
  parses, and returns data;
* a run that fails is exactly ONE firing alert in Prometheus (FleetscopeRunFailed: the failure is
  exported although the run is not live any more), and exactly ONE page at the receiver (the server's
  FleetscopeFailure; the rule's alert of the same failure is inhibited).

Every wait is bounded; the processes are stopped whatever happens."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

from .prom_util import Proc, run_alertmanager, run_prometheus, wait_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus-rules.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "fleetscope.json"
#: Grafana's variables, filled in as the dashboard would with "All" selected
FILL = {"$__rate_interval": "5m", "$__interval": "15s", "$family": ".*", "$run": ".*"}


def _query(prom: Proc, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, r.status_code, body)
    return body["data"]["result"]


def _firing(prom: Proc) -> list[dict[str, Any]]:
    alerts = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["state"] == "firing"]


def _test_rules() -> str:
    """The shipped rules with the per-run alerts' ``for`` at 0s (the service alerts keep theirs)."""
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if "fleetscope_run_" in r["expr"]:
                r["for"] = "0s"
    return yaml.safe_dump(doc, sort_keys=False)


def _load(srv: Any, spec: RunSpec) -> int:
    with srv.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    srv.compact()
    return int(rid)


@pytest.fixture
def receiver() -> Iterator[Any]:
    from analysis_util import Receiver

    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def stack(tools: dict[str, str], db_url: str, receiver: Any) -> Iterator[tuple[Any, Proc, Proc]]:
    """(server, Prometheus, Alertmanager), wired as docker-compose.yml wires them, on loopback."""
    from conftest import start_server

    am_cfg = yaml.safe_load((ROOT / "docker" / "alertmanager.yml").read_text())
    for rc in am_cfg["receivers"]:
        for w in rc.get("webhook_configs", ()):
            w["url"] = receiver.url  # the placeholder pager
    am_cfg["route"]["group_wait"] = "5s"
    with run_alertmanager(am_cfg) as am:
        srv = start_server(db_url, alertmanager_url=am.url, health_interval_s=0.5, alert_interval_s=0.5,
                           public_url="https://fleet.example")
        try:
            cfg = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
            cfg["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
            cfg["rule_files"] = ["rules.yml"]
            cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am.url.split("//", 1)[1]]
            (job,) = cfg["scrape_configs"]
            job["static_configs"][0]["targets"] = [srv.url.split("//", 1)[1]]
            with run_prometheus(cfg, {"rules.yml": _test_rules()}) as prom:
                wait_for(lambda: _query(prom, 'up{job="fleetscope"} == 1'), 30, "Prometheus scrapes the server")
                yield srv, prom, am
        finally:
            srv.stop()


def test_the_dashboard_queries_run_and_a_failed_run_is_one_alert_and_one_page(
        stack: tuple[Any, Proc, Proc], receiver: Any) -> None:
    srv, prom, am = stack
    now = time.time()
    # a live run, ingested while Prometheus scrapes (so rates move), and refused requests
    _load(srv, RunSpec(name="graf", family="gfam", world_size=2, steps=6, start_ts=now - 30))
    r = httpx.post(f"{srv.url}/api/v1/ingest", json={"v": 1, "run_id": 1}, headers={"Authorization": "Bearer fs_no"})
    assert r.status_code == 401
    bad = {"v": 1, "run_id": 1, "rank_steps": [{"rank": 0, "step": 99, "step_s": "slow"}] * 3}
    r = httpx.post(f"{srv.url}/api/v1/ingest", json=bad, headers={"Authorization": f"Bearer {srv.token}"})
    assert r.status_code == 422, r.text
    # a run that fails: a rank reports an exception; the health pass marks it failed and raises one
    # failure alert, which the server pushes to Alertmanager and /metrics exports (the run is not live)
    rid = _load(srv, RunSpec(name="crashy", family="cfam", world_size=2, steps=3, start_ts=now - 20))
    failure = {"rank": 1, "seq": 1, "kind": "failure", "ts": time.time(), "step": 3, "data": {
        "source": "exception", "exception": "RuntimeError", "message": "CUDA error", "phase": "forward",
        "frames": [{"file": "/ws/train.py", "line": 12, "func": "main"}], "signal": None, "exit_code": 1, "rank": 1}}
    with srv.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": [failure]})

    # --- Prometheus: exactly one firing alert, for the failure, and it stays one
    def failed_alert() -> list[dict[str, Any]]:
        return [a for a in _firing(prom) if a["labels"].get("run") == "crashy"]

    (alert,) = wait_for(failed_alert, 60, "FleetscopeRunFailed fires in Prometheus")
    assert alert["labels"] == {"alertname": "FleetscopeRunFailed", "run": "crashy", "family": "cfam",
                               "severity": "critical", "service": "fleetscope", "incident": "run_failed"}
    assert alert["annotations"]["summary"] == "run crashy (cfam) failed"
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}", timeout=10).json()["status"] == "failed"
    time.sleep(3)  # three more scrapes and evaluations: still that one alert, nothing else fires
    firing = _firing(prom)
    assert [(a["labels"]["alertname"], a["activeAt"]) for a in firing] == [("FleetscopeRunFailed", alert["activeAt"])]

    # --- the dashboard: every query parses and returns data
    dash = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [(f"variable {v['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["definition"]))
              for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 25
    empty = []
    for title, expr in exprs:
        for k, v in FILL.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, (title, expr)
        if not _query(prom, expr):
            empty.append((title, expr))
    assert not empty, empty
    # the failed run's state reaches the dashboard's state panels by name and by code
    assert _query(prom, 'fleetscope_run_state{run="crashy",state="failed"} == 1')
    assert _query(prom, 'fleetscope_run_state_code{run="crashy"} == 3')

    # --- Alertmanager: the server's failure alert is the one page; the rule's alert of it is inhibited
    def rule_alert_in_am() -> list[dict[str, Any]]:
        got = httpx.get(f"{am.url}/api/v2/alerts", params={"filter": 'run="crashy"'}, timeout=10).json()
        return [a for a in got if a["labels"]["alertname"] == "FleetscopeRunFailed"]

    (in_am,) = wait_for(rule_alert_in_am, 30, "Prometheus sends FleetscopeRunFailed to Alertmanager")
    assert in_am["status"]["state"] == "suppressed" and in_am["status"]["inhibitedBy"], in_am

    def pages() -> list[list[str]]:
        return [[a["labels"]["alertname"] for a in b["alerts"]] for b in receiver.bodies
                if any(a["labels"].get("run") == "crashy" for a in b["alerts"])]

    wait_for(pages, 30, "a page for the failed run reaches the receiver")
    time.sleep(6)  # longer than group_wait: a second page would be here by now
    assert pages() == [["FleetscopeFailure"]], receiver.bodies
