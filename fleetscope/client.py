"""A small synchronous HTTP client of the fleetscope API (CLI, demo, scripts, notebooks).

Every failure of a call — an HTTP error status, an answer that is not the JSON the call expects, an
answer larger than ``max_bytes``, a server that pages forever, a deadline that passed, a server that
cannot be reached — raises :class:`ApiError` (``.status``: the HTTP status, None when no answer came
back; ``.body``: an excerpt of the answer; the message names the method and the URL path). Reads are
retried on 429/503 honouring ``Retry-After`` within the call's deadline. docs/client.md has the details.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import re
import reprlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httpcore
import httpx

from .wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS, columns_from_rows, encode_batch

__all__ = ["Client", "ApiError", "columnar", "DEFAULT_MAX_BYTES"]

#: the most bytes one answer may have (decoded) before the call fails; ``Client(max_bytes=…)``
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: characters of an answer an ApiError keeps (``.body``)
_EXCERPT = 500
#: bytes of an error answer (status >= 400) read for its message; the rest is not read
_ERROR_READ = 64 * 1024
#: statuses a read is retried on
_RETRY_STATUSES = (429, 503)


class ApiError(RuntimeError):
    """A call that failed. ``status``: the HTTP status (None when no answer came back: the server could
    not be reached, the connection broke, the deadline passed); ``detail``: the server's ``detail`` of
    an error answer, else what went wrong; ``body``: up to 500 characters of the answer; ``method`` and
    ``path``: the request (the URL path, without the query string)."""

    def __init__(self, status: int | None, detail: Any, *, body: str = "", method: str = "", path: str = "") -> None:
        self.status = status
        self.detail = detail
        self.body = body[:_EXCERPT]
        self.method = method
        self.path = path
        head = f"HTTP {status}" if status is not None else "no answer"
        where = f" from {method} {path}" if status is not None and path else f" for {method} {path}" if path else ""
        text = detail if isinstance(detail, str) else json.dumps(detail, default=str)
        if len(text) > _EXCERPT:
            text = text[:_EXCERPT] + "…"
        super().__init__(f"{head}{where}: {text}")


def columnar(rows: list[tuple], fields: Any, *, binary: bool = False) -> dict[str, Any]:
    """Rows (tuples in field order) → columnar section (lists, or packed bytes when ``binary``)."""
    return columns_from_rows(rows, fields, binary=binary)


# ------------------------------------------------------------------ the per-call deadline
#
# httpx's timeouts bound each socket operation, so a server that sends a byte every few seconds keeps
# a call alive indefinitely. The client sets a deadline per call (thread-local) and its connections
# use a network backend that caps every connect, read and write at the time left to it.

_call = threading.local()


def _left(timeout: float | None, exc: type[Exception]) -> float | None:
    at = getattr(_call, "deadline", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise exc("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                               socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _install_deadlines(http: httpx.Client) -> None:
    """Wrap the network backend of the client's connection pools (its default transport and any proxy
    mounts). Where a pool has none (another httpx), the deadline is still checked between body chunks
    and every request's timeouts are the time left, so a call ends within about twice its timeout."""
    for transport in (getattr(http, "_transport", None), *getattr(http, "_mounts", {}).values()):
        pool = getattr(transport, "_pool", None)
        inner = getattr(pool, "_network_backend", None)
        if isinstance(inner, httpcore.NetworkBackend) and not isinstance(inner, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(inner)  # type: ignore[union-attr]


@contextlib.contextmanager
def _deadline(at: float) -> Iterator[None]:
    before = getattr(_call, "deadline", None)
    _call.deadline = at if before is None else min(at, before)
    try:
        yield
    finally:
        _call.deadline = before


# ------------------------------------------------------------------ answers


def _excerpt(raw: bytes | bytearray) -> str:
    return bytes(raw[: _EXCERPT * 4]).decode("utf-8", "replace")[:_EXCERPT]


_short = reprlib.Repr()
_short.maxstring = 120
_short.maxother = 120
_short.maxlist = _short.maxdict = 6
_short.maxlevel = 3


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(x), "a number" if isinstance(x, (int, float)) else type(x).__name__)


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header (delta seconds or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        s = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        s = when.timestamp() - time.time()
    if not math.isfinite(s):
        return None
    return max(0.0, s)


def _row_key(r: dict[str, Any]) -> Any:
    if r.get("id") is not None:
        return ("id", str(r["id"]))
    return ("row", json.dumps(r, sort_keys=True, default=str))


class Client:
    """``Client("http://127.0.0.1:8000", token)``: register runs, ingest, read.

    ``timeout``: seconds one request may take in all — connecting, waiting, reading the whole answer,
    and the retries of a read with their waits (a read of several pages applies it to each page).
    ``max_bytes``: the largest answer read (decoded); a larger one fails the call without being held.
    ``retries``: how often a read answered 429 or 503 is tried again, after the answer's ``Retry-After``
    (a longer one than ``max_retry_wait`` seconds, or one past the deadline, fails the call). ``max_pages``:
    the most pages one paged read (``runs``, ``steps``, ``nodes``) requests."""

    def __init__(self, server: str, token: str | None = None, *, timeout: float = 30.0,
                 max_bytes: int = DEFAULT_MAX_BYTES, retries: int = 3, max_retry_wait: float = 10.0,
                 max_pages: int = 10_000) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.server = server.rstrip("/")
        self.timeout = float(timeout)
        self.max_bytes = int(max_bytes)
        self.retries = max(0, int(retries))
        self.max_retry_wait = max(0.0, float(max_retry_wait))
        self.max_pages = max(1, int(max_pages))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)
        _install_deadlines(self.http)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def _send(self, method: str, path: str, *, deadline: float, limit: float, **kw: Any) -> tuple[int, httpx.Headers, bytearray]:
        """One request: (status, headers, body). The body is read streamed, at most ``max_bytes`` (an
        error answer: its first 64 KiB); the deadline bounds everything. Raises ApiError."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(None, f"no complete answer within timeout={limit:g}s", method=method, path=path)
        try:
            with _deadline(deadline), self.http.stream(method, path, timeout=httpx.Timeout(left), **kw) as r:
                status = r.status_code
                cap = self.max_bytes if status < 400 else _ERROR_READ
                declared = r.headers.get("content-length", "")
                if status < 400 and declared.isdigit() and int(declared) > cap:
                    raise ApiError(status, f"the answer is {int(declared):,} bytes, more than max_bytes={cap:,}",
                                   method=method, path=path)
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > cap:
                        if status >= 400:
                            break
                        raise ApiError(status, f"the answer is larger than max_bytes={cap:,} (read {len(buf):,} bytes, "
                                               "stopped)", body=_excerpt(buf), method=method, path=path)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the call's deadline passed while reading the answer")
                return status, r.headers, buf
        except httpx.TimeoutException as e:
            raise ApiError(None, f"no complete answer within timeout={limit:g}s ({type(e).__name__}: {e})",
                           method=method, path=path) from None
        except httpx.HTTPError as e:
            raise ApiError(None, f"cannot talk to {self.server}: {type(e).__name__}: {e}", method=method, path=path) from None

    def _request(self, method: str, path: str, *, retry: bool, **kw: Any) -> tuple[Any, _At]:
        """A request and its JSON answer; a read (``retry``) is tried again on 429/503 within the deadline."""
        deadline = time.monotonic() + self.timeout
        tries = 0
        while True:
            status, headers, raw = self._send(method, path, deadline=deadline, limit=self.timeout, **kw)
            if status in _RETRY_STATUSES and retry:
                asked = _retry_after(headers.get("retry-after"))
                wait = min(self.max_retry_wait, 0.5 * 2 ** tries) if asked is None else asked
                if tries >= self.retries:
                    raise _status_error(status, raw, method, path, f" (after {tries} retries)" if tries else "")
                if wait > self.max_retry_wait:
                    raise _status_error(status, raw, method, path, f" (not retried: Retry-After {wait:g}s is more than "
                                                                   f"max_retry_wait={self.max_retry_wait:g}s)")
                if time.monotonic() + wait >= deadline:
                    raise _status_error(status, raw, method, path,
                                        f" (not retried: waiting {wait:g}s would pass the timeout={self.timeout:g}s)")
                tries += 1
                time.sleep(wait)
                continue
            if status >= 400:
                raise _status_error(status, raw, method, path, "")
            at = _At(status, method, path)
            return _decode(raw, headers, at), at

    def _get(self, path: str, params: Any = None) -> tuple[Any, _At]:
        return self._request("GET", path, retry=True, params=params)

    def _get_object(self, path: str, params: Any = None) -> tuple[dict[str, Any], _At]:
        doc, at = self._get(path, params)
        return _object(doc, at), at

    def _check(self, r: httpx.Response) -> Any:
        """The JSON of a response got with ``self.http`` (raises ApiError); the client's own calls stream."""
        method, path = r.request.method, r.request.url.path
        raw = r.content
        if r.status_code >= 400:
            raise _status_error(r.status_code, raw, method, path, "")
        return _decode(raw, r.headers, _At(r.status_code, method, path))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until ``GET /healthz`` answers 200; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            probe = min(self.timeout, max(deadline - time.monotonic(), 0.5))
            try:
                status, _, _ = self._send("GET", "/healthz", deadline=time.monotonic() + probe, limit=probe)
                if status == 200:
                    return
            except ApiError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.server} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    # ------------------------------------------------------------------ writes

    def register_run(self, info: dict[str, Any]) -> int:
        doc, at = self._request("POST", "/api/v1/runs", retry=False, json=info)
        body = _object(doc, at)
        with _interpreting(at, body):
            return int(body["id"])

    def finish_run(self, run_id: int, status: str = "finished", finished_at: float | None = None) -> None:
        body: dict[str, Any] = {"status": status}
        if finished_at is not None:
            body["finished_at"] = finished_at
        self._request("POST", f"/api/v1/runs/{int(run_id)}/finish", retry=False, json=body)

    def ingest(self, batch: dict[str, Any], *, fmt: str = "msgpack", retries: int = 20) -> dict[str, Any]:
        """Send one batch. Answered 429/503 (the server's backpressure), it is sent again up to ``retries``
        times, after ``Retry-After`` seconds (at most 5; 1 without the header); ``timeout`` bounds each try."""
        body, headers = encode_batch(batch, fmt=fmt)
        path = "/api/v1/ingest"
        for attempt in range(retries + 1):
            status, hdrs, raw = self._send("POST", path, deadline=time.monotonic() + self.timeout, limit=self.timeout,
                                           content=body, headers=headers)
            if status in _RETRY_STATUSES and attempt < retries:
                wait = _retry_after(hdrs.get("retry-after"))
                time.sleep(min(1.0 if wait is None else wait, 5.0))
                continue
            if status >= 400:
                raise _status_error(status, raw, "POST", path, f" (after {attempt} retries)" if attempt else "")
            at = _At(status, "POST", path)
            return _object(_decode(raw, hdrs, at), at)
        raise AssertionError("unreachable")

    def ingest_rows(self, run_id: int, step_rows: list[tuple], coll_rows: list[tuple] | None = None, **extra: Any) -> dict[str, Any]:
        batch: dict[str, Any] = {"v": 1, "run_id": run_id, "rank_steps": columnar(step_rows, RANK_STEP_FIELDS, binary=True)}
        if coll_rows:
            batch["collectives"] = columnar(coll_rows, COLLECTIVE_FIELDS, binary=True)
        batch.update(extra)
        return self.ingest(batch)

    # ------------------------------------------------------------------ reads

    def run_list(self, **params: Any) -> list[dict[str, Any]]:
        """Runs as the API lists them (dicts; no pandas needed): ``GET /api/v1/runs`` with these parameters.
        Filter values are values (``name="gt:x"`` is the name ``gt:x``), as in :meth:`runs`; ``sort``,
        ``offset``, ``limit``, ``group_by``, ``figures``, ``columns`` are sent as they are."""
        plain = [(k, _text(v)) for k, v in params.items() if v is not None and k in _RESERVED]
        filters = _filter_params({k: v for k, v in params.items() if k not in _RESERVED})
        return _rows(*self._get_object("/api/v1/runs", [*filters, *plain]), "runs")

    # ------------------------------------------------------------------ notebook reads (pandas)

    def runs(self, filters: dict[str, Any] | None = None, *, columns: list[str] | None = None,
             limit: int | None = None, page_size: int = 1_000, **kw: Any) -> Any:
        """Runs as a pandas DataFrame: one row per run, one ``config.KEY`` column per config key (nested
        keys dotted), ``meta.tags``, and the figures (``mfu``, ``step_s``, ``tokens_per_s`` …).

        Filters as keyword arguments — ``runs(family="llama", status="finished", tag="ablation",
        commit="ab12", since="2026-01-01", sort="-mfu")`` — and ``config.KEY`` / operators through
        ``filters`` (a key with a dot or an operator is no Python identifier): ``runs({"config.tp": 4,
        "config.lr>": 1e-3, "config.seq_len": ("in", [2048, 4096]), "mfu<": 0.5})``. A value may be
        ``(op, value)`` with op in ``= != < > <= >= in``; any other value is sent as a value (``name="gt:x"``
        is the name ``gt:x``). ``columns``: extra columns (``scalar.loss.last``, ``scalar.loss.min``,
        ``meta.KEY``). Every page of the answer is read (``page_size`` runs a request) up to ``limit`` runs,
        the server's ``total`` or the client's ``max_pages``."""
        pd = _pandas()
        params = _filter_params({**(filters or {}), **kw})
        if columns:
            params.append(("columns", ",".join(columns)))
        params.append(("figures", "true"))
        rows, at = self._offset_pages("/api/v1/runs", "runs", params, page_size, limit)
        with _interpreting(at, None):
            return pd.DataFrame([_flat_run(r) for r in rows], columns=_run_columns(rows))

    def _offset_pages(self, path: str, key: str, params: list[tuple[str, str]], page_size: int,
                      limit: int | None) -> tuple[list[dict[str, Any]], _At]:
        """Every page of an offset-paged list: until a short/empty page, the server's ``total`` or ``limit``.
        A page that brings no row not seen before (a server ignoring ``offset``) or more than
        ``max_pages`` pages raise ApiError."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size!r}")
        rows: list[dict[str, Any]] = []
        seen: set[Any] = set()
        offset = 0
        at = _At(None, "GET", path)
        total: int | None = None
        for _ in range(self.max_pages):
            n = page_size if limit is None else min(page_size, limit - len(rows))
            if n <= 0:
                return rows[:limit], at
            page, at = self._get_object(path, [*params, ("offset", str(offset)), ("limit", str(n))])
            got = _rows(page, at, key)
            total = _total(page, at)
            with _interpreting(at, page):
                fresh = [r for r in got if _row_key(r) not in seen]
                seen.update(_row_key(r) for r in fresh)
            if got and not fresh:
                raise at.error(f"the server sent the same {key} again for offset={offset} (it ignores paging?); "
                               f"{len(rows):,} of total={total} read", _short.repr(got))
            rows.extend(fresh)
            offset += len(got)
            if not got or total is None or offset >= total:
                return (rows if limit is None else rows[:limit]), at
        raise at.error(f"still paging after max_pages={self.max_pages:,} pages ({len(rows):,} {key} read, "
                       f"the server's total={total} says more)")

    def run_groups(self, group_by: str | list[str], filters: dict[str, Any] | None = None, **kw: Any) -> Any:
        """Runs grouped by one or two keys (``"config.tp"``, ``["config.tp", "config.seq_len"]``) as a
        DataFrame: the keys, ``count``, ``median_mfu``, ``median_tokens_per_s_per_gpu``, ``median_step_s``."""
        pd = _pandas()
        keys = [group_by] if isinstance(group_by, str) else list(group_by)
        params: list[tuple[str, Any]] = [*_filter_params({**(filters or {}), **kw}), ("group_by", ",".join(keys))]
        body, at = self._get_object("/api/v1/runs", params)
        groups = _rows(body, at, "groups", required=False)
        with _interpreting(at, None):
            return pd.DataFrame(groups)

    def steps(self, run_id: int, *, page_size: int = 1_000) -> Any:
        """One row per step of the run (``step``, ``step_s``, ``step_s_max``, the decomposition ``data_s``
        ``compute_s`` ``comm_exposed_s`` ``other_s`` ``straggler_wait_s``, phases, ``tokens``, ``mfu``,
        ``tokens_per_s`` …), every page of ``GET /api/v1/runs/{id}/steps``."""
        pd = _pandas()
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size!r}")
        rows, fields, at = self._cursor_rows(f"/api/v1/runs/{int(run_id)}/steps", page_size, [], "steps")
        with _interpreting(at, None):
            return pd.DataFrame(rows, columns=fields or None)

    def rank_steps(self, run_id: int, ranks: int | list[int] | None = None, *, max_points: int | None = None,
                   page_size: int = 1_000, max_ranks: int = 64) -> Any:
        """Ranks' step-time components against the median rank, one row per (rank, step): ``rank``,
        ``step``, ``present``, ``step_s``, ``data_s``, ``compute_s``, ``comm_exposed_s``, ``other_s``,
        ``straggler_wait_s``, ``work_s``, ``work_ratio``, phases, and ``median_<component>`` (the step's
        cross-rank median) — every page of ``GET /api/v1/runs/{id}/ranks/{rank}/steps`` for each rank.

        ``ranks``: a rank or a list of ranks. ``None`` is every rank of the run, bounded: allowed only
        when the run has at most ``max_ranks`` (default 64) ranks — a request per rank and page, each
        reading the blocks of its steps, so a wider run raises ValueError: pick the ranks (the summary's
        ``stragglers``, the heatmap) or raise ``max_ranks``. ``max_points``: one request per rank, the
        server's min/max-downsampled series of the whole run (at most that many rows per rank; on a very
        wide run a sample of its steps, as the answer's ``sampled_every_steps`` says). A wide run's pages
        hold fewer steps than ``page_size`` (the server's ``limit``): they are followed all the same."""
        pd = _pandas()
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size!r}")
        if ranks is None:
            run, at = self._get_object(f"/api/v1/runs/{int(run_id)}")
            with _interpreting(at, run):
                world = int(run["world_size"])
            if world > max_ranks:
                raise ValueError(f"run {run_id} has {world:,} ranks, more than max_ranks={max_ranks}: pass ranks=[...] "
                                 "(e.g. the summary's stragglers) or a larger max_ranks")
            wanted = list(range(world))
        else:
            wanted = ([int(r) for r in ranks] if isinstance(ranks, Iterable) and not isinstance(ranks, (str, bytes))
                      else [int(ranks)])  # type: ignore[arg-type]
        frames: list[dict[str, Any]] = []
        fields: list[str] = []
        at = _At(None, "GET", f"/api/v1/runs/{int(run_id)}/ranks")
        for rank in wanted:
            rows, fields, at = self._rank_pages(int(run_id), rank, max_points, page_size, fields)
            frames.extend({"rank": rank, **r} for r in rows)
        with _interpreting(at, None):
            cols = ["rank", *(fields or [])] if fields else None
            return pd.DataFrame(frames, columns=cols)

    def _rank_pages(self, run_id: int, rank: int, max_points: int | None, page_size: int,
                    fields: list[str]) -> tuple[list[dict[str, Any]], list[str], _At]:
        """Every row of one rank (every page by the ``after`` cursor, or the one downsampled answer)."""
        path = f"/api/v1/runs/{run_id}/ranks/{rank}/steps"
        if max_points is not None:
            page, at = self._get_object(path, {"max_points": max_points})
            return _rows(page, at, "steps"), _fields(page, at) or fields, at
        return self._cursor_rows(path, page_size, fields, f"steps of rank {rank}")

    def _cursor_rows(self, path: str, page_size: int, fields: list[str],
                     what: str) -> tuple[list[dict[str, Any]], list[str], _At]:
        """Every row of a step-paged answer (``/steps``, ``/ranks/{rank}/steps``): pages by the ``after``
        cursor, each at most ``page_size`` rows (or the smaller ``limit`` the server says it used), until a
        short page or the server's ``total``; a server that sends the same steps again, or more than
        ``max_pages`` pages, is an ApiError. Returns (rows, the answer's ``fields``, where)."""
        rows: list[dict[str, Any]] = []
        after: int | None = None
        at = _At(None, "GET", path)
        for _ in range(self.max_pages):
            params: dict[str, Any] = {"limit": page_size}
            if after is not None:
                params["after"] = after
            page, at = self._get_object(path, params)
            got = _rows(page, at, "steps")
            total = _total(page, at)
            fields = _fields(page, at) or fields
            with _interpreting(at, page):
                used = int(page.get("limit") or page_size)
                fresh = [r for r in got if after is None or int(r["step"]) > after]
            if got and not fresh:
                raise at.error(f"the server sent steps up to {after} again for after={after} (it ignores paging?)",
                               _short.repr(got))
            rows.extend(fresh)
            if not got or len(got) < min(used, page_size) or (total is not None and len(rows) >= total):
                return rows, fields, at
            with _interpreting(at, page):
                after = max(int(r["step"]) for r in fresh)
        raise at.error(f"still paging after max_pages={self.max_pages:,} pages ({len(rows):,} {what} read)")

    def scalars(self, run_id: int, names: list[str] | None = None, *, max_points: int = 20_000) -> Any:
        """Training scalars in long form: ``name``, ``step``, ``value`` (per step the lowest logging rank;
        a series longer than ``max_points`` is min/max-downsampled by the server)."""
        pd = _pandas()
        params: dict[str, Any] = {"max_points": max_points}
        if names:
            params["names"] = ",".join(names)
        body, at = self._get_object(f"/api/v1/runs/{int(run_id)}/scalars", params)
        with _interpreting(at, body):
            out = [{"name": n, "step": s, "value": v} for n, d in (body.get("scalars") or {}).items()
                   for s, v in zip(d["step"], d["value"], strict=True)]
            return pd.DataFrame(out, columns=["name", "step", "value"])

    def alerts(self, **params: Any) -> Any:
        """Alerts (``GET /api/v1/alerts``) as a DataFrame, one row per alert."""
        pd = _pandas()
        body, at = self._get("/api/v1/alerts", {k: v for k, v in params.items() if v is not None})
        rows = _rows({"alerts": body} if isinstance(body, list) else _object(body, at), at, "alerts", required=False)
        with _interpreting(at, None):
            return pd.DataFrame(rows)

    def nodes(self, **params: Any) -> Any:
        """Nodes (``GET /api/v1/nodes``, every page) as a DataFrame, one row per node."""
        pd = _pandas()
        plain = [(k, _text(v)) for k, v in params.items() if v is not None and k not in ("offset", "limit")]
        rows, at = self._offset_pages("/api/v1/nodes", "nodes", plain, 1000, None)
        with _interpreting(at, None):
            return pd.DataFrame(rows)

    def collectives(self, run_id: int) -> Any:
        """A run's collectives by op × group × message size (count, time, bus bandwidth) as a DataFrame."""
        pd = _pandas()
        body, at = self._get_object(f"/api/v1/runs/{int(run_id)}/collectives")
        rows = _rows(body, at, "collectives", required=False)
        with _interpreting(at, None):
            return pd.DataFrame(rows)

    def summary(self, run_id: int) -> dict[str, Any]:
        return self._get_object(f"/api/v1/runs/{int(run_id)}/summary")[0]

    def compare(self, run_ids: list[int]) -> dict[str, Any]:
        """``GET /api/v1/compare``: the runs side by side in normalised units — per GPU, per (active)
        parameter, per sample and per modality — with figures relative to the first run."""
        return self._get_object("/api/v1/compare", {"runs": ",".join(str(int(i)) for i in run_ids)})[0]

    def projection(self, run_id: int, *, world_size: int, tp: int | None = None, pp: int | None = None,
                   micro_batches: int | None = None, bucket_bytes: int | None = None,
                   batch: str | None = None) -> dict[str, Any]:
        """``GET /api/v1/runs/{id}/projection``: the run's step, MFU, tokens/s and parts projected to another
        layout (estimated, with an error band and its basis; ``status: "insufficient_data"`` and ``missing``
        when the run's measurements cannot support it)."""
        params = {k: v for k, v in (("world_size", world_size), ("tp", tp), ("pp", pp), ("micro_batches", micro_batches),
                                    ("bucket_bytes", bucket_bytes), ("batch", batch)) if v is not None}
        return self._get_object(f"/api/v1/runs/{int(run_id)}/projection", params)[0]

    def projection_track_record(self, family: str) -> dict[str, Any]:
        """``GET /api/v1/projections/track_record``: the family's projections against the runs that followed."""
        return self._get_object("/api/v1/projections/track_record", {"family": family})[0]

    def memory(self, run_id: int, *, target_bytes: int | None = None) -> dict[str, Any]:
        """``GET /api/v1/runs/{id}/memory``: the summary's ``memory`` section plus memory per module
        (``modules``), the peak's parts (``breakdown``), imbalance across ranks and ``checkpoint_advice``
        towards ``target_bytes`` (default: the server's, see docs/api.md "Memory")."""
        params = {"target_bytes": int(target_bytes)} if target_bytes is not None else None
        return self._get_object(f"/api/v1/runs/{int(run_id)}/memory", params)[0]

    def devices(self, run_id: int) -> Any:
        """GPU telemetry per rank (``GET /api/v1/runs/{id}/devices``) as a DataFrame, one row per rank: ``rank``,
        ``node``, clocks, power, temperature, ``throttled``, ``reason``, ``throttled_share``, ``xid``, ``ecc_errors`` …
        (empty for a run without telemetry)."""
        pd = _pandas()
        body, at = self._get_object(f"/api/v1/runs/{int(run_id)}/devices")
        rows = _rows(body, at, "ranks", required=False)
        with _interpreting(at, None):
            return pd.DataFrame(rows)

    def utilisation(self, since: str | float | None = None, until: str | float | None = None,
                    by: str = "team") -> Any:
        """Fleet utilisation (``GET /api/v1/fleet/utilisation``) as a DataFrame, one row per group of ``by``
        (``team``, ``family`` or ``day``; the day's column is ``date``): ``gpu_hours``, ``busy_gpu_hours``,
        ``idle_gpu_hours``, ``idle_share``, ``failed_gpu_hours``, ``redone_gpu_hours``, ``mfu_gpu_hours``, ``mfu``,
        ``mfu_unknown_gpu_hours``, ``runs``. ``since``/``until``: Unix seconds or ISO 8601 (default: the last 7
        days). The window's totals are in ``df.attrs["total"]``."""
        pd = _pandas()
        params = {"by": by, **({"since": since} if since is not None else {}),
                  **({"until": until} if until is not None else {})}
        body, at = self._get_object("/api/v1/fleet/utilisation", params)
        rows = _rows(body, at, by, required=False)
        with _interpreting(at, None):
            df = pd.DataFrame(rows)
            df.attrs["total"] = body.get("total")
            return df

    def get(self, path: str, **params: Any) -> Any:
        """The JSON answer of ``GET path`` with these parameters (any JSON value)."""
        return self._get(path, params)[0]


