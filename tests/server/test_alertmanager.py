"""Alerts to Alertmanager's v2 API (``--alertmanager-url``): the payload at a loopback receiver (labels,
annotations, startsAt, endsAt ahead while firing and ≤ now on resolve, generatorURL), retries on 5xx like
the other sinks, and firing alerts re-sent until they resolve (Alertmanager forgets an alert not re-sent)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest
from analysis_util import Receiver, load

from fleetscope.synthetic import RunSpec

DAY = 86400.0


@pytest.fixture
def am() -> Iterator[Receiver]:
    rec = Receiver(status=503)  # the first delivery fails: the notifier must retry
    yield rec
    rec.close()


@pytest.fixture
def am_server(db_url: str, am: Receiver) -> Iterator[Any]:
    from conftest import start_server

    base = am.url.rsplit("/hook", 1)[0]
    srv = start_server(db_url, alertmanager_url=base + "/", alert_interval_s=0.1, public_url="https://fleet.example")
    srv.state.notifier.alertmanager_resend_s = 0.5
    yield srv
    srv.stop()


def _nightly(srv: Any, days: range, *, slow_from: int) -> dict[int, int]:
    ids = {}
    for d in days:
        spec = RunSpec(name=f"nightly-{d:02d}", family="vla-7b", world_size=4, steps=6, seed=100 + d,
                       start_ts=1.7e9 + d * DAY, slow_factor=1.2 if d >= slow_from else 1.0)
        ids[d] = load(srv, spec, collectives=False, git_commit=f"c0de{d:04d}")
    return ids


def _ended(m: dict[str, Any]) -> bool:
    """Posted as resolved: ``endsAt`` not ahead of now (a firing alert's is ahead)."""
    return "endsAt" in m and dt.datetime.fromisoformat(m["endsAt"]) <= dt.datetime.now(dt.timezone.utc)


def _wait(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not pred():
        time.sleep(0.05)
    assert pred()


def test_alerts_reach_alertmanager_with_labels_retries_resends_and_resolve(am_server: Any, am: Receiver) -> None:
    srv = am_server
    ids = _nightly(srv, range(10), slow_from=5)
    srv.state.alerts.run_once(everything=True)
    (a,) = [x for x in srv.client().get("/api/v1/alerts")["alerts"] if x["state"] == "firing"]
    _wait(lambda: len(am.bodies) >= 1)
    am.status = 200  # the receiver recovers: the same alert is delivered again (retry)
    _wait(lambda: len(am.bodies) >= 2)
    assert set(am.paths) == {"/api/v2/alerts"}
    first, retried = am.bodies[0], am.bodies[1]
    assert first == retried and isinstance(first, list) and len(first) == 1
    (m,) = first
    assert m["labels"] == {"alertname": "FleetscopeRunSeries", "severity": "warning", "service": "fleetscope",
                           "kind": "run_series", "metric": "tokens_per_s_per_gpu", "run": "nightly-09",
                           "family": "vla-7b", "alert_id": str(a["id"])}
    assert a["run_id"] == ids[9]
    assert "tokens/s per GPU" in m["annotations"]["summary"] and m["annotations"]["description"]
    assert m["annotations"]["runbook_url"] == a["url"] == m["generatorURL"]
    assert dt.datetime.fromisoformat(m["startsAt"]) == dt.datetime.fromisoformat(a["created_at"])
    assert not _ended(m)  # firing: endsAt ahead (Alertmanager keeps it until the next re-send)

    # still firing: re-sent (without endsAt) so Alertmanager keeps it
    n = len(am.bodies)
    _wait(lambda: len(am.bodies) >= n + 2, timeout=10)
    assert all(b[0]["labels"]["alert_id"] == str(a["id"]) and not _ended(b[0]) for b in am.bodies[n:])

    # the series recovers: one post with endsAt, then no more re-sends
    _nightly(srv, range(10, 18), slow_from=99)
    srv.state.alerts.run_once(everything=True)
    _wait(lambda: any(_ended(b[0]) for b in am.bodies))
    (resolved,) = [b[0] for b in am.bodies if _ended(b[0])]
    assert resolved["labels"] == m["labels"]
    assert dt.datetime.fromisoformat(resolved["endsAt"]) >= dt.datetime.fromisoformat(resolved["startsAt"])
    time.sleep(1.2)
    settled = len(am.bodies)
    time.sleep(1.2)
    assert len(am.bodies) == settled, "a resolved alert must not be re-sent"
    assert srv.state.notifier.failed == 0


def test_run_health_alerts_are_critical_with_their_finding_as_summary() -> None:
    from fleetscope.server.notifier import alertmanager_alert

    alert = {"id": 7, "kind": "node_lost", "metric": "step_s", "state": "firing", "run_id": 3,
             "created_at": "2026-12-04T03:00:00+00:00", "url": "https://fleet.example/runs/3",
             "details": {"finding": "run llama hung at step 812: node n0193 lost (ranks 8-15 silent)"}}
    fired = alertmanager_alert(alert, "fired", run=("llama", "llama-70b"))
    assert fired["labels"]["alertname"] == "FleetscopeNodeLost" and fired["labels"]["severity"] == "critical"
    assert fired["labels"]["run"] == "llama" and fired["labels"]["family"] == "llama-70b"
    assert fired["annotations"]["summary"] == alert["details"]["finding"] and "endsAt" not in fired
    done = alertmanager_alert({**alert, "state": "resolved", "resolved_at": "2026-12-04T03:05:00+00:00"}, "resolved",
                              run=("llama", "llama-70b"))
    assert done["endsAt"] == "2026-12-04T03:05:00+00:00" and done["labels"] == fired["labels"]
