"""The fleetscope API as the agent's sender thread and ``fleetscope upload`` speak it: register a run,
ingest a batch, finish a run, each retried by one policy.

What each answer means: 2xx delivered; 5xx, 408, 425, 429, refused/reset connections, timeouts and
garbage are retried with capped, jittered exponential backoff honouring ``Retry-After`` until a
deadline; 413 splits the batch in halves; 400/422 reject the data (dropped, counted, logged once;
when the server's ``detail.loc`` names the bad record, the rest is resent without it, a few times at
most); 401/403 and anything else keep the data (the caller spools it). Never logs the token.
The transport (``http_conn.Connection``) and the batch reshaping (``batching``) live apart.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetscope import __version__

from .batching import Batch, batch_records, encode, split_batch, without_record
from .http_conn import Connection, ConnectionFailed, Response
from .urls import safe_url

__all__ = ["Client", "Result", "LogOnce", "Payload", "ConnectionFailed"]

logger = logging.getLogger(__name__)

_MIN_ATTEMPT_S = 0.05  # do not start a request with less time than this left
_MAX_SALVAGE = 8  # a 422 naming one bad record: resend without it, at most this many times per batch

Payload = dict[str, Any]
"""What one delivery carries, as a spool frame holds it: ``{"batch": Batch}`` or ``{"finish": status}``."""


class LogOnce:
    """Log each distinct key once per process (so a flapping server cannot flood the job's log)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._seen: set[str] = set()

    def __call__(self, key: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self._log.log(level, msg, *args, exc_info=exc_info)


@dataclass
class Result:
    """What became of one delivery: records sent, dropped by reason, and payloads still to deliver."""

    sent: int = 0
    batches: int = 0
    finished: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    unsent: list[tuple[Payload, int]] = field(default_factory=list)
    """(payload, records) not delivered, in order: the caller spools them."""
    reason: str | None = None
    """Why unsent: "unreachable", "unauthorized", "rejected"."""

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


def _retry_after(resp: Response | None) -> float | None:
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


def _detail_of(resp: Response) -> object:
    """The ``detail`` of a JSON error answer (None when the body is not one)."""
    try:
        doc = json.loads(resp.body)
    except Exception:
        return None
    return doc.get("detail") if isinstance(doc, dict) else None


def _detail(resp: Response) -> str:
    """The answer's detail as a short log line."""
    d = _detail_of(resp)
    if d is None:
        s = resp.body[:200].decode("utf-8", "replace")
    else:
        s = d if isinstance(d, str) else json.dumps(d)
    return s[:500]


def _bad_record(resp: Response) -> tuple[object, object] | None:
    """(section, index) of the one record a 422 names in its structured ``detail.loc``, if it does."""
    d = _detail_of(resp)
    loc = d.get("loc") if isinstance(d, dict) else None
    if not isinstance(loc, dict):
        return None
    return loc.get("section"), loc.get("index")


def _unknown_run(resp: Response) -> bool:
    """The server does not know the run id (404, or 422 about ``run_id``)."""
    if resp.status == 404:
        return True
    if resp.status != 422:
        return False
    d = _detail_of(resp)
    return isinstance(d, dict) and d.get("where") == "run_id"


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 425, 429)


class Client:
    """Registers runs, sends batches and finishes, with the retry policy of the module docstring.

    The timing settings are ``AgentConfig``'s (``request_timeout_s``, ``backoff_initial_s``,
    ``backoff_max_s``), passed by the caller: their defaults live there only."""

    def __init__(
        self,
        server: str,
        token: str | None,
        *,
        request_timeout_s: float,
        backoff_initial_s: float,
        backoff_max_s: float,
        stop: threading.Event | None = None,
        limit: Callable[[], float | None] | None = None,
        log_once: LogOnce | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self._http = Connection(self.server)
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.request_timeout_s = request_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stop = stop or threading.Event()
        """Set at shutdown: one attempt per request, and backoff sleeps end at once."""
        self.limit: Callable[[], float | None] = limit or (lambda: None)
        """Monotonic time no request may run past (the shutdown budget), or None."""
        self.log_once = log_once or LogOnce(logger)
        self.retries = 0
        self.run_ids: dict[str, int] = {}
        self.encoding = "gzip"
        """Content-Encoding of ingest bodies: zstd once a registration answer lists it (cheaper on both
        ends), back to gzip should a server answer 415 (e.g. an older instance behind the same address)."""

    def reset_after_fork(self, stop: threading.Event) -> None:
        """In a forked child: never touch the parent's socket; keep the run ids."""
        self._http = Connection(self.server)
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
        valid: Callable[[Response], bool] | None = None,
    ) -> Response | None:
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
            resp: Response | None
            try:
                resp = self._http.request("POST", path, body, hdrs, min(self.request_timeout_s, remaining))
            except ConnectionFailed as e:
                resp = None
                self.log_once(
                    "unreachable",
                    logging.WARNING,
                    "fleetscope server %s unreachable (%s); retrying with backoff, then spooling to disk",
                    safe_url(self.server),
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
                        safe_url(self.server),
                        path,
                    )
                else:
                    self.log_once(
                        f"status-{resp.status}",
                        logging.WARNING,
                        "fleetscope server %s answered %s to %s; retrying with backoff",
                        safe_url(self.server),
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

    @staticmethod
    def _key(run_info: dict[str, Any]) -> str:
        return json.dumps(run_info, sort_keys=True, default=str)

    def cached_run_id(self, run_info: dict[str, Any]) -> int | None:
        """The id this client registered ``run_info`` under, if it did."""
        return self.run_ids.get(self._key(run_info))

    def register(self, run_info: dict[str, Any], *, deadline: float, max_attempts: int | None = None) -> int | str:
        """The run's id (cached; POST /api/v1/runs is idempotent by name), or why not."""
        key = self._key(run_info)
        rid = self.run_ids.get(key)
        if rid is not None:
            return rid

        def valid(r: Response) -> bool:
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
            answer = json.loads(resp.body)
            rid = int(answer["id"])
            self.run_ids[key] = rid
            self.encoding = _pick_encoding(answer.get("ingest_encodings"))
            return rid
        return self._refused(resp, "registering the run")

    def _forget(self, run_info: dict[str, Any]) -> None:
        self.run_ids.pop(self._key(run_info), None)

    def _refused(self, resp: Response, what: str) -> str:
        """Classify a non-retryable, non-2xx answer: "invalid" (drop) or a reason to keep the data."""
        s = resp.status
        if s in (401, 403):
            self.log_once(
                "auth",
                logging.ERROR,
                "fleetscope server %s refused the token (HTTP %s) while %s; data is spooled to disk "
                "(send it later with `fleetscope upload`)",
                safe_url(self.server),
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
            safe_url(self.server),
            s,
            what,
        )
        return "rejected"

    def deliver(
        self,
        run_info: dict[str, Any],
        payload: Payload,
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

    def _keep(self, res: Result, reason: str, payload: Payload, n: int) -> None:
        res.reason = res.reason or reason
        res.unsent.append((payload, n))

    def _send(
        self,
        run_info: dict[str, Any],
        batch: Batch,
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
            body, headers = encode({**batch, "run_id": rid}, self.encoding)
        except (TypeError, ValueError, OverflowError) as e:
            self.log_once("encode", logging.ERROR, "fleetscope agent could not encode a batch: %s", e)
            res.drop("unencodable", n)
            return
        resp = self._post("/api/v1/ingest", body, headers, deadline=deadline, max_attempts=max_attempts)
        if resp is not None and resp.status == 415 and headers.get("Content-Encoding") == "zstd":
            self.encoding = "gzip"  # a server that does not take zstd: every server takes gzip
            body, headers = encode({**batch, "run_id": rid}, self.encoding)
            resp = self._post("/api/v1/ingest", body, headers, deadline=deadline, max_attempts=max_attempts)
        if resp is None:
            self._keep(res, "unreachable", {"batch": batch}, n)
        elif 200 <= resp.status < 300:
            res.sent += n
            res.batches += 1
        elif resp.status == 413:
            if n <= 1:
                self.log_once("too-large", logging.ERROR, "fleetscope server refused a single record as too large")
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
            bad = _bad_record(resp) if salvage < _MAX_SALVAGE and n > 1 else None
            rest = without_record(batch, *bad) if bad is not None else None
            if rest is None:
                res.drop("invalid", n)
                return
            res.drop("invalid", 1)  # the server named the one bad record: send the others
            self._send(run_info, rest, n - 1, res, deadline, max_attempts, fresh_id=fresh_id, salvage=salvage + 1)

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


def _pick_encoding(offered: Any) -> str:
    """zstd when the server lists it and this process can compress it, else gzip (every server)."""
    if isinstance(offered, list) and "zstd" in offered:
        try:
            import zstandard  # noqa: F401
        except ImportError:
            return "gzip"
        return "zstd"
    return "gzip"
