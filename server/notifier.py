"""Alert delivery: Slack (incoming webhook, Block Kit), a generic JSON webhook and Alertmanager's v2 API.

Each sink has its own worker thread and bounded queue (a dead Slack never delays Alertmanager), with
capped exponential backoff and jitter on connection errors, 429 and 5xx (honouring Retry-After).
Nothing here can block or fail the caller: a full queue drops the hint and counts it; a dead receiver
costs retries, then a log line and a counter, per sink.

In the server, delivery is driven by the alerts table (``store.alert_deliveries``: what each sink was
last told about each alert): every transition — raised, acknowledged, resolved by hand or by recovery,
reopened — reaches every sink once, whichever instance made it, across restarts; a failed delivery is
tried again later. Alertmanager is told each alert's latest state: an active alert is re-posted every
``alertmanager_resend_s`` with ``endsAt`` ahead (it forgets one not re-sent), a resolved one is posted
once with ``endsAt`` = when it resolved — never while the table says it fires.

A webhook URL is a secret (Slack's path *is* the credential). No log line at any level shows one: the
notifier's own lines name the sink (``slack``, ``webhook``, ``alertmanager``), and a filter attached to
each logger that could print a request URL while we send — ours, the Slack client's (our own logger,
its chatter off), ``httpx``, ``httpcore.*``, ``urllib3.*`` — rewrites the URL, its path and query and any
``user:password@`` in every record to a placeholder. Repeated delivery failures log one line per sink
per ``log_interval_s`` (``server.logutil``).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

from .analysis.explain import explanation, format_bandwidth, metric_label
from .logutil import Throttle, log_throttled

__all__ = ["Notifier", "slack_message", "webhook_payload", "alertmanager_alert", "format_value", "explain_alert",
           "CRITICAL_KINDS", "EVENTS"]

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
    "device": "GPU trouble",
}
_METRIC_NAME = {
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "step_s": "step time",
    "mfu": "MFU",
    "straggler_slowdown": "slowest rank's work vs the median rank",
    "node_network_slowdown": "node's collectives vs the median rank",
    "device_trouble_ranks": "ranks whose GPU logged errors or throttled for heat",
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
        return format_bandwidth(v)
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


#: the Slack header of a fired alert, per kind (a straggler is not posted as a "Regression")
_HEADER = {"run_series": "Regression", "benchmark": "Regression", "step_time_shift": "Step time shift",
           "straggler": "Straggler", "slow_node": "Slow node", "device": "GPU trouble"}
#: the events the notifier delivers: an alert raised, reopened (its recovery did not last), acknowledged, resolved
EVENTS = ("fired", "reopened", "acknowledged", "resolved")


def _resolution(alert: dict[str, Any]) -> dict[str, Any]:
    r = (alert.get("details") or {}).get("resolution")
    return r if isinstance(r, dict) else {}


def _event_title(alert: dict[str, Any], event: str, what: str) -> str:
    """What a message calls this event of an alert whose kind is titled ``what``."""
    if event == "resolved":
        return "Resolved by hand" if _resolution(alert).get("by") == "hand" else "Resolved"
    if event == "acknowledged":
        return "Acknowledged"
    if event == "reopened":
        return f"Reopened: {what}"
    return what


def _emoji(event: str) -> str:
    return {"resolved": ":white_check_mark:", "acknowledged": ":eyes:"}.get(event, ":rotating_light:")


def _headline(alert: dict[str, Any], event: str) -> str:
    details = alert.get("details") or {}
    unit = details.get("unit", "")
    metric = _esc(_name(alert["metric"]))
    change = alert.get("change")
    ch = f"{100 * change:+.1f}%" if change is not None else ""
    what = _KIND_TITLE.get(alert["kind"], alert["kind"])
    state = _event_title(alert, event, what)
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
    elif alert["kind"] == "device":
        parts.append(f"*Run:* {alert.get('run_id')} — {_esc(d.get('text') or '')}")
        if d.get("nodes"):
            parts.append(f"*Nodes:* {', '.join(_code(n) for n in d['nodes'][:8])}")
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


def _health_title(alert: dict[str, Any]) -> str:
    """A run-health alert's title: a ``hang`` alert of a run that stalled (no wavefront finding) is "Run
    stalled", of one hung in a collective "Run hung"."""
    if alert.get("kind") == "hang" and (alert.get("details") or {}).get("state") == "stalled":
        return "Run stalled"
    return _HEALTH_KINDS.get(alert["kind"], alert["kind"])


