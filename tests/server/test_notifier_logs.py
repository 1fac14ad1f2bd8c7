"""No webhook URL in any log line at any level while the receivers are down, and delivery failures logged
once per sink per interval.

Slack's path is its credential; the generic webhook may carry one in its path or query; Alertmanager may
carry user:password. With every logger at DEBUG (root, ours, slack_sdk's, httpx, httpcore, urllib3) no
line shows them — and, so that these tests cannot pass for want of log lines, the same deliveries with
the redaction switched off do show them."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from analysis_util import Receiver
from fleetscope.server import notifier as nt

SLACK_SECRET = "T0SECRET1/B0SECRET2/xoxSlackWebhookS3cretPath"
HOOK_SECRET = "hookS3cretToken"
AM_PASSWORD = "amPassw0rdS3cret"
LOGGERS = ("", "fleetscope", "fleetscope.server.notifier", "fleetscope.server.notifier.slack", "slack_sdk",
           "slack_sdk.webhook.client", "httpx", "httpcore", "httpcore.connection", "httpcore.http11", "urllib3",
           "urllib3.connectionpool")
SECRETS = (SLACK_SECRET, "xoxSlackWebhookS3cretPath", HOOK_SECRET, AM_PASSWORD)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alert(i: int = 1) -> dict[str, Any]:
    return {"id": i, "kind": "hang", "state": "firing", "metric": "step_s", "run_id": 7,
            "details": {"finding": "run r hung: no step for 300 s", "run_name": "r"}, "url": "https://fleet.example/runs/7"}


@pytest.fixture
def debug_everywhere(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


@pytest.fixture
def urls() -> Iterator[dict[str, str]]:
    port = _closed_port()
    yield {"slack_webhook_url": f"http://127.0.0.1:{port}/services/{SLACK_SECRET}",
           "webhook_url": f"http://127.0.0.1:{port}/hooks/{HOOK_SECRET}?token={HOOK_SECRET}",
           "alertmanager_url": f"http://fleet:{AM_PASSWORD}@127.0.0.1:{port}"}


def _deliver_while_down(urls: dict[str, str], n: int = 2) -> nt.Notifier:
    n_ = nt.Notifier(**urls, retries=1, backoff_s=0.01, timeout_s=2)
    try:
        for i in range(n):
            n_.notify(_alert(i + 1), "fired")
        deadline = time.monotonic() + 30
        while n_.failed < 3 * n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n_.failed == 3 * n and n_.sent == 0, (n_.failed, n_.sent)
    finally:
        n_.close()
    return n_


def _all_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record as a handler would print it: message, traceback, stack."""
    fmt = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(fmt.format(r) for r in caplog.records)


