"""`fleetscope serve`: uvicorn in the foreground; embedded Postgres started and stopped around it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from .app import create_app
from .db import resolve_database_url
from .settings import Settings

if TYPE_CHECKING:
    import uvicorn

__all__ = ["run_server", "uvicorn_config"]

log = logging.getLogger(__name__)


def uvicorn_config(app: FastAPI, settings: Settings, **overrides: object) -> uvicorn.Config:
    """uvicorn's configuration for ``app``. uvicorn's own proxy-header handling is off (by default it
    believes ``X-Forwarded-For`` from loopback, so every local process could pose as any client): the
    edge (``server/edge.py``) reads ``X-Forwarded-For`` only from the peers in
    ``settings.forwarded_allow_ips``."""
    import uvicorn

    kw: dict[str, Any] = {"host": settings.host, "port": settings.port, "log_level": "info", "lifespan": "on",
                          "timeout_graceful_shutdown": 10, "access_log": False, "proxy_headers": False}
    kw.update(overrides)
    return uvicorn.Config(app, **kw)


def freeze_startup_heap() -> None:
    """Move what is alive once the server is up (modules, the app and its routes, the dashboard's
    layouts: hundreds of thousands of objects that live as long as the process) out of the cyclic
    collector's reach. A full collection then walks only what requests allocated since, instead of the
    whole heap: on the serving process those were 75-110 ms pauses of every thread, a few per ten
    seconds under load, each one a /healthz answer that late (bench/reads.py). Only for a process that
    serves until it exits: frozen objects are never collected."""
    import gc

    gc.collect()
    gc.freeze()
    log.debug("startup heap frozen: %d objects", gc.get_freeze_count())


def run_server(settings: Settings, *, app_factory: Callable[..., FastAPI] = create_app,
               on_ready: Callable[[str, FastAPI], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``on_ready(base_url, app)`` runs in a thread once /healthz is up.

    ``app_factory(settings, database_url=...)`` builds the app: the API alone by default; the CLI
    passes ``fleetscope.webapp.create_web_app`` (API + dashboard)."""
    import sys

    import uvicorn

    # a shorter GIL switch interval (5 ms by default): with reads and ingest busy on worker threads, the
    # event loop (``/healthz``, the edge, admission) gets the interpreter back within ~1 ms, not ~5 ms per
    # busy thread (bench/reads.py: /healthz p99 under ten worst-case reads)
    sys.setswitchinterval(0.001)
    url, pg = resolve_database_url(settings.database_url, settings.data_dir)
    try:
        app = app_factory(settings, database_url=url)
        server = uvicorn.Server(uvicorn_config(app, settings))
        base = f"http://{settings.host}:{settings.port}"

        def _wait_then_call() -> None:
            import time

            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                freeze_startup_heap()
                if on_ready is not None:
                    try:
                        on_ready(base, app)
                    except Exception:  # noqa: BLE001
                        log.exception("startup task failed")

        threading.Thread(target=_wait_then_call, name="fleetscope-on-ready", daemon=True).start()
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; with these no-op handlers that
        # re-raise just returns, so the finally below stops embedded Postgres (no orphan postmaster)
        import signal

        def _ignore(signum: int, frame: FrameType | None) -> None:
            log.debug("signal %s after shutdown", signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        stopper: list[threading.Thread] = []
        if on_shutdown is not None:
            # stop what the caller started (e.g. the demo's job) as soon as the first signal arrives,
            # so its connections are gone by the time uvicorn drains them
            orig_handle_exit = server.handle_exit

            def handle_exit(sig: int, frame: FrameType | None) -> None:
                if not stopper:
                    t = threading.Thread(target=on_shutdown, name="fleetscope-shutdown", daemon=True)
                    stopper.append(t)
                    t.start()
                orig_handle_exit(sig, frame)

            server.handle_exit = handle_exit  # type: ignore[method-assign]
        try:
            server.run()
        finally:
            if stopper:
                stopper[0].join(30)
            elif on_shutdown is not None:
                on_shutdown()
    finally:
        if pg is not None:
            if pg.stop():
                log.info("embedded Postgres stopped")