def _health_sentence(alert: dict[str, Any], event: str) -> str:
    """A run-health alert (hang, node_lost, failure) in one sentence: its finding, or how it resolved."""
    d = alert.get("details") or {}
    if event == "resolved":
        run = d.get("run_name") or alert.get("run_id")
        how = _resolution(alert)
        if alert.get("kind") == "failure":
            if how.get("by") == "hand":
                return f"the failure of run {run} was resolved by hand"
            note = how.get("note")
            return f"the failure of run {run} was resolved" + (f": {note}" if note else "")
        if how.get("by") == "hand":
            what = "stall" if d.get("state") == "stalled" else "node loss" if alert.get("kind") == "node_lost" else "hang"
            return f"the {what} of run {run} was resolved by hand"
        return f"run {run} resumed: steps finish again"
    return str(d.get("finding") or f"run {alert.get('run_id')}: {alert['kind']}")


def _health_slack(alert: dict[str, Any], event: str) -> dict[str, Any]:
    sentence = _esc(_health_sentence(alert, event))
    title = _event_title(alert, event, _health_title(alert))
    url = alert.get("url")
    link = f" <{url}|open in fleetscope>" if url and url.startswith("http") else ""
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": f"{title} · fleetscope", "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{_emoji(event)} {sentence}{link}"}},
    ]
    if url and url.startswith("http"):
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in fleetscope"}, "url": url}]})
    blocks.append({"type": "context", "elements": [
        {"type": "mrkdwn", "text": f"alert #{alert['id']} · {alert['kind']} · state {alert['state']}"}]})
    return {"text": f"{title}: {sentence} {url or ''}".strip(), "blocks": blocks}


def slack_message(alert: dict[str, Any], event: str) -> dict[str, Any]:
    """``text`` (notification fallback) and Block Kit ``blocks`` for one alert event (``EVENTS``); the
    header names the kind (Regression, Straggler, Slow node, Step time shift; Run stalled, Run hung, Node
    lost, Run failed) or the event (Acknowledged, Resolved, Resolved by hand, Reopened: …)."""
    if alert.get("kind") in _HEALTH_KINDS:  # run health: one sentence with the deep link
        return _health_slack(alert, event)
    head = _headline(alert, event)
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
    header = _event_title(alert, event, _HEADER.get(alert["kind"], "Regression"))
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": f"{header} · fleetscope", "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{_emoji(event)} *{head}*"}},
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
    """The generic webhook's JSON body: the event (``EVENTS``), a one-line summary, the explanation
    sentence and the alert as the API shows it."""
    if alert.get("kind") in _HEALTH_KINDS:
        return {"event": event, "summary": _health_sentence(alert, event), "explanation": None, "alert": alert}
    return {"event": event, "summary": _headline(alert, event), "explanation": explain_alert(alert), "alert": alert}


#: alert kinds Alertmanager gets as ``severity="critical"`` (a run stopped); the rest are ``warning``
CRITICAL_KINDS = frozenset({"hang", "failure", "node_lost"})
#: the most firing alerts a notifier without a database re-sends to Alertmanager (the oldest are forgotten first)
_MAX_AM_FIRING = 5000


def _label(v: Any, n: int = 256) -> str:
    return "" if v is None else str(v)[:n]


def alertmanager_alert(alert: dict[str, Any], event: str, *, run: tuple[str, str | None] | None = None,
                       generator_url: str | None = None, ends_at: str | None = None) -> dict[str, Any]:
    """One alert in Alertmanager's v2 form (``POST /api/v2/alerts`` takes a list of these): labels that
    identify it (``alertname``, ``severity``, ``kind``, ``metric``, ``run``, ``family``, ``alert_id`` — the
    same for the alert's whole life: Alertmanager identifies an alert by its labels), annotations
    (``summary``, ``description``, ``runbook_url``: the deep link; ``acknowledged_at`` once acknowledged),
    ``startsAt``, ``endsAt`` — when resolved (≤ now), else ``ends_at`` if given (a firing alert's re-post:
    in the future) — and ``generatorURL``. ``run`` is (name, family) of the alert's run."""
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
    told = "resolved" if event == "resolved" else "fired"
    summary = _health_sentence(alert, told) if kind in _HEALTH_KINDS else _headline_plain(alert, told)
    annotations = {"summary": _label(summary, 1000),
                   "description": _label(explain_alert(alert) or summary, 4000)}
    if url:
        annotations["runbook_url"] = url
    if event != "resolved" and alert.get("acknowledged_at"):
        annotations["acknowledged_at"] = _label(alert["acknowledged_at"])
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    out: dict[str, Any] = {"labels": {k: v for k, v in labels.items() if v != ""}, "annotations": annotations,
                           "startsAt": alert.get("created_at") or now,
                           "generatorURL": url or generator_url or ""}
    if event == "resolved":
        out["endsAt"] = alert.get("resolved_at") or now
    elif ends_at is not None:
        out["endsAt"] = ends_at
    return out


