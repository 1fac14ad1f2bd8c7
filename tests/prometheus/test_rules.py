"""The shipped rules, Prometheus config and Alertmanager config, checked by Debian's tools: ``promtool
check rules`` / ``test rules`` (the unit tests in rules.test.yml run the rules' real ``for:`` and
``keep_firing_for:``: a failure pages at once and once, one hang is one alert, nothing flaps across a
server restart), ``promtool check config``, ``amtool check-config`` and routing, and the inhibit rules
in a real Alertmanager: one page per incident when the server also pushes its own alerts."""

from __future__ import annotations

import datetime as dt
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from .prom_util import run_alertmanager, wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RULES = ROOT / "docs" / "prometheus-rules.yml"
PROM_CONFIG = ROOT / "docker" / "prometheus.yml"
AM_CONFIG = ROOT / "docker" / "alertmanager.yml"
UNIT_TESTS = sorted(HERE.glob("*.test.yml"))


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def test_the_rules_pass_promtool_check_rules(tools: dict[str, str]) -> None:
    out = _run([tools["promtool"], "check", "rules", str(RULES)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


def test_the_rules_unit_tests_pass_with_the_real_for_durations(tools: dict[str, str]) -> None:
    assert UNIT_TESTS, "no tests/prometheus/*.test.yml"
    out = _run([tools["promtool"], "test", "rules", *(p.name for p in UNIT_TESTS)], cwd=HERE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(UNIT_TESTS), out.stdout


def test_every_alert_is_unit_tested_and_every_run_alert_keeps_firing_through_a_gap() -> None:
    """Each alert of the rules is expected to fire in some unit test, and the timing the tests rely on
    is what the rules say (reasonable for:, keep_firing_for on every per-run alert)."""
    expected: set[str] = set()
    for f in UNIT_TESTS:
        for t in yaml.safe_load(f.read_text())["tests"]:
            for a in t.get("alert_rule_test", ()):
                if a.get("exp_alerts"):
                    expected.add(a["alertname"])
            for e in t.get("promql_expr_test", ()):
                for s in e.get("exp_samples", ()):
                    if 'alertstate="firing"' in s.get("labels", ""):
                        expected.add(s["labels"].split('alertname="', 1)[1].split('"', 1)[0])
    alerts = _alerts()
    assert set(alerts) <= expected, sorted(set(alerts) - expected)
    minutes = {"s": 1 / 60, "m": 1, "h": 60}
    for name, r in alerts.items():
        if "for" in r:
            assert 0 < float(r["for"][:-1]) * minutes[r["for"][-1]] <= 15, (name, r["for"])
        if r["expr"].count("fleetscope_run_"):  # a per-run alert: one incident, labelled, no flapping
            assert r.get("keep_firing_for") and r["labels"]["incident"], name
            assert "offset" not in r["expr"], name


def test_prometheus_config_passes_promtool_check_config_with_the_shipped_rules(tools: dict[str, str]) -> None:
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/rules/fleetscope.yml"]
    (am,) = cfg["alerting"]["alertmanagers"]
    assert am["static_configs"][0]["targets"] == ["alertmanager:9093"]
    cfg["rule_files"] = [str(RULES)]  # where the compose file mounts it, here
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prometheus.yml"
        f.write_text(yaml.safe_dump(cfg))
        out = _run([tools["promtool"], "check", "config", str(f)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


def test_alertmanager_config_passes_amtool_and_routes_every_alert_to_the_receiver(tools: dict[str, str]) -> None:
    out = _run([tools["amtool"], "check-config", str(AM_CONFIG)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout and "5 inhibit rules" in out.stdout, out.stdout
    for labels in (["alertname=FleetscopeRunFailed", "severity=critical", "run=r1"],
                   ["alertname=FleetscopeIngestRejections", "severity=warning"]):
        out = _run([tools["amtool"], "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels])
        assert out.returncode == 0 and out.stdout.strip() == "oncall", out.stdout + out.stderr


def _post(am: Any, alerts: list[dict[str, str]]) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    body = [{"labels": a, "annotations": {"summary": a["alertname"]}, "startsAt": now.isoformat(),
             "endsAt": (now + dt.timedelta(minutes=5)).isoformat()} for a in alerts]
    r = httpx.post(f"{am.url}/api/v2/alerts", json=body, timeout=10)
    assert r.status_code == 200, r.text


def test_the_inhibit_rules_leave_one_alert_per_incident_in_a_real_alertmanager(tools: dict[str, str]) -> None:
    """The server's own run alerts (``--alertmanager-url``) and the rules' alerts of the same incidents,
    posted to Alertmanager 0.25 with docker/alertmanager.yml: per incident, one alert stays active; the
    rest are suppressed by the inhibit rules (the others' incidents untouched)."""
    native = {"service": "fleetscope", "severity": "critical", "family": "vla"}
    rule = {"service": "fleetscope", "family": "vla"}
    posted = {
        # a hang pushed by the server, and the rules' alert of it: the server's stays (it names the ranks)
        "hang/native": {**native, "alertname": "FleetscopeHang", "kind": "hang", "run": "r1", "alert_id": "1"},
        "hang/rule": {**rule, "alertname": "FleetscopeRunHung", "severity": "critical", "incident": "run_stopped",
                      "run": "r1"},
        "hang/straggler": {"service": "fleetscope", "severity": "warning", "family": "vla",
                           "alertname": "FleetscopeStraggler", "kind": "straggler", "run": "r1", "alert_id": "2"},
        # a failure after a hang: the server's failure stays; the rules' failure and the lingering hang go
        "failure/native": {**native, "alertname": "FleetscopeFailure", "kind": "failure", "run": "r2",
                           "alert_id": "3"},
        "failure/rule": {**rule, "alertname": "FleetscopeRunFailed", "severity": "critical",
                         "incident": "run_failed", "run": "r2"},
        "failure/hang-rule": {**rule, "alertname": "FleetscopeRunHung", "severity": "critical",
                              "incident": "run_stopped", "run": "r2"},
        # the rules alone (no --alertmanager-url): the failure stays, the lingering hang goes
        "rules-only/failure": {**rule, "alertname": "FleetscopeRunFailed", "severity": "critical",
                               "incident": "run_failed", "run": "r3"},
        "rules-only/hang": {**rule, "alertname": "FleetscopeRunHung", "severity": "critical",
                            "incident": "run_stopped", "run": "r3"},
        # another run's hang, by rule only: untouched by r1's and r2's
        "other/rule": {**rule, "alertname": "FleetscopeRunHung", "severity": "critical", "incident": "run_stopped",
                       "run": "r4"},
        # an instance without its database: its collection-error warning goes, other instances' stay
        "db/down": {"service": "fleetscope", "severity": "critical", "alertname": "FleetscopeDatabaseDown",
                    "instance": "a:8000", "job": "fleetscope"},
        "db/errors": {"service": "fleetscope", "severity": "warning", "alertname": "FleetscopeMetricsCollectionErrors",
                      "instance": "a:8000", "job": "fleetscope", "group": "runs"},
        "db/errors-b": {"service": "fleetscope", "severity": "warning",
                        "alertname": "FleetscopeMetricsCollectionErrors", "instance": "b:8000", "job": "fleetscope",
                        "group": "runs"},
    }
    active = {"hang/native", "failure/native", "rules-only/failure", "other/rule", "db/down", "db/errors-b"}
    config = yaml.safe_load(AM_CONFIG.read_text())
    with run_alertmanager(config) as am:
        _post(am, list(posted.values()))

        def states() -> dict[str, str] | None:
            got = httpx.get(f"{am.url}/api/v2/alerts", timeout=10).json()
            by_labels = {tuple(sorted(a["labels"].items())): a["status"]["state"] for a in got}
            out = {k: by_labels.get(tuple(sorted(v.items())), "missing") for k, v in posted.items()}
            return out if "missing" not in out.values() else None

        got = wait_for(states, 30, "Alertmanager lists every posted alert")
    want = {k: "active" if k in active else "suppressed" for k in posted}
    assert got == want, {k: (got[k], want[k]) for k in posted if got[k] != want[k]}