# ------------------------------------------------------------------ answers → values or ApiError


def _status_error(status: int, raw: bytes | bytearray, method: str, path: str, note: str) -> ApiError:
    """ApiError of an error answer: the server's ``detail`` when the body is JSON with one, else the text."""
    detail: Any = None
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict) and "detail" in doc:
            detail = doc["detail"]
    except ValueError:
        pass
    if detail is None or detail == "":
        text = " ".join(_excerpt(raw).split())
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        detail = f"{phrase}: {text[:200]}" if text else phrase
    if note:
        detail = f"{detail}{note}" if isinstance(detail, str) else {"detail": detail, "note": note.strip(" ()")}
    return ApiError(status, detail, body=_excerpt(raw), method=method, path=path)


@dataclass(frozen=True)
class _At:
    """Where an answer came from: its status and request, for the ApiError of a misshapen answer."""

    status: int | None
    method: str
    path: str

    def error(self, detail: str, body: str = "") -> ApiError:
        return ApiError(self.status, detail, body=body, method=self.method, path=self.path)


def _decode(raw: bytes | bytearray, headers: httpx.Headers, at: _At) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        ctype = headers.get("content-type", "no content-type")
        text = " ".join(_excerpt(raw).split())
        what = "empty" if not raw else f"not JSON ({ctype}): {text[:120]!r}"
        raise at.error(f"the answer is {what} — is {at.path} served by a fleetscope server?", _excerpt(raw)) from None


