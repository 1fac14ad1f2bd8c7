"""Reads that cannot stall the store: their own pool, a time budget per statement, and cancellation
when the client goes away.

- **Their own pool.** The read API and the dashboard use ``AppState.read_engine`` (``read_pool_size``
  connections); ingest, compaction and the background passes use ``AppState.engine``. However many
  reads wait for a connection, ingest never does.
- **A budget per statement.** Every connection of the read pool has ``statement_timeout`` =
  ``read_timeout_s`` (server/db.py ``make_engine``): Postgres itself cancels a statement past it, and the
  client gets a 503 naming the budget (``app.py``), never a stuck worker.
- **Cancelled when the client goes away.** :class:`CancelOnDisconnect` watches each GET request's
  connection; when the client disconnects while the request is still running, the statements its
  read connections are running are cancelled at once (``psycopg``'s cancel request), so an abandoned
  query does not run on for its whole budget. Which connections a request holds is recorded by pool
  events in a context variable the request's worker thread inherits.

Routes declare ``st: ReadState`` to get the server's state with ``engine`` bound to the read pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import threading
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy import Engine, event

from .deps import get_state
from .state import AppState

__all__ = ["ReadState", "read_state", "CancelOnDisconnect", "track_connections", "cancel_count"]

log = logging.getLogger(__name__)


class _Held:
    """The DBAPI connections one request has checked out of the read pool right now."""

    __slots__ = ("conns", "lock", "done")

    def __init__(self) -> None:
        self.conns: set[Any] = set()
        self.lock = threading.Lock()
        self.done = False

    def cancel(self) -> int:
        with self.lock:
            if self.done:
                return 0
            conns = list(self.conns)
        n = 0
        for c in conns:
            try:
                getattr(c, "cancel_safe", c.cancel)()
                n += 1
            except Exception:  # noqa: BLE001 - the connection may have just finished or closed
                log.debug("cancel of an abandoned read failed", exc_info=True)
        return n


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("fleetscope_read_held", default=None)
_cancelled = [0]


def cancel_count() -> int:
    """Statements cancelled because their client went away (this process)."""
    return _cancelled[0]


def track_connections(engine: Engine) -> None:
    """Record each connection the current request checks out of ``engine`` (and forget it at check-in)."""

    @event.listens_for(engine, "checkout")
    def _out(dbapi_conn: Any, _rec: Any, _proxy: Any) -> None:
        held = _HELD.get()
        if held is not None:
            with held.lock:
                if not held.done:
                    held.conns.add(dbapi_conn)

    @event.listens_for(engine, "checkin")
    def _in(dbapi_conn: Any, _rec: Any) -> None:
        held = _HELD.get()
        if held is not None:
            with held.lock:
                held.conns.discard(dbapi_conn)


class CancelOnDisconnect:
    """ASGI middleware for GET requests: admission (at most ``concurrency`` API reads at once — each waits
    at most ``wait_s`` for its turn, then a 503 "too many reads at once"), and cancellation of the
    request's running read statements when its client disconnects before the answer is sent.

    Admission keeps a burst of expensive reads from taking every core of the serving process: the
    event loop (``/healthz``, the edge) and ingest keep their share. ``/healthz``, ``/metrics`` and the
    dashboard's pages are not counted."""

    def __init__(self, app: Any, concurrency: int = 4, wait_s: float = 5.0) -> None:
        self.app = app
        self.concurrency = max(1, concurrency)
        self.wait_s = wait_s
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        if not str(scope.get("path", "")).startswith("/api/"):
            await self._serve(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            from .edge import _reply

            await _reply(send, 503, f"too many reads at once (at most {self.concurrency} run at a time: "
                                    "read_concurrency); retry later", {"Retry-After": "2"})
            return
        try:
            await self._serve(scope, receive, send)
        finally:
            self._slots.release()

    async def _serve(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        held = _Held()
        token = _HELD.set(held)
        disconnected = asyncio.Event()

        async def watch() -> None:
            # a GET has no body: the only message left to receive is the disconnect
            while True:
                msg = await receive()
                if msg.get("type") == "http.disconnect":
                    disconnected.set()
                    n = held.cancel()
                    if n:
                        _cancelled[0] += n
                        log.info("client went away: cancelled %d running read statement(s) of %s", n,
                                 scope.get("path", "?")[:200])
                    return

        first = [True]

        async def quiet_receive() -> dict[str, Any]:
            # the app asks for the body (empty for a GET), then waits for the disconnect: both from what
            # the watcher sees, which alone reads the server's receive channel
            if first[0] and not disconnected.is_set():
                first[0] = False
                return {"type": "http.request", "body": b"", "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, quiet_receive, send)
        finally:
            with held.lock:
                held.done = True
                held.conns.clear()
            watcher.cancel()
            _HELD.reset(token)


async def read_state(request: Request, st: Annotated[AppState, Depends(get_state)]) -> AppState:
    """The server's state with ``engine`` bound to the read pool (the statement budget applies), for the
    reader of this request: its principal's runs only (reports/scope.py); a ``run_id`` in the path that
    the reader may not see is a 404, as if it did not exist."""
    from fastapi import HTTPException
    from starlette.concurrency import run_in_threadpool

    from .reports import scope

    scope.set_viewer(getattr(request.state, "principal", None))  # this request's task and its worker threads
    view = st if st.read_engine is None or st.read_engine is st.engine else dataclasses.replace(st, engine=st.read_engine)
    rid = request.path_params.get("run_id")
    if rid is not None and scope.visible_keys() is not None:
        if not await run_in_threadpool(scope.is_visible, view.engine, int(rid)):
            raise HTTPException(status_code=404, detail=f"run {int(rid)} not found")
    return view


ReadState = Annotated[AppState, Depends(read_state)]