def _headline_plain(alert: dict[str, Any], event: str) -> str:
    try:
        return _headline(alert, event).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    except Exception:  # noqa: BLE001 - an alert of a kind without before/after (hang, failure)
        return f"{alert.get('kind')} alert #{alert.get('id')}"


_TICK = object()  # a sink worker's wake-up without a hint: time to scan


class _Sink:
    """One destination: its own bounded queue of hints and its own thread, so a dead sink never delays
    another. Counts what it sent, what failed (after the retries) and the hints it dropped (queue full)."""

    def __init__(self, owner: Notifier, name: str, send: Any, queue_size: int) -> None:
        self.n = owner
        self.name = name
        self.send = send  # body -> (HTTP status, Retry-After); Alertmanager's body: a list of alerts
        self.q: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.backlog = 0  # deliveries due that the last scan found (database mode)
        self.down_until = 0.0  # monotonic: after a failed delivery the sink rests (database mode)
        self.am_firing: dict[Any, dict[str, Any]] = {}  # without a database: what Alertmanager is re-sent

    @property
    def stateful(self) -> bool:
        """Alertmanager keeps a state per alert (its latest is posted, firing ones re-posted); Slack and
        the webhook get every transition as a message."""
        return self.name == "alertmanager"

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=f"fleetscope-notifier-{self.name}", daemon=True)
                self.thread.start()

    def offer(self, alert: dict[str, Any], event: str) -> None:
        try:
            self.q.put_nowait((event, alert))
        except queue.Full:
            self.dropped += 1
            log_throttled(log, logging.WARNING, f"queue-full:{self.name}", "alert queue of %s full: dropped alert %s "
                          "(%d dropped so far; %s)", self.name, alert.get("id"), self.dropped,
                          "the next scan of the alerts table delivers it" if self.n.engine is not None else "lost",
                          throttle=self.n._log_throttle)

    # ------------------------------------------------------------------------------------ the thread

    def _every(self) -> float:
        """How often this sink looks for due work: the table scan (Alertmanager: at least twice per re-send
        interval); without a database, Alertmanager's re-send interval."""
        n = self.n
        if n.engine is None:
            return max(0.05, n.alertmanager_resend_s)
        return n.scan_s if not self.stateful else min(n.scan_s, max(0.05, n.alertmanager_resend_s / 2))

    def _loop(self) -> None:
        n = self.n
        # with the table: scan at once (what a restart, or another instance, left undelivered); without it
        # the first re-send to Alertmanager is one interval away
        last = -1e18 if n.engine is not None else time.monotonic()
        while True:
            if n.engine is not None or (self.stateful and self.am_firing):
                timeout: float | None = max(0.0, last + self._every() - time.monotonic())
            else:
                timeout = None
            try:
                item = self.q.get(timeout=timeout)
            except queue.Empty:
                item = _TICK
            if item is None or n._stop.is_set():
                return
            hints = [] if item is _TICK else [item]
            while len(hints) < 256:  # what else is queued: one claim for the lot
                try:
                    more = self.q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                if more is not _TICK:
                    hints.append(more)
            try:
                if n.engine is None:
                    if self.stateful and not self.am_firing:
                        last = time.monotonic()  # the first re-send is one interval after the first post
                    self._direct(hints)
                    if self.stateful and self.am_firing and time.monotonic() >= last + self._every():
                        last = time.monotonic()
                        self._deliver(list(self.am_firing), lambda: list(self.am_firing.values()))
                    continue
                if hints:
                    self._hinted(hints)
                if time.monotonic() >= last + self._every():
                    last = time.monotonic()
                    self._scan()
            except Exception as e:  # noqa: BLE001 - the database blinked: the next scan catches up
                log_throttled(log, logging.WARNING, f"db:{self.name}", "alert delivery to %s: the alerts table could "
                              "not be read or written (%s: %s); retrying at the next scan", self.name, type(e).__name__,
                              REDACT.redact(str(e).splitlines()[0][:200]) if str(e) else "",
                              throttle=n._log_throttle)

    # ------------------------------------------------------------------------------------ delivery

    def _deliver(self, ids: list[Any], build: Any) -> bool | None:
        """Send ``build()`` (built once: a retry posts the same body) with capped exponential backoff and
        jitter on connection errors, 429 and 5xx (honouring Retry-After). True: sent; False: failed (counted,
        logged once per sink per interval); None: the notifier is closing."""
        n = self.n
        guard_loggers()  # loggers the HTTP libraries created since (cheap; deliveries are rare)
        body = build()
        delay = n.backoff_s
        err: Any = None
        for attempt in range(n.retries + 1):
            try:
                status, retry_after = self.send(body)
            except Exception as e:  # noqa: BLE001 - connection errors and the like: retry
                status, retry_after = None, None
                # an exception's text may quote the URL (an invalid URL, a proxy error): redacted
                err = REDACT.redact(f"{type(e).__name__}: {e}")
            else:
                err = f"HTTP {status}"
            if status is not None and 200 <= status < 300:
                self.sent += 1
                return True
            retryable = status is None or status == 429 or status >= 500
            if not retryable or attempt == n.retries or n._stop.is_set():
                break
            wait = min(n.max_backoff_s, retry_after if retry_after else delay * (1 + random.random()))
            if n._stop.wait(wait):
                return None
            delay = min(n.max_backoff_s, delay * 2)
        if n._stop.is_set():
            return None
        self.failed += 1
        what = ", ".join(str(i) for i in ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        log_throttled(log, logging.WARNING, self.name, "could not deliver alert %s to %s: %s (%d failed deliveries "
                      "so far)", what, self.name, err, n.failed, throttle=n._log_throttle)
        return False

    def _payload(self, alert: dict[str, Any], event: str, run: tuple[str, str | None] | None | bool = False) -> Any:
        """The body one event of one alert is sent as: Slack's message, the webhook's JSON, or (Alertmanager)
        the alert in v2 form, with ``endsAt`` in the future while it is active."""
        if self.name == "slack":
            return slack_message(alert, event)
        if self.name == "webhook":
            return webhook_payload(alert, event)
        import datetime as dt

        ends = None
        if event != "resolved":
            ends = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=self.n.alertmanager_ends_s)).isoformat()
        if run is False:
            return self.n._am_payload(alert, event, ends_at=ends)
        return alertmanager_alert(alert, event, run=run if isinstance(run, tuple) else None, generator_url=self.n.generator_url,
                                  ends_at=ends)

    def _direct(self, hints: list[tuple[str, dict[str, Any]]]) -> None:
        """Deliver what was handed over as it is (no database, or an alert not in the table)."""
        for event, alert in hints:
            if self.stateful:
                body = self._payload(alert, event)
                if self._deliver([alert.get("id")], lambda b=body: [b]) and self.n.engine is None:
                    key = alert.get("id")
                    self.am_firing.pop(key, None)
                    if event != "resolved":
                        self.am_firing[key] = body
                        while len(self.am_firing) > _MAX_AM_FIRING:
                            self.am_firing.pop(next(iter(self.am_firing)))
            else:
                self._deliver([alert.get("id")], lambda a=alert, e=event: self._payload(a, e))

    # ------------------------------------------------------------------------------------ database mode

    def _hinted(self, hints: list[tuple[str, dict[str, Any]]]) -> None:
        """Transitions this process just made: deliver what the table says is due for them, now."""
        from .store import alert_deliveries as ds

        n = self.n
        by_id: dict[int, tuple[str, dict[str, Any]]] = {}
        loose = []
        for event, alert in hints:
            aid = alert.get("id")
            if isinstance(aid, int) and not isinstance(aid, bool) and 0 < aid < 2**31:
                by_id[aid] = (event, alert)
            else:
                loose.append((event, alert))
        if loose:
            self._direct(loose)
        if not by_id or time.monotonic() < self.down_until:
            return  # resting after a failure: the scan delivers them when it is over
        for rows, missing in self._claimed(sorted(by_id)):
            if missing:  # handed an alert that is not in the table (a test, a tool): delivered as given
                ds.forget(n.engine, self.name, missing)
                self._direct([by_id[i] for i in missing])
            if not self._process(rows):
                return

    def _claimed(self, ids: list[int]) -> Any:
        """Claim and load ``ids`` a chunk at a time — as many as one lease surely covers (Alertmanager: one
        post) — yielding (rows, ids claimed that have no alert)."""
        from .store import alert_deliveries as ds

        n = self.n
        step = 500 if self.stateful else 20
        for i in range(0, len(ids), step):
            claimed = ds.claim(n.engine, self.name, ids[i:i + step], n.instance, n.lease_s)
            rows = ds.load(n.engine, self.name, claimed)
            yield rows, sorted(set(claimed) - {int(d.alert["id"]) for d in rows})

    def _scan(self) -> None:
        """What is due for this sink in the table — whoever made the transition, whenever: deliver it."""
        from .store import alert_deliveries as ds

        n = self.n
        n._scans += 1
        if n._scans % 200 == 1:
            ds.forget_missing(n.engine)
        if time.monotonic() < self.down_until:
            return
        ids = ds.due(n.engine, self.name, horizon_s=n.horizon_s,
                     resend_s=n.alertmanager_resend_s if self.stateful else None, limit=500)
        self.backlog = len(ids)
        for rows, missing in self._claimed(ids):
            if missing:
                ds.forget(n.engine, self.name, missing)
            if not self._process(rows):
                return

    def _todo(self, d: Any) -> tuple[list[tuple[int, str, str]], int, str]:
        """(transitions to tell: (seq, event, state), the alert's latest seq, its state) of one row."""
        a = d.alert
        reopens = int((a.get("details") or {}).get("reopens") or 0)
        base = 3 * reopens
        trans = [(base, "reopened" if reopens else "fired", "firing", d.t_fire)]
        if d.t_ack is not None:
            trans.append((base + 1, "acknowledged", "acknowledged", d.t_ack))
        if a["state"] == "resolved":
            trans.append((base + 2, "resolved", "resolved", d.t_res if d.t_res is not None else d.now))
        latest = trans[-1][0]
        fresh = [(s, e, st) for s, e, st, at in trans if s > d.told_seq and d.now - at <= self.n.horizon_s]
        return fresh, latest, a["state"]

    def _process(self, rows: list[Any]) -> bool:
        """Deliver what is due of these claimed rows; False when the sink failed (it rests) or we close."""
        from .store import alert_deliveries as ds

        n = self.n
        if not rows:
            return True
        if self.stateful:
            return self._process_state(rows)
        pending = [int(d.alert["id"]) for d in rows]
        for d in rows:
            aid = int(d.alert["id"])
            todo, latest, state = self._todo(d)
            ok: bool | None = True
            for seq, event, st in todo:
                alert = {**d.alert}
                ok = self._deliver([aid], lambda a=alert, e=event: self._payload(a, e))
                if not ok:
                    break
                if not ds.record_sent(n.engine, self.name, [(aid, seq, st)], n.instance, release=False):
                    break  # another instance took it over (our lease ran out): it goes on from what we told
            if ok is None:
                ds.release(n.engine, self.name, pending, n.instance)
                return False
            if ok is False:
                rest = [i for i in pending if i != aid]
                self._rest(d.attempts)
                ds.record_failed(n.engine, self.name, [aid], n.instance, base_s=n.redeliver_s, cap_s=n.redeliver_max_s)
                ds.defer(n.engine, self.name, rest, n.instance, self.down_until - time.monotonic())
                return False
            if d.told_seq < latest and not todo:  # only stale transitions (older than the horizon): skipped
                ds.record_sent(n.engine, self.name, [(aid, latest, state)], n.instance, release=False)
            pending.remove(aid)
            ds.release(n.engine, self.name, [aid], n.instance)
        return True

    def _process_state(self, rows: list[Any]) -> bool:
        """Alertmanager: one post of each alert's current state — a transition not told, or a re-send of
        an active alert — in batches; resolved: ``endsAt`` = when it resolved, else ``endsAt`` ahead."""
        from .store import alert_deliveries as ds

        n = self.n
        post: list[tuple[int, int, str, dict[str, Any]]] = []
        skip: list[tuple[int, int, str]] = []
        idle: list[int] = []
        for d in rows:
            aid = int(d.alert["id"])
            todo, latest, state = self._todo(d)
            active = state != "resolved"
            resend = active and (d.told_age_s is None or d.told_age_s >= n.alertmanager_resend_s)
            if todo or resend:
                event = "resolved" if not active else ("acknowledged" if state == "acknowledged" else "fired")
                run = (d.alert.get("run_name"), d.alert.get("run_family")) if d.alert.get("run_name") else None
                post.append((aid, latest, state, self._payload(d.alert, event, run=run)))
            elif d.told_seq < latest:
                skip.append((aid, latest, state))
            else:
                idle.append(aid)
        if skip:
            ds.record_sent(n.engine, self.name, skip, n.instance)
        if idle:
            ds.release(n.engine, self.name, idle, n.instance)
        for i in range(0, len(post), 500):
            chunk = post[i:i + 500]
            ids = [c[0] for c in chunk]
            ok = self._deliver(ids, lambda ch=chunk: [c[3] for c in ch])
            if ok:
                ds.record_sent(n.engine, self.name, [(c[0], c[1], c[2]) for c in chunk], n.instance)
                continue
            rest = [c[0] for c in post[i + 500:]]
            if ok is None:
                ds.release(n.engine, self.name, ids + rest, n.instance)
                return False
            self._rest(min(d.attempts for d in rows))
            ds.record_failed(n.engine, self.name, ids, n.instance, base_s=n.redeliver_s, cap_s=n.redeliver_max_s)
            ds.defer(n.engine, self.name, rest, n.instance, self.down_until - time.monotonic())
            return False
        return True

    def _rest(self, attempts: int) -> None:
        """After a failed delivery: no delivery to this sink for a while (``redeliver_s`` × 2^failures, at
        most ``redeliver_max_s``); what is due then is found by the scan."""
        n = self.n
        self.down_until = time.monotonic() + min(n.redeliver_max_s, n.redeliver_s * 2 ** min(attempts, 20))