def test_no_webhook_url_in_any_log_line_at_any_level_while_the_receivers_are_down(
        debug_everywhere: pytest.LogCaptureFixture, urls: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    caplog = debug_everywhere
    # the canary: the same deliveries without the redaction do log the secrets (the libraries' lines
    # reach this capture), so the assertion below is not vacuous
    with monkeypatch.context() as m:
        m.setattr(nt.RedactSecrets, "filter", lambda self, record: True)
        m.setattr(nt.RedactSecrets, "redact", lambda self, text: text)
        _deliver_while_down(urls, n=1)
        leaked = _all_text(caplog)
        assert SLACK_SECRET in leaked, leaked[-3000:]  # httpx logs a URL only once it has a response
    caplog.clear()

    _deliver_while_down(urls, n=2)
    text = _all_text(caplog)
    assert caplog.records, "nothing logged"
    for secret in SECRETS:
        assert secret not in text, (secret, text[-3000:])
    # the failure lines name the sink instead
    ours = [r.getMessage() for r in caplog.records if r.name == "fleetscope.server.notifier"
            and r.getMessage().startswith("could not deliver")]
    assert {m.split(" to ", 1)[1].split(":", 1)[0] for m in ours} == {"slack", "webhook", "alertmanager"}, ours


def test_a_real_server_with_slack_down_logs_no_webhook_url(db_url: str, urls: dict[str, str],
                                                           debug_everywhere: pytest.LogCaptureFixture) -> None:
    from conftest import start_server

    srv = start_server(db_url, slack_webhook_url=urls["slack_webhook_url"], alert_webhook_url=urls["webhook_url"],
                       alertmanager_url=urls["alertmanager_url"])
    try:
        n_ = srv.state.notifier
        n_.backoff_s, n_.retries = 0.01, 1
        n_.notify(_alert(), "fired")
        deadline = time.monotonic() + 30
        while n_.failed < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n_.failed == 3
    finally:
        srv.stop()
    text = _all_text(debug_everywhere)
    for secret in SECRETS:
        assert secret not in text, (secret, text[-3000:])


def _deliver_to(rec: Receiver) -> None:
    base = rec.url.rsplit("/", 1)[0]
    host = base.split("://", 1)[1]
    n_ = nt.Notifier(slack_webhook_url=f"{base}/services/{SLACK_SECRET}",
                     webhook_url=f"{base}/x/{HOOK_SECRET}?token={HOOK_SECRET}",
                     alertmanager_url=f"http://fleet:{AM_PASSWORD}@{host}", retries=0, backoff_s=0.01)
    start = len(rec.bodies)
    try:
        n_.notify(_alert(), "fired")
        rec.wait(start + 3)
        deadline = time.monotonic() + 20
        while n_.failed < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n_.failed == 3 and len(rec.bodies) == start + 3
    finally:
        n_.close()
    # the real URLs were used (each sink has its own worker: in any order)
    assert sorted(rec.paths[start:]) == sorted([f"/services/{SLACK_SECRET}", f"/x/{HOOK_SECRET}?token={HOOK_SECRET}",
                                                "/api/v2/alerts"])


def test_receivers_answering_errors_log_no_webhook_url(debug_everywhere: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The receivers reachable but failing (500): the HTTP clients' request/response lines (httpx logs
    every request's URL at INFO) are redacted too."""
    caplog = debug_everywhere
    rec = Receiver(status=500)
    try:
        with monkeypatch.context() as m:  # the canary, as above
            m.setattr(nt.RedactSecrets, "filter", lambda self, record: True)
            m.setattr(nt.RedactSecrets, "redact", lambda self, text: text)
            _deliver_to(rec)
            leaked = _all_text(caplog)
            assert SLACK_SECRET in leaked and HOOK_SECRET in leaked and AM_PASSWORD in leaked, leaked[-3000:]
        caplog.clear()
        _deliver_to(rec)
    finally:
        rec.close()
    text = _all_text(caplog)
    assert "HTTP 500" in text and "HTTP Request: POST" in text  # httpx's line, redacted
    for secret in SECRETS:
        assert secret not in text, (secret, text[-3000:])


def test_repeated_delivery_failures_log_one_line_per_sink_per_interval(urls: dict[str, str],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fleetscope.server.notifier")
    from fleetscope.server.logutil import Throttle

    n_ = nt.Notifier(slack_webhook_url=urls["slack_webhook_url"], webhook_url=urls["webhook_url"], retries=0,
                     backoff_s=0.01, timeout_s=2, log_interval_s=60.0)
    now = [0.0]
    n_._log_throttle = Throttle(60.0, clock=lambda: now[0])  # the interval's clock, in the test's hands
    try:
        for i in range(20):
            n_.notify(_alert(i), "fired")
        deadline = time.monotonic() + 30
        while n_.failed < 40 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n_.failed == 40
        lines = [r.getMessage() for r in caplog.records if r.name == "fleetscope.server.notifier"]
        per_sink = {s: sum(f" to {s}:" in m for m in lines) for s in ("slack", "webhook")}
        assert per_sink == {"slack": 1, "webhook": 1}, lines
        # after the interval the next failure is logged, with how many were held back
        now[0] += 61
        n_.notify(_alert(99), "fired")
        deadline = time.monotonic() + 30
        while n_.failed < 42 and time.monotonic() < deadline:
            time.sleep(0.02)
        lines = [r.getMessage() for r in caplog.records if r.name == "fleetscope.server.notifier"]
        slack = [m for m in lines if " to slack:" in m]
        assert len(slack) == 2 and "(and 19 more like it in the last interval)" in slack[1], slack
    finally:
        n_.close()
