"""Regression alerts: detection on run series, lifecycle, dedup, Slack + webhook payloads, and that a
failing receiver never hurts ingest."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from analysis_util import Receiver, load, scale_rows

from fleetscope.synthetic import RunSpec

DAY = 86400.0


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver]]:
    slack, hook = Receiver(), Receiver()
    yield slack, hook
    slack.close()
    hook.close()


@pytest.fixture
def alert_server(db_url: str, receivers: tuple[Receiver, Receiver]) -> Iterator[Any]:
    from conftest import start_server

    slack, hook = receivers
    srv = start_server(db_url, slack_webhook_url=slack.url, alert_webhook_url=hook.url, alert_interval_s=0.1,
                       alert_step_check_interval_s=0.0, public_url="https://fleet.example")
    yield srv
    srv.stop()


def _nightly(srv: Any, days: range, *, slow_from: int, compact: bool = True) -> dict[int, int]:
    ids = {}
    for d in days:
        spec = RunSpec(name=f"nightly-{d:02d}", family="vla-7b", world_size=8, steps=6, seed=100 + d,
                       start_ts=1.7e9 + d * DAY, slow_factor=1.2 if d >= slow_from else 1.0)
        ids[d] = load(srv, spec, collectives=False, compact=compact, git_commit=f"c0de{d:04d}")
    return ids


def _alerts(srv: Any, **params: Any) -> list[dict[str, Any]]:
    return httpx.get(f"{srv.url}/api/v1/alerts", params=params).json()["alerts"]


def test_run_series_regression_fires_once_posts_to_slack_and_resolves_when_fixed(
    alert_server: Any, receivers: tuple[Receiver, Receiver]
) -> None:
    slack, hook = receivers
    srv = alert_server
    ids = _nightly(srv, range(12), slow_from=6)
    worker = srv.state.alerts
    worker.run_once(everything=True)
    firing = _alerts(srv, state="firing")
    assert len(firing) == 1
    a = firing[0]
    assert a["kind"] == "run_series" and a["metric"] == "tokens_per_s_per_gpu" and a["run_id"] == ids[11]
    assert a["change"] == pytest.approx(1 / 1.19 - 1, abs=0.03) and a["after"] < a["before"]
    assert a["first_bad"]["run_id"] == ids[6] and a["first_bad"]["commit"] == "c0de0006"
    assert a["url"] == f"https://fleet.example/runs/{ids[6]}" and a["significance"] <= 0.01
    assert a["details"]["good_commit"] == "c0de0005"

    # Slack got Block Kit: what changed, before -> after with units, the commit, the deep link
    (msg,) = slack.wait(1)
    text = str(msg["blocks"])
    assert "tokens/s per GPU" in msg["text"] and "→" in msg["text"]
    assert "tokens/s/GPU" in text and "c0de0006" in text and "vla-7b" in text
    assert any(b.get("type") == "actions" and b["elements"][0]["url"] == a["url"] for b in msg["blocks"])
    (body,) = hook.wait(1)
    assert body["event"] == "fired" and body["alert"]["id"] == a["id"] and body["alert"]["url"] == a["url"]

    # detection again: same alert, no second message (dedup)
    worker.run_once(everything=True)
    assert [x["id"] for x in _alerts(srv)] == [a["id"]]
    time.sleep(0.3)
    assert len(slack.bodies) == 1

    # the fix lands: the series recovers, the alert resolves by itself and Slack is told
    _nightly(srv, range(12, 20), slow_from=99)
    worker.run_once(everything=True)
    assert _alerts(srv, state="firing") == []
    (resolved,) = _alerts(srv, state="resolved")
    assert resolved["id"] == a["id"] and resolved["resolved_at"]
    msgs = slack.wait(2)
    assert len(msgs) == 2 and "Resolved" in msgs[1]["text"]


def test_ack_and_manual_resolve_follow_the_lifecycle(alert_server: Any) -> None:
    srv = alert_server
    _nightly(srv, range(10), slow_from=5)
    srv.state.alerts.run_once(everything=True)
    (a,) = _alerts(srv, state="firing")
    url = f"{srv.url}/api/v1/alerts/{a['id']}"
    assert httpx.post(f"{url}/ack").status_code == 401  # writes need the token
    hdr = {"Authorization": f"Bearer {srv.token}"}
    acked = httpx.post(f"{url}/ack", headers=hdr).json()
    assert acked["state"] == "acknowledged" and acked["acknowledged_at"]
    assert _alerts(srv, state="firing") == [] and len(_alerts(srv, state="acknowledged")) == 1
    srv.state.alerts.run_once(everything=True)  # still regressed: stays acknowledged, not re-raised
    assert [x["state"] for x in _alerts(srv)] == ["acknowledged"]
    assert httpx.post(f"{url}/resolve", headers=hdr).json()["state"] == "resolved"
    srv.state.alerts.run_once(everything=True)  # resolved by hand: the same regression does not fire again
    assert [x["state"] for x in _alerts(srv)] == ["resolved"]
    assert httpx.post(f"{srv.url}/api/v1/alerts/99999/ack", headers=hdr).status_code == 404
    assert httpx.get(f"{srv.url}/api/v1/alerts/{a['id']}").json()["id"] == a["id"]


def test_step_time_shift_within_a_run_is_detected_in_the_background(alert_server: Any,
                                                                   receivers: tuple[Receiver, Receiver]) -> None:
    srv = alert_server
    rid = load(srv, RunSpec(name="restart-onto-slow-node", family="vit-h", world_size=4, steps=80),
               transform=scale_rows(1.25, 50), collectives=False, compact=False)
    # no explicit detection call: the compactor's pass wakes the alert worker
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _alerts(srv, kind="step_time_shift"):
        time.sleep(0.1)
    (a,) = _alerts(srv, kind="step_time_shift")
    assert a["run_id"] == rid and abs(a["first_bad"]["step"] - 50) <= 2
    assert a["change"] == pytest.approx(0.25, abs=0.03) and a["url"].endswith(f"/runs/{rid}?step={a['first_bad']['step']}")


def test_a_failing_receiver_never_hurts_ingest(db_url: str) -> None:
    from conftest import start_server

    bad = Receiver(status=500)
    srv = start_server(db_url, slack_webhook_url=bad.url, alert_webhook_url="http://127.0.0.1:9/nothing-listens",
                       alert_interval_s=0.1)
    try:
        notifier = srv.state.alerts.notifier
        notifier.backoff_s = 0.01
        notifier.retries = 2
        _nightly(srv, range(10), slow_from=5)
        srv.state.alerts.run_once(everything=True)
        assert len(_alerts(srv, state="firing")) == 1  # stored and on the API whatever Slack says
        deadline = time.monotonic() + 20
        while notifier.failed < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert notifier.failed == 2 and notifier.sent == 0 and len(bad.bodies) == 3  # 1 try + 2 retries
        # ingest and the read API are unaffected
        rid = load(srv, RunSpec(name="after", family="vit-h", world_size=4, steps=3), collectives=False)
        assert httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary").json()["rank_steps"] == 12
    finally:
        srv.stop()
        bad.close()


def test_persistent_straggler_raises_one_alert_naming_the_node(alert_server: Any,
                                                                receivers: tuple[Receiver, Receiver]) -> None:
    slack, _ = receivers
    srv = alert_server
    rid = load(srv, RunSpec(name="slow-node", family="llm-70b", world_size=32, steps=12,
                            straggler={r: 1.3 for r in range(8, 16)}), collectives=False)
    fine = load(srv, RunSpec(name="fine", family="llm-70b", world_size=32, steps=12, seed=5), collectives=False)
    srv.state.alerts.poke(runs=[rid, fine])
    srv.state.alerts.run_once()
    (a,) = _alerts(srv, kind="straggler")
    assert a["run_id"] == rid and a["metric"] == "straggler_slowdown" and a["state"] == "firing"
    assert 8 <= a["first_bad"]["rank"] < 16 and a["details"]["node"] == "node0001"
    assert a["after"] == pytest.approx(1.28, abs=0.03) and a["url"] == f"https://fleet.example/runs/{rid}"
    msg = next(m for m in slack.wait(1) if "Straggler" in m["text"])
    assert "node0001" in str(msg["blocks"]) and ("1.28x" in msg["text"] or "1.29x" in msg["text"])
