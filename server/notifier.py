"""Alert delivery: Slack (incoming webhook, Block Kit), a generic JSON webhook and Alertmanager's v2 API.

Deliveries go through a bounded queue to one daemon thread, with capped exponential backoff and
jitter on connection errors, 429 and 5xx (honouring Retry-After). Nothing here can block or fail
the caller: a full queue drops the message and counts it; a dead receiver costs retries, then a
log line and a counter.
Alertmanager forgets an alert that is not re-sent within its ``resolve_timeout``; the notifier
re-posts every alert it knows to be firing every ``alertmanager_resend_s`` (Prometheus does the
same), and posts a resolved alert once with ``endsAt``.

A webhook URL is a secret (Slack's path *is* the credential). No log line at any level shows one: the
notifier's own lines name the sink (``slack``, ``webhook``, ``alertmanager``), and a filter attached to
each logger that could print a request URL while we send — ours, the Slack client's (our own logger,
its chatter off), ``httpx``, ``httpcore.*``, ``urllib3.*`` — rewrites the URL, its path and query and any
``user:password@`` in every record to a placeholder. Repeated delivery failures log one line per sink
per ``log_interval_s`` (``server.logutil``).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

from .analysis.explain import explanation, metric_label
from .logutil import Throttle, log_throttled

__all__ = ["Notifier", "slack_message", "webhook_payload", "alertmanager_alert", "format_value", "explain_alert",
           "CRITICAL_KINDS"]

log = logging.getLogger(__name__)
#: the Slack client's logger: its request/response/retry lines (URL included) are off unless an operator
#: lowers this level; our warning line says what failed, and the redaction filter guards it regardless
slack_log = logging.getLogger(__name__ + ".slack")
slack_log.setLevel(logging.CRITICAL)

#: the loggers (and, for the ``.``-suffixed ones, every logger under them) that may print a request URL
#: while we send. A filter on a parent logger does not see its children's records, so each gets its own.
_URL_LOGGERS = ("httpx", "httpx.", "httpcore", "httpcore.", "urllib3", "urllib3.", "slack_sdk", "slack_sdk.",
                "urllib.request")


class RedactSecrets(logging.Filter):
    """Rewrites registered secrets (webhook URLs and their parts) in a record's message, arguments,
    traceback and stack to placeholders. Never drops a record."""

    def __init__(self) -> None:
        super().__init__()
        self._secrets: dict[str, str] = {}  # secret -> placeholder
        self._order: list[str] = []  # longest first
        self._lock = threading.Lock()

    def add(self, url: str | None, sink: str, *, whole: bool = True) -> None:
        """Register ``url``'s secret parts: the URL itself (unless ``whole`` is off), its path + query,
        its query, its ``user:password``, its password — as given and as httpx would print them."""
        if not url:
            return
        found: dict[str, str] = {}
        for u in _variants(url):
            try:
                parts = urlsplit(u)
            except ValueError:
                parts = None
            if whole:
                found[u] = f"<{sink} URL>"
                found[u.rstrip("/")] = f"<{sink} URL>"
            if parts is None:
                continue
            if whole and len(parts.path) > 1:  # what urllib3 prints: "POST /services/T…/B…/… HTTP/1.1"
                tail = parts.path + (f"?{parts.query}" if parts.query else "")
                found[tail] = f"<{sink} path>"
                found[unquote(tail)] = f"<{sink} path>"
            if parts.query:
                found[parts.query] = "<redacted>"
            if parts.password:
                found[parts.password] = "<redacted>"
                found[unquote(parts.password)] = "<redacted>"
        with self._lock:
            for k, v in found.items():
                if len(k) >= 6 and k not in self._secrets:  # short strings would garble unrelated lines
                    self._secrets[k] = v
            for u in _variants(url):  # user:password@, however short (the '@' keeps it specific)
                try:
                    netloc = urlsplit(u).netloc
                except ValueError:
                    continue
                if "@" in netloc:
                    self._secrets[netloc.rsplit("@", 1)[0] + "@"] = "<redacted>@"
            self._order = sorted(self._secrets, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._order:
            if secret in text:
                text = text.replace(secret, self._secrets[secret])
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._order:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: keep its raw text
            msg = str(record.msg)
        red = self.redact(msg)
        if red != msg:
            record.msg, record.args = red, None
        if record.exc_info and record.exc_info[1] is not None:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            red = self.redact(text)
            if red != text:  # the formatted, redacted traceback replaces the exception
                record.exc_text, record.exc_info = red, None
        elif record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def _variants(url: str) -> list[str]:
    out = [url.strip()]
    try:
        import httpx

        out.append(str(httpx.URL(url.strip())))
    except Exception:  # noqa: BLE001 - not a URL httpx takes: it cannot print it either
        pass
    return list(dict.fromkeys(out))


#: one filter for the process: every notifier registers its URLs in it
REDACT = RedactSecrets()


def guard_loggers() -> None:
    """Attach :data:`REDACT` to our loggers and to every existing logger that may print a request URL
    (idempotent; called again before each delivery, so loggers created since are covered)."""
    for lg in (log, slack_log):
        if REDACT not in lg.filters:
            lg.addFilter(REDACT)
    for name, existing in list(logging.root.manager.loggerDict.items()):
        if isinstance(existing, logging.Logger) and REDACT not in existing.filters and any(
                name == p or (p.endswith(".") and name.startswith(p)) for p in _URL_LOGGERS):
            existing.addFilter(REDACT)
    for name in ("httpx", "urllib3.connectionpool", "slack_sdk.webhook.client"):
        named = logging.getLogger(name)
        if REDACT not in named.filters:
            named.addFilter(REDACT)


_KIND_TITLE = {
    "run_series": "Run regression",
    "benchmark": "Benchmark regression",
    "step_time_shift": "Step time shift within a run",
    "straggler": "Straggler",
    "slow_node": "Slow node",
}
_METRIC_NAME = {
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "step_s": "step time",
    "mfu": "MFU",
    "straggler_slowdown": "slowest rank's work vs the median rank",
    "node_network_slowdown": "node's collectives vs the median rank",
}


def format_value(v: float | None, unit: str) -> str:
    """A value with its unit, human-sized (ms for sub-second times, % for MFU)."""
    if v is None:
        return "n/a"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.3f} s"
    if unit == "":
        return f"{100 * v:.1f}%"
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "B":
        return f"{v / 2**30:.1f} GiB"
    if unit == "B/s":
        return f"{v / 1e9:.1f} GB/s"
    if abs(v) >= 1e4:
        return f"{v:,.0f} {unit}"
    return f"{v:.4g} {unit}"


def _esc(v: Any) -> str:
    """User-supplied text in Slack mrkdwn: ``&``, ``<`` and ``>`` escaped as Slack asks, so it cannot ping
    (``<!channel>``), mention (``<@U…>``) or disguise a link (``<url|text>``)."""
    return str(v).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _code(v: Any) -> str:
    """User-supplied text as an inline code span it cannot break out of."""
    return "`" + _esc(v).replace("`", "'") + "`"


def _name(metric: str) -> str:
    return _METRIC_NAME.get(metric) or metric_label(metric)


def explain_alert(alert: dict[str, Any], *, slack: bool = False) -> str | None:
    """The alert's one-sentence explanation from its ``cause`` and ``diff`` (``analysis.explain``), with
    user-supplied strings escaped for Slack when ``slack``."""
    return explanation(alert["metric"], alert.get("change"), alert.get("before"), alert.get("after"),
                       (alert.get("details") or {}).get("unit"), alert.get("cause"), alert.get("diff"),
                       esc=_esc if slack else str)


def _headline(alert: dict[str, Any], event: str) -> str:
    details = alert.get("details") or {}
    unit = details.get("unit", "")
    metric = _esc(_name(alert["metric"]))
    change = alert.get("change")
    ch = f"{100 * change:+.1f}%" if change is not None else ""
    what = _KIND_TITLE.get(alert["kind"], alert["kind"])
    state = "Resolved" if event == "resolved" else what
    return f"{state}: {metric} {ch} ({format_value(alert.get('before'), unit)} → {format_value(alert.get('after'), unit)})"


def _context(alert: dict[str, Any]) -> str:
    d = alert.get("details") or {}
    fb = alert.get("first_bad") or {}
    parts = []
    if alert["kind"] == "run_series" and d.get("scope") == "family":
        sw = d.get("switch") or {}
        fr, to = sw.get("from") or {}, sw.get("to") or {}
        parts.append(f"*Series:* {_esc(d.get('family'))} on {_esc(d.get('device_type') or 'device')} — setup switch "
                     f"{_esc(fr.get('world_size'))}× config {_code(fr.get('config_signature'))} → "
                     f"{_esc(to.get('world_size'))}× config {_code(to.get('config_signature'))}")
        bad = f"run {_code(fb.get('run'))}" + (f" at commit {_code(fb['commit'])}" if fb.get("commit") else "")
        parts.append(f"*First bad:* {bad}")
    elif alert["kind"] == "run_series":
        parts.append(f"*Series:* {_esc(d.get('family'))} · {_esc(d.get('world_size'))}× "
                     f"{_esc(d.get('device_type') or 'device')} · config {_code(d.get('config_signature'))}")
        bad = f"run {_code(fb.get('run'))}" + (f" at commit {_code(fb['commit'])}" if fb.get("commit") else "")
        if d.get("good_commit"):
            bad += f" (last good commit {_code(d['good_commit'])})"
        parts.append(f"*First bad:* {bad}")
    elif alert["kind"] == "benchmark":
        params = ", ".join(f"{_esc(k)}={_esc(v)}" for k, v in (d.get("params") or {}).items())
        parts.append(f"*Benchmark:* {_esc(alert['metric'])} on {_esc(d.get('cluster'))} ({params})")
        parts.append(f"*First bad:* point {_esc(fb.get('index'))} at {_esc(fb.get('ts'))}"
                     + (f", commit {_code(fb['commit'])}" if fb.get("commit") else ""))
    elif alert["kind"] == "straggler":
        where = f" on {_esc(fb['host'])}" if fb.get("host") else ""
        parts.append(f"*Run:* {alert.get('run_id')} — rank {fb.get('rank')}{where} is the slowest"
                     + (f", late in {_esc(d['component'])}" if d.get("component") else ""))
        if d.get("node"):
            parts.append(f"*Node:* {_esc(d['node'])} — all {len(d.get('node_ranks') or [])} of its ranks straggle")
        elif (d.get("stragglers") or 0) > 1:
            parts.append(f"*Stragglers:* {d['stragglers']} ranks: {', '.join(map(str, d.get('ranks') or []))}")
    elif alert["kind"] == "slow_node":
        ratios = []
        if d.get("busbw_ratio") is not None:
            ratios.append(f"busbw {100 * float(d['busbw_ratio']):.0f} % of the median rank's")
        if d.get("latency_ratio") is not None:
            ratios.append(f"latency {float(d['latency_ratio']):.2f}x")
        parts.append(f"*Run:* {alert.get('run_id')} — node {_code(d.get('node'))} is slow on the network"
                     + (f" ({', '.join(ratios)})" if ratios else ""))
        rk = d.get("ranks") or []
        more = max(0, int(d.get("node_ranks") or len(rk)) - len(rk))
        parts.append(f"*Ranks:* {', '.join(_esc(r) for r in rk)}" + (f" and {more} more" if more else "")
                     + (f" — {_esc(d['slow_ranks'])} slow" if d.get("slow_ranks") is not None else ""))
    else:
        parts.append(f"*Run:* {alert.get('run_id')} — first slow step {fb.get('step')}")
    return "\n".join(parts)


_HEALTH_KINDS = {"hang": "Run hung", "node_lost": "Node lost", "failure": "Run failed"}


def _health_sentence(alert: dict[str, Any], event: str) -> str:
    """A run-health alert (hang, node_lost, failure) in one sentence: its finding, or that it resolved."""
    d = alert.get("details") or {}
    if event == "resolved":
        run = d.get("run_name") or alert.get("run_id")
        if alert.get("kind") == "failure":
            return f"the failure of run {run} was resolved"
        return f"run {run} resumed: steps finish again"
    return str(d.get("finding") or f"run {alert.get('run_id')}: {alert['kind']}")


def _health_slack(alert: dict[str, Any], event: str) -> dict[str, Any]:
    sentence = _esc(_health_sentence(alert, event))
    title = "Resolved" if event == "resolved" else _HEALTH_KINDS.get(alert["kind"], alert["kind"])
    emoji = ":white_check_mark:" if event == "resolved" else ":rotating_light:"
    url = alert.get("url")
    link = f" <{url}|open in fleetscope>" if url and url.startswith("http") else ""
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": f"{title} · fleetscope", "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{emoji} {sentence}{link}"}},
    ]
    if url and url.startswith("http"):
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in fleetscope"}, "url": url}]})
    blocks.append({"type": "context", "elements": [
        {"type": "mrkdwn", "text": f"alert #{alert['id']} · {alert['kind']} · state {alert['state']}"}]})
    return {"text": f"{title}: {sentence} {url or ''}".strip(), "blocks": blocks}


def slack_message(alert: dict[str, Any], event: str) -> dict[str, Any]:
    """``text`` (notification fallback) and Block Kit ``blocks`` for one alert event."""
    if alert.get("kind") in _HEALTH_KINDS:  # run health: one sentence with the deep link
        return _health_slack(alert, event)
    head = _headline(alert, event)
    emoji = ":white_check_mark:" if event == "resolved" else ":rotating_light:"
    d = alert.get("details") or {}
    unit = d.get("unit", "")
    fields = [
        {"type": "mrkdwn", "text": f"*Metric*\n{_esc(_name(alert['metric']))}"},
        {"type": "mrkdwn", "text": f"*Before → after*\n{format_value(alert.get('before'), unit)} → "
                                   f"{format_value(alert.get('after'), unit)}"},
        {"type": "mrkdwn", "text": f"*Change*\n{100 * (alert.get('change') or 0):+.1f}%"},
        {"type": "mrkdwn", "text": "*Significance*\n" + (f"p = {alert['significance']:.3g}"
                                                           if alert.get("significance") is not None
                                                           else "persistent over the run")},
    ]
    why = explain_alert(alert, slack=True)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": f"{'Resolved' if event == 'resolved' else 'Regression'}"
                                                                  f" · fleetscope", "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{emoji} *{head}*"}},
        {"type": "section", "fields": fields},
        {"type": "section", "text": {"type": "mrkdwn", "text": _context(alert)}},
    ]
    if why:  # after the context block: blocks[3] stays the context
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*Why:* {why}"}})
    url = alert.get("url")
    if url and url.startswith("http"):
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in fleetscope"}, "url": url},
        ]})
    blocks.append({"type": "context", "elements": [
        {"type": "mrkdwn", "text": f"alert #{alert['id']} · {alert['kind']} · state {alert['state']}"
                                   + (f" · <{url}|{url}>" if url else "")},
    ]})
    return {"text": f"{head}{' — ' + why if why else ''} {url or ''}".strip(), "blocks": blocks}


def webhook_payload(alert: dict[str, Any], event: str) -> dict[str, Any]:
    """The generic webhook's JSON body: the event, a one-line summary, the explanation sentence and the
    alert as the API shows it."""
    if alert.get("kind") in _HEALTH_KINDS:
        return {"event": event, "summary": _health_sentence(alert, event), "explanation": None, "alert": alert}
    return {"event": event, "summary": _headline(alert, event), "explanation": explain_alert(alert), "alert": alert}


#: alert kinds Alertmanager gets as ``severity="critical"`` (a run stopped); the rest are ``warning``
CRITICAL_KINDS = frozenset({"hang", "failure", "node_lost"})
#: the most firing alerts re-sent to Alertmanager (the oldest are forgotten first)
_MAX_AM_FIRING = 5000


def _label(v: Any, n: int = 256) -> str:
    return "" if v is None else str(v)[:n]


def alertmanager_alert(alert: dict[str, Any], event: str, *, run: tuple[str, str | None] | None = None,
                       generator_url: str | None = None) -> dict[str, Any]:
    """One alert in Alertmanager's v2 form (``POST /api/v2/alerts`` takes a list of these): labels that
    identify it (``alertname``, ``severity``, ``kind``, ``metric``, ``run``, ``family``, ``alert_id``),
    annotations (``summary``, ``description``, ``runbook_url``: the deep link), ``startsAt``, ``endsAt``
    when resolved, and ``generatorURL``. ``run`` is (name, family) of the alert's run."""
    import datetime as dt

    d = alert.get("details") or {}
    kind = str(alert.get("kind") or "alert")
    name, family = run if run is not None else (None, None)
    labels = {
        "alertname": "Fleetscope" + "".join(p.capitalize() for p in kind.split("_")),
        "severity": "critical" if kind in CRITICAL_KINDS else "warning",
        "service": "fleetscope",
        "kind": kind,
        "metric": _label(alert.get("metric")),
        "run": _label(name),
        "family": _label(family or d.get("family")),
        "alert_id": _label(alert.get("id")),
    }
    url = alert.get("url") if str(alert.get("url") or "").startswith("http") else None
    summary = _health_sentence(alert, event) if kind in _HEALTH_KINDS else _headline_plain(alert, event)
    annotations = {"summary": _label(summary, 1000),
                   "description": _label(explain_alert(alert) or summary, 4000)}
    if url:
        annotations["runbook_url"] = url
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    out: dict[str, Any] = {"labels": {k: v for k, v in labels.items() if v != ""}, "annotations": annotations,
                           "startsAt": alert.get("created_at") or now,
                           "generatorURL": url or generator_url or ""}
    if event == "resolved":
        out["endsAt"] = alert.get("resolved_at") or now
    return out