def _object(body: Any, at: _At) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise at.error(f"expected a JSON object, the answer is {_kind(body)}: {_short.repr(body)}", _short.repr(body))
    return body


def _rows(body: dict[str, Any], at: _At, key: str, *, required: bool = True) -> list[dict[str, Any]]:
    got = body.get(key)
    if got is None and not required:
        return []
    if not isinstance(got, list) or not all(isinstance(r, dict) for r in got):
        what = "missing" if got is None else _kind(got) if not isinstance(got, list) else "a list with non-objects"
        raise at.error(f"expected {key!r} to be a list of objects, it is {what}", _short.repr(body))
    return got


def _total(body: dict[str, Any], at: _At) -> int | None:
    t = body.get("total")
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise at.error(f"'total' is not a count: {_short.repr(t)}", _short.repr(body))
    return int(t)


def _fields(body: dict[str, Any], at: _At) -> list[str]:
    f = body.get("fields")
    if f is None:
        return []
    if not (isinstance(f, list) and all(isinstance(x, str) for x in f)):
        raise at.error(f"'fields' is {_kind(f)}, not a list of names", _short.repr(body))
    return f


@contextlib.contextmanager
def _interpreting(at: _At, body: Any) -> Iterator[None]:
    """An answer of the wrong shape found while reading it (a missing key, a wrong type) → ApiError."""
    try:
        yield
    except ApiError:
        raise
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        raise at.error(f"the answer is not shaped as expected ({type(e).__name__}: {e})",
                       _short.repr(body) if body is not None else "") from None