class Notifier:
    """Posts alert events to Slack, a generic webhook and/or Alertmanager: one worker thread and one
    bounded queue per sink, so a dead sink never delays another.

    With ``engine`` (the server), delivery is driven by the alerts table: :meth:`notify` is a hint that
    a transition just happened (delivered at once), and each sink's worker also scans the table every
    ``scan_s`` for what is due — a transition a sink was not told (made by any instance, before a
    restart, or whose delivery failed: retried after ``redeliver_s`` × 2^failures, at most
    ``redeliver_max_s``) and, for Alertmanager, active alerts not posted for ``alertmanager_resend_s``
    (re-posted with ``endsAt`` ``alertmanager_ends_s`` ahead). What each sink was told is recorded per
    (alert, sink) in ``alert_deliveries``, under a lease, so each transition reaches each sink once.
    Transitions older than ``horizon_s`` are not delivered any more. Without ``engine``, events are sent
    as handed over and Alertmanager's firing alerts are re-sent from memory."""

    def __init__(self, *, slack_webhook_url: str | None = None, webhook_url: str | None = None,
                 alertmanager_url: str | None = None, run_info: Any = None, generator_url: str | None = None,
                 alertmanager_resend_s: float = 60.0, engine: Any = None, scan_s: float = 5.0,
                 horizon_s: float = 86400.0, redeliver_s: float = 15.0, redeliver_max_s: float = 120.0,
                 instance: str | None = None,
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
        #: ``run_info(run_id) -> (name, family) | None`` for Alertmanager's labels (alerts handed over as
        #: they are; the table's own deliveries read the run with the alert)
        self.run_info = run_info
        self.generator_url = generator_url
        self.alertmanager_resend_s = alertmanager_resend_s
        self.engine = engine
        self.scan_s = scan_s
        self.horizon_s = horizon_s
        self.redeliver_s = redeliver_s
        self.redeliver_max_s = redeliver_max_s
        self.instance = (instance or f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:8]}")[:64]
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self._scans = 0
        self.sinks: dict[str, _Sink] = {}
        if slack_webhook_url:
            self.sinks["slack"] = _Sink(self, "slack", self._post_slack, queue_size)
        if webhook_url:
            self.sinks["webhook"] = _Sink(self, "webhook", self._post_webhook, queue_size)
        if self.alertmanager_url:
            self.sinks["alertmanager"] = _Sink(self, "alertmanager", self._post_am, queue_size)

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    @property
    def sent(self) -> int:
        return sum(s.sent for s in self.sinks.values())

    @property
    def failed(self) -> int:
        return sum(s.failed for s in self.sinks.values())

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.sinks.values())

    @property
    def alertmanager_ends_s(self) -> float:
        """How far ahead an active alert's ``endsAt`` is posted: 4 re-send intervals (as Prometheus does),
        so Alertmanager keeps it between re-sends and ends it by itself only if every instance is gone."""
        return 4.0 * max(self.alertmanager_resend_s, self.scan_s)

    @property
    def lease_s(self) -> float:
        """How long a claimed delivery is ours: the longest a delivery with its retries can take, plus slack."""
        waits = sum(min(self.max_backoff_s, self.backoff_s * 2 ** i) * 2 for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits + 10.0

    def stats(self) -> dict[str, dict[str, float]]:
        """Per sink: ``sent``, ``failed``, ``dropped`` (counters), ``queue`` (hints waiting), ``backlog``
        (deliveries due at the last scan of the table)."""
        return {name: {"sent": s.sent, "failed": s.failed, "dropped": s.dropped, "queue": s.q.qsize(),
                       "backlog": s.backlog} for name, s in self.sinks.items()}

    def start(self) -> None:
        """Start every sink's worker (with ``engine``: it delivers what the table holds at once — what a
        previous process left undelivered, firing alerts Alertmanager must be re-sent)."""
        for s in self.sinks.values():
            s.start()

    def wake(self) -> None:
        """Have every started sink's worker look at the table now (and pick up changed intervals)."""
        for s in self.sinks.values():
            if s.thread is not None:
                try:
                    s.q.put_nowait(_TICK)
                except queue.Full:
                    pass

    def notify(self, alert: dict[str, Any], event: str) -> None:
        """Hand one alert event (``EVENTS``) to every sink's queue (never blocks, never raises)."""
        if not self.enabled or self._stop.is_set():
            return
        for s in self.sinks.values():
            s.start()
            s.offer(alert, event)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for s in self.sinks.values():
            try:
                s.q.put_nowait(None)
            except queue.Full:
                pass
        deadline = time.monotonic() + timeout
        for s in self.sinks.values():
            if s.thread is not None:
                s.thread.join(max(0.0, deadline - time.monotonic()))

    def _post_slack(self, msg: dict[str, Any]) -> tuple[int, float | None]:
        from slack_sdk.webhook import WebhookClient

        # our logger (its own chatter off, redacted regardless) and no retry handlers: _deliver retries
        client = WebhookClient(self.slack_webhook_url or "", timeout=int(max(1, self.timeout_s)), logger=slack_log,
                               retry_handlers=[])
        resp = client.send(text=msg["text"], blocks=msg["blocks"])
        ra = resp.headers.get("Retry-After") if resp.headers else None
        return resp.status_code, _float(ra)

    def _post_webhook(self, body: dict[str, Any]) -> tuple[int, float | None]:
        import httpx

        r = httpx.post(self.webhook_url or "", json=body, timeout=self.timeout_s)
        return r.status_code, _float(r.headers.get("Retry-After"))

    def _am_payload(self, alert: dict[str, Any], event: str, *, ends_at: str | None = None) -> dict[str, Any]:
        run = None
        if self.run_info is not None and alert.get("run_id") is not None:
            try:
                run = self.run_info(int(alert["run_id"]))
            except Exception:  # noqa: BLE001 - the database blinked: send without the run's name
                log.debug("alertmanager: run %s not looked up", alert.get("run_id"), exc_info=True)
        return alertmanager_alert(alert, event, run=run, generator_url=self.generator_url, ends_at=ends_at)

    def _post_am(self, alerts: list[dict[str, Any]]) -> tuple[int, float | None]:
        import httpx

        r = httpx.post(f"{self.alertmanager_url}/api/v2/alerts", json=alerts, timeout=self.timeout_s)
        return r.status_code, _float(r.headers.get("Retry-After"))


def _float(v: Any) -> float | None:
    try:
        return float(v[0] if isinstance(v, list) else v)
    except (TypeError, ValueError, IndexError):
        return None