def _headline_plain(alert: dict[str, Any], event: str) -> str:
    try:
        return _headline(alert, event).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    except Exception:  # noqa: BLE001 - an alert of a kind without before/after (hang, failure)
        return f"{alert.get('kind')} alert #{alert.get('id')}"


class Notifier:
    """Posts alert events to Slack, a generic webhook and/or Alertmanager from a background thread."""

    def __init__(self, *, slack_webhook_url: str | None = None, webhook_url: str | None = None,
                 alertmanager_url: str | None = None, run_info: Any = None, generator_url: str | None = None,
                 alertmanager_resend_s: float = 60.0,
                 timeout_s: float = 5.0, retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 queue_size: int = 1000, log_interval_s: float = 60.0) -> None:
        REDACT.add(slack_webhook_url, "slack webhook")
        REDACT.add(webhook_url, "alert webhook")
        REDACT.add(alertmanager_url, "alertmanager", whole=False)  # only its credentials, if it has any
        guard_loggers()
        #: delivery failures and drops: one line per sink per ``log_interval_s``
        self._log_throttle = Throttle(log_interval_s)
        self.slack_webhook_url = slack_webhook_url
        self.webhook_url = webhook_url
        self.alertmanager_url = alertmanager_url.rstrip("/") if alertmanager_url else None
        #: ``run_info(run_id) -> (name, family) | None`` for Alertmanager's labels
        self.run_info = run_info
        self.generator_url = generator_url
        self.alertmanager_resend_s = alertmanager_resend_s
        self._am_firing: dict[Any, dict[str, Any]] = {}
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._q: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failed = 0
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.slack_webhook_url or self.webhook_url or self.alertmanager_url)

    def notify(self, alert: dict[str, Any], event: str) -> None:
        """Queue one alert event for delivery (never blocks, never raises)."""
        if not self.enabled:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fleetscope-notifier", daemon=True)
            self._thread.start()
        try:
            self._q.put_nowait((event, alert))
        except queue.Full:
            self.dropped += 1
            log_throttled(log, logging.WARNING, "queue-full", "alert notification queue full: dropped alert %s "
                          "(%d dropped so far)", alert.get("id"), self.dropped, throttle=self._log_throttle)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass
            self._thread.join(timeout)

    def _loop(self) -> None:
        import time

        next_resend = time.monotonic() + self.alertmanager_resend_s
        while True:
            try:
                item = self._q.get(timeout=max(0.05, next_resend - time.monotonic()) if self._am_firing else None)
            except queue.Empty:  # time to remind Alertmanager of what still fires
                next_resend = time.monotonic() + self.alertmanager_resend_s
                self._deliver("alertmanager", self._post_alertmanager_firing, {"id": "firing"}, "fired")
                continue
            if item is None or self._stop.is_set() and self._q.empty():
                return
            event, alert = item
            if self.slack_webhook_url:
                self._deliver("slack", self._post_slack, alert, event)
            if self.webhook_url:
                self._deliver("webhook", self._post_webhook, alert, event)
            if self.alertmanager_url:
                self._deliver("alertmanager", self._post_alertmanager, alert, event)

    def _deliver(self, target: str, send: Any, alert: dict[str, Any], event: str) -> None:
        guard_loggers()  # loggers the HTTP libraries created since (cheap; deliveries are rare)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                status, retry_after = send(alert, event)
            except Exception as e:  # noqa: BLE001 - connection errors and the like: retry
                status, retry_after = None, None
                # an exception's text may quote the URL (an invalid URL, a proxy error): redacted
                err: Any = REDACT.redact(f"{type(e).__name__}: {e}")
            else:
                err = f"HTTP {status}"
            if status is not None and 200 <= status < 300:
                self.sent += 1
                return
            retryable = status is None or status == 429 or status >= 500
            if not retryable or attempt == self.retries or self._stop.is_set():
                break
            wait = min(self.max_backoff_s, retry_after if retry_after else delay * (1 + random.random()))
            if self._stop.wait(wait):
                break
            delay = min(self.max_backoff_s, delay * 2)
        self.failed += 1
        log_throttled(log, logging.WARNING, target, "could not deliver alert %s to %s: %s (%d failed deliveries "
                      "so far)", alert.get("id"), target, err, self.failed, throttle=self._log_throttle)

    def _post_slack(self, alert: dict[str, Any], event: str) -> tuple[int, float | None]:
        from slack_sdk.webhook import WebhookClient

        msg = slack_message(alert, event)
        # our logger (its own chatter off, redacted regardless) and no retry handlers: _deliver retries
        client = WebhookClient(self.slack_webhook_url or "", timeout=int(max(1, self.timeout_s)), logger=slack_log,
                               retry_handlers=[])
        resp = client.send(text=msg["text"], blocks=msg["blocks"])
        ra = resp.headers.get("Retry-After") if resp.headers else None
        return resp.status_code, _float(ra)

    def _post_webhook(self, alert: dict[str, Any], event: str) -> tuple[int, float | None]:
        import httpx

        r = httpx.post(self.webhook_url or "", json=webhook_payload(alert, event), timeout=self.timeout_s)
        return r.status_code, _float(r.headers.get("Retry-After"))

    def _am_payload(self, alert: dict[str, Any], event: str) -> dict[str, Any]:
        run = None
        if self.run_info is not None and alert.get("run_id") is not None:
            try:
                run = self.run_info(int(alert["run_id"]))
            except Exception:  # noqa: BLE001 - the database blinked: send without the run's name
                log.debug("alertmanager: run %s not looked up", alert.get("run_id"), exc_info=True)
        return alertmanager_alert(alert, event, run=run, generator_url=self.generator_url)

    def _post_alertmanager(self, alert: dict[str, Any], event: str) -> tuple[int, float | None]:
        key = alert.get("id")
        payload = self._am_payload(alert, event)
        status, retry_after = self._post_am([payload])
        if 200 <= status < 300:
            if event == "resolved":
                self._am_firing.pop(key, None)
            else:
                self._am_firing.pop(key, None)
                self._am_firing[key] = payload
                while len(self._am_firing) > _MAX_AM_FIRING:
                    self._am_firing.pop(next(iter(self._am_firing)))
        return status, retry_after

    def _post_alertmanager_firing(self, _alert: dict[str, Any], _event: str) -> tuple[int, float | None]:
        if not self._am_firing:
            return 200, None
        return self._post_am(list(self._am_firing.values()))

    def _post_am(self, alerts: list[dict[str, Any]]) -> tuple[int, float | None]:
        import httpx

        r = httpx.post(f"{self.alertmanager_url}/api/v2/alerts", json=alerts, timeout=self.timeout_s)
        return r.status_code, _float(r.headers.get("Retry-After"))


def _float(v: Any) -> float | None:
    try:
        return float(v[0] if isinstance(v, list) else v)
    except (TypeError, ValueError, IndexError):
        return None