# ------------------------------------------------------------------ helpers of the pandas reads


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("fleetscope.client's DataFrame reads need pandas: pip install 'fleetscope[client]' "
                          "(or pip install pandas)") from None
    return pd


_OPS = {"=": "eq", "!=": "ne", "<": "lt", ">": "gt", "<=": "le", ">=": "ge", "in": "in"}


def _filter_params(filters: dict[str, Any]) -> list[tuple[str, str]]:
    """Query parameters of the API's run filters: ``{"config.tp": 4}``, ``{"config.lr>": 1e-3}``,
    ``{"config.tp": ("in", [2, 4])}``, ``{"tag": ["a", "b"]}`` (all of them)."""
    out: list[tuple[str, str]] = []
    for key, v in filters.items():
        if v is None:
            continue
        op = "="
        for suffix in ("!=", "<=", ">=", "<", ">"):
            if key.endswith(suffix):
                key, op = key[: -len(suffix)], suffix
                break
        if isinstance(v, tuple) and len(v) == 2 and v[0] in _OPS:
            op, v = v
        if op not in _OPS:
            raise ValueError(f"unknown operator {op!r} for {key} (use one of {', '.join(_OPS)})")
        if key == "tag" and isinstance(v, (list, tuple)) and op == "=":
            out.extend(("tag", _literal(_text(t))) for t in v)
            continue
        if op == "in":
            vals = [_text(x) for x in (v if isinstance(v, (list, tuple, set)) else [v])]
            if any("," in x for x in vals):
                raise ValueError(f"{key}: an 'in' value cannot hold a comma (the API splits the list at commas): {vals!r}")
            out.append((key, "in:" + ",".join(vals)))
        elif key in ("sort", "group_by") and op == "=":
            out.append((key, _text(v)))
        elif key in _PLAIN and op == "=":
            out.append((key, _literal(_text(v))))
        else:
            out.append((key, f"{_OPS[op]}:{_text(v)}"))
    return out


