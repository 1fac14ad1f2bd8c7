"""A small stdlib client of the fleetscope API for the agent's sender thread and ``fleetscope upload``.

It knows what each answer means: 2xx delivered; 5xx, 408, 425, 429, refused/reset connections,
timeouts and garbage are retried with capped, jittered exponential backoff honouring ``Retry-After``
until a deadline; 413 splits the batch in halves; 400/422 reject the data (dropped, counted, logged
once; when the server names the bad record, the rest is resent without it, a few times at most);
401/403 and anything else keep the data (the caller spools it). Never logs the token.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetscope import __version__
from fleetscope.wire import SECTIONS, encode_batch

__all__ = ["Client", "Result", "ConnectionFailed", "LogOnce", "batch_records", "split_batch"]

logger = logging.getLogger(__name__)

_MAX_BODY = 1 << 20  # read at most this much of an answer; the API's answers are small
_MIN_ATTEMPT_S = 0.05  # do not start a request with less time than this left
_MAX_SALVAGE = 8  # a 422 naming one bad record: resend without it, at most this many times per batch
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_SECTION_KEYS = (*SECTIONS, "ranks", "events", "records")


class ConnectionFailed(Exception):
    """No valid HTTP answer: refused, reset, timed out, or not HTTP at all."""


class LogOnce:
    """Log each distinct key once per process (so a flapping server cannot flood the job's log)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._seen: set[str] = set()

    def __call__(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self._log.log(level, msg, *args, exc_info=exc_info)


@dataclass
class _Response:
    status: int
    headers: dict[str, str]
    body: bytes


class _Connection:
    """One keep-alive HTTP(S) connection to the server, reopened after any failure."""

    def __init__(self, base_url: str) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(
                f"server URL must be http(s)://host[:port][/prefix], got {_safe_url(base_url)!r}"
            )
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port
        self._prefix = u.path.rstrip("/")
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: bytes, headers: dict[str, str], timeout: float
    ) -> _Response:
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, self._port, timeout=timeout)
            conn = self._conn
            try:
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.request(method, self._prefix + path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read(_MAX_BODY)
                if r.will_close or not r.isclosed():
                    self.close()  # the server closes it, or we did not read it all: do not reuse
                return _Response(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
            except (OSError, http.client.HTTPException, ValueError) as e:
                self.close()
                if attempt == 0 and reused and isinstance(e, _STALE):
                    continue  # the server dropped an idle keep-alive connection: one fresh try
                raise ConnectionFailed(f"{type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def abort(self) -> None:
        """Break an in-flight request from another thread (shutdown makes the blocked call return)."""
        conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def _safe_url(url: str) -> str:
    """The URL without user:password (never log credentials)."""
    u = urllib.parse.urlsplit(url)
    netloc = u.hostname or ""
    if u.port:
        netloc += f":{u.port}"
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, "", ""))


def batch_records(batch: dict[str, Any]) -> int:
    """Records in a wire batch (columnar sections, ranks, events, row-form records)."""
    n = 0
    for key in _SECTION_KEYS:
        v = batch.get(key)
        if not v:
            continue
        if isinstance(v, dict):
            n += len(next(iter(v.values()), ()))
        else:
            n += len(v)
    return n


def split_batch(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two batches holding the first and the second half of ``batch``'s records, order kept."""
    k = batch_records(batch) // 2
    a = {key: v for key, v in batch.items() if key not in _SECTION_KEYS}
    b = dict(a)
    for key in _SECTION_KEYS:
        v = batch.get(key)
        if not v:
            continue
        if isinstance(v, dict):
            m = len(next(iter(v.values()), []))
            take = min(m, k)
            if take:
                a[key] = {c: col[:take] for c, col in v.items()}
            if take < m:
                b[key] = {c: col[take:] for c, col in v.items()}
        else:
            m = len(v)
            take = min(m, k)
            if take:
                a[key] = v[:take]
            if take < m:
                b[key] = v[take:]
        k -= take
    return a, b


@dataclass
class Result:
    """What became of one delivery: records sent, dropped by reason, and payloads still to deliver."""

    sent: int = 0
    batches: int = 0
    finished: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    unsent: list[tuple[dict[str, Any], int]] = field(
        default_factory=list
    )  # ({"batch": b} | {"finish": s}, records)
    reason: str | None = None  # why unsent: "unreachable", "unauthorized", "rejected"

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


def _retry_after(resp: _Response | None) -> float | None:
    v = resp.headers.get("retry-after") if resp is not None else None
    if not v:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(v).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _detail(resp: _Response) -> str:
    try:
        d = json.loads(resp.body).get("detail")
        s = json.dumps(d) if not isinstance(d, str) else d
    except Exception:
        s = resp.body[:200].decode("utf-8", "replace")
    return s[:500]


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 425, 429)


class Client:
    """Registers runs, sends batches and finishes, with the retry policy of the module docstring."""

    def __init__(
        self,
        server: str,
        token: str | None,
        *,
        request_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        stop: threading.Event | None = None,
        limit: Callable[[], float | None] | None = None,
        log_once: LogOnce | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self._http = _Connection(self.server)
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.request_timeout_s = request_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stop = stop or threading.Event()
        """Set at shutdown: one attempt per request, and backoff sleeps end at once."""
        self.limit = limit or (lambda: None)
        """Monotonic time no request may run past (the shutdown budget), or None."""
        self.log_once = log_once or LogOnce(logger)
        self.retries = 0
        self.run_ids: dict[str, int] = {}

    def reset_after_fork(self, stop: threading.Event) -> None:
        """In a forked child: never touch the parent's socket; keep the run ids."""
        self._http = _Connection(self.server)
        self.stop = stop
        self.retries = 0

    def abort(self) -> None:
        """Break the in-flight request, if any (called from another thread at shutdown)."""
        self._http.abort()

    def close(self) -> None:
        self._http.close()

    # -- one request, retried -------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_max_s, self.backoff_initial_s * (2 ** (attempt - 1)))
        return d / 2 + random.uniform(0, d / 2)  # "equal jitter": spread out, never zero

    def _post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        deadline: float,
        max_attempts: int | None,
        valid: Callable[[_Response], bool] | None = None,
    ) -> _Response | None:
        """POST until a non-retryable answer; None when the deadline or attempts ran out."""
        hdrs = {"User-Agent": f"fleetscope-agent/{__version__}", **headers, **self._auth}
        attempt = 0
        while True:
            hard = self.limit()
            end = deadline if hard is None else min(deadline, hard)
            if self.stop.is_set():
                max_attempts = 1 if max_attempts is None else min(max_attempts, attempt + 1)
            remaining = end - time.monotonic()
            if remaining < _MIN_ATTEMPT_S:
                return None
            resp: _Response | None
            try:
                resp = self._http.request("POST", path, body, hdrs, min(self.request_timeout_s, remaining))
            except ConnectionFailed as e:
                resp = None
                self.log_once(
                    "unreachable",
                    logging.WARNING,
                    "fleetscope server %s unreachable (%s); retrying with backoff, then spooling to disk",
                    _safe_url(self.server),
                    e,
                )
            else:
                if not _retryable(resp.status):
                    if valid is None or not (200 <= resp.status < 300) or valid(resp):
                        return resp
                    self.log_once(
                        "garbage",
                        logging.WARNING,
                        "fleetscope server %s sent an unreadable answer to %s",
                        _safe_url(self.server),
                        path,
                    )
                else:
                    self.log_once(
                        f"status-{resp.status}",
                        logging.WARNING,
                        "fleetscope server %s answered %s to %s; retrying with backoff",
                        _safe_url(self.server),
                        resp.status,
                        path,
                    )
            attempt += 1
            if max_attempts is not None and attempt >= max_attempts:
                return None
            ra = _retry_after(resp)
            delay = self._backoff(attempt)
            if ra is not None:  # the server's minimum (jittered up, so a crowd does not return at once)
                delay = max(delay, ra * random.uniform(1.0, 1.1))
            if time.monotonic() + delay >= end:
                return None
            self.retries += 1
            if self.stop.wait(delay):
                return None  # shutting down: give the data to the spool instead of waiting

    # -- the API ----------------------------------------------------------------------------------

    def cached_run_id(self, run_info: dict[str, Any]) -> int | None:
        """The id this client registered ``run_info`` under, if it did."""
        return self.run_ids.get(json.dumps(run_info, sort_keys=True, default=str))

    def register(
        self, run_info: dict[str, Any], *, deadline: float, max_attempts: int | None = None
    ) -> int | str:
        """The run's id (cached; POST /api/v1/runs is idempotent by name), or why not."""
        key = json.dumps(run_info, sort_keys=True, default=str)
        rid = self.run_ids.get(key)
        if rid is not None:
            return rid

        def valid(r: _Response) -> bool:
            try:
                v = json.loads(r.body)["id"]
                return isinstance(v, int) and not isinstance(v, bool)
            except Exception:
                return False

        body = json.dumps(run_info, default=str).encode()
        resp = self._post(
            "/api/v1/runs",
            body,
            {"Content-Type": "application/json"},
            deadline=deadline,
            max_attempts=max_attempts,
            valid=valid,
        )
        if resp is None:
            return "unreachable"
        if 200 <= resp.status < 300:
            rid = int(json.loads(resp.body)["id"])
            self.run_ids[key] = rid
            return rid
        return self._refused(resp, "registering the run")

    def _forget(self, run_info: dict[str, Any]) -> None:
        self.run_ids.pop(json.dumps(run_info, sort_keys=True, default=str), None)

    def _refused(self, resp: _Response, what: str) -> str:
        """Classify a non-retryable, non-2xx answer: "invalid" (drop) or a reason to keep the data."""
        s = resp.status
        if s in (401, 403):
            self.log_once(
                "auth",
                logging.ERROR,
                "fleetscope server %s refused the token (HTTP %s) while %s; data is spooled to disk "
                "(send it later with `fleetscope upload`)",
                _safe_url(self.server),
                s,
                what,
            )
            return "unauthorized"
        if s in (400, 422):
            self.log_once(
                f"invalid-{what}",
                logging.ERROR,
                "fleetscope server rejected data while %s (HTTP %s): %s",
                what,
                s,
                _detail(resp),
            )
            return "invalid"
        self.log_once(
            f"rejected-{s}",
            logging.ERROR,
            "fleetscope server %s answered HTTP %s while %s; data is spooled",
            _safe_url(self.server),
            s,
            what,
        )
        return "rejected"

    def deliver(
        self,
        run_info: dict[str, Any],
        payload: dict[str, Any],
        records: int,
        *,
        deadline: float,
        max_attempts: int | None = None,
    ) -> Result:
        """Deliver a spool-frame payload (``{"batch": ...}`` or ``{"finish": status}``) for one run."""
        res = Result()
        if "finish" in payload:
            self._finish(run_info, str(payload["finish"]), res, deadline, max_attempts)
        else:
            self._send(run_info, payload["batch"], records, res, deadline, max_attempts, fresh_id=False)
        return res

    def _keep(self, res: Result, reason: str, payload: dict[str, Any], n: int) -> None:
        res.reason = res.reason or reason
        res.unsent.append((payload, n))

    def _send(
        self,
        run_info: dict[str, Any],
        batch: dict[str, Any],
        n: int,
        res: Result,
        deadline: float,
        max_attempts: int | None,
        *,
        fresh_id: bool,
        salvage: int = 0,
    ) -> None:
        if res.reason is not None:  # an earlier half failed for good: keep the rest, in order
            res.unsent.append(({"batch": batch}, n))
            return
        rid = self.register(run_info, deadline=deadline, max_attempts=max_attempts)
        if rid == "invalid":
            res.drop("invalid", n)
            return
        if isinstance(rid, str):
            self._keep(res, rid, {"batch": batch}, n)
            return
        try:
            body, headers = _encode({**batch, "run_id": rid})
        except (TypeError, ValueError, OverflowError) as e:
            self.log_once("encode", logging.ERROR, "fleetscope agent could not encode a batch: %s", e)
            res.drop("unencodable", n)
            return
        resp = self._post("/api/v1/ingest", body, headers, deadline=deadline, max_attempts=max_attempts)
        if resp is None:
            self._keep(res, "unreachable", {"batch": batch}, n)
        elif 200 <= resp.status < 300:
            res.sent += n
            res.batches += 1
        elif resp.status == 413:
            if n <= 1:
                self.log_once(
                    "too-large", logging.ERROR, "fleetscope server refused a single record as too large"
                )
                res.drop("too_large", n)
                return
            a, b = split_batch(batch)
            self._send(run_info, a, batch_records(a), res, deadline, max_attempts, fresh_id=fresh_id)
            self._send(run_info, b, batch_records(b), res, deadline, max_attempts, fresh_id=fresh_id)
        elif not fresh_id and _unknown_run(resp):
            self._forget(run_info)  # the server lost the run (e.g. a new database): register again
            self._send(run_info, batch, n, res, deadline, max_attempts, fresh_id=True)
        else:
            why = self._refused(resp, "sending a batch")
            if why != "invalid":
                self._keep(res, why, {"batch": batch}, n)
                return
            rest = _without_bad_record(batch, resp) if salvage < _MAX_SALVAGE and n > 1 else None
            if rest is None:
                res.drop("invalid", n)
                return
            res.drop("invalid", 1)  # the server named the one bad record: send the others
            self._send(
                run_info, rest, n - 1, res, deadline, max_attempts, fresh_id=fresh_id, salvage=salvage + 1
            )

    def _finish(
        self, run_info: dict[str, Any], status: str, res: Result, deadline: float, max_attempts: int | None
    ) -> None:
        for fresh in (False, True):
            rid = self.register(run_info, deadline=deadline, max_attempts=max_attempts)
            if rid == "invalid":
                res.drop("invalid", 1)
                return
            if isinstance(rid, str):
                self._keep(res, rid, {"finish": status}, 0)
                return
            body = json.dumps({"status": status}).encode()
            resp = self._post(
                f"/api/v1/runs/{rid}/finish",
                body,
                {"Content-Type": "application/json"},
                deadline=deadline,
                max_attempts=max_attempts,
            )
            if resp is None:
                self._keep(res, "unreachable", {"finish": status}, 0)
                return
            if 200 <= resp.status < 300:
                res.finished += 1
                return
            if resp.status == 404 and not fresh:
                self._forget(run_info)
                continue
            why = self._refused(resp, "finishing the run")
            if why == "invalid":
                res.drop("invalid", 1)
            else:
                self._keep(res, why, {"finish": status}, 0)
            return


def _encode(batch: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """``wire.encode_batch``; values msgpack cannot pack (numpy scalars, ...) are made plain first."""
    try:
        return encode_batch(batch)
    except TypeError:
        import msgpack

        from .spool import to_plain

        plain = msgpack.unpackb(msgpack.packb(batch, use_bin_type=True, default=to_plain), raw=False)
        return encode_batch(plain)


_BAD_ROW = re.compile(
    r"^(rank_steps|collectives|modality_tokens)\.[A-Za-z_]+\[(\d+)\]$|^(ranks|events)\[(\d+)\]"
)


def _without_bad_record(batch: dict[str, Any], resp: _Response) -> dict[str, Any] | None:
    """``batch`` minus the one record a 422 names (``detail.where`` like ``rank_steps.step_s[7]``), or None."""
    try:
        where = json.loads(resp.body)["detail"]["where"]
        m = _BAD_ROW.match(where)
    except Exception:
        return None
    if m is None:
        return None
    key, idx = (m.group(1), int(m.group(2))) if m.group(1) else (m.group(3), int(m.group(4)))
    section = batch.get(key)
    out = dict(batch)
    if isinstance(section, dict):
        if not section or idx >= len(next(iter(section.values()))):
            return None
        cols = {c: v[:idx] + v[idx + 1 :] for c, v in section.items()}
        if next(iter(cols.values())):
            out[key] = cols
        else:
            del out[key]
    elif isinstance(section, list) and idx < len(section):
        rest = section[:idx] + section[idx + 1 :]
        if rest:
            out[key] = rest
        else:
            del out[key]
    else:
        return None
    return out


def _unknown_run(resp: _Response) -> bool:
    """The server does not know the run id (404, or 422 about ``run_id``)."""
    if resp.status == 404:
        return True
    if resp.status != 422:
        return False
    try:
        d = json.loads(resp.body).get("detail")
    except Exception:
        return False
    return isinstance(d, dict) and d.get("where") == "run_id"