#: parameters of GET /api/v1/runs that are not filters (sent as they are)
_RESERVED = frozenset({"sort", "offset", "limit", "group_by", "figures", "columns"})
#: filters whose plain value is sent bare (``name=x``) — unless it looks like an operator
_PLAIN = frozenset({"since", "until", "commit", "name", "family", "status", "tag"})
_OP_PREFIX = re.compile(r"^(eq|ne|lt|gt|le|ge|in):", re.S)


def _literal(value: str) -> str:
    """A filter value as a value: the server reads ``name=gt:x`` as the operator ``gt``, so a value that
    starts with an operator prefix is sent as ``eq:<value>`` (which the server reads as the literal)."""
    return f"eq:{value}" if _OP_PREFIX.match(value) else value


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if hasattr(v, "isoformat"):
        return str(v.isoformat())
    return str(v)


_RUN_FIELDS = ("id", "name", "model_family", "status", "world_size", "mp_size", "device_type", "git_commit",
               "started_at", "finished_at", "steps", "job_id", "attempt")


def _flatten(prefix: str, d: Any, out: dict[str, Any]) -> None:
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = d


def _flat_run(r: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {k: r.get(k) for k in _RUN_FIELDS}
    cfg = r.get("config")
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            _flatten(f"config.{k}", v, row)
    meta = r.get("meta")
    row["tags"] = list(meta.get("tags") or []) if isinstance(meta, dict) and isinstance(meta.get("tags"), list) else []
    for k, v in (r.get("figures") or {}).items():
        if k != "steps":
            row[k] = v
    for k, v in (r.get("columns") or {}).items():
        row[k] = v
    return row


def _run_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Run fields, then every config key seen (sorted), tags, figures, extra columns."""
    flat = [_flat_run(r) for r in rows]
    cfg = sorted({k for f in flat for k in f if k.startswith("config.")})
    rest: list[str] = []
    for f in flat:
        for k in f:
            if k not in _RUN_FIELDS and not k.startswith("config.") and k not in rest:
                rest.append(k)
    return [*_RUN_FIELDS, *cfg, *rest]
