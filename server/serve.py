"""`fleetscope serve`: uvicorn in the foreground; embedded Postgres started and stopped around it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fleetscope.settings import Settings

from .app import create_app
from .db import resolve_database_url

__all__ = ["run_server"]

log = logging.getLogger(__name__)


def run_server(settings: Settings, *, on_ready: Callable[[str, object], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``on_ready(base_url, app)`` runs in a thread once /healthz is up."""
    import uvicorn

    url, pg = resolve_database_url(settings.database_url, settings.data_dir)
    try:
        app = create_app(settings, database_url=url)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level="info", lifespan="on",
            timeout_graceful_shutdown=10, access_log=False,
        )
        server = uvicorn.Server(config)
        if on_ready is not None:
            import threading

            base = f"http://{settings.host}:{settings.port}"

            def _wait_then_call() -> None:
                import time

                while not server.started and not server.should_exit:
                    time.sleep(0.05)
                if server.started:
                    try:
                        on_ready(base, app)
                    except Exception:  # noqa: BLE001
                        log.exception("startup task failed")

            threading.Thread(target=_wait_then_call, name="fleetscope-on-ready", daemon=True).start()
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; turn that into a normal exit so
        # the finally below stops embedded Postgres (no orphan postmaster)
        def _exit(signum: int, frame: object) -> None:
            raise SystemExit(0)

        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _exit)
        try:
            server.run()
        finally:
            if on_shutdown is not None:
                on_shutdown()
    finally:
        if pg is not None:
            pg.stop()
            log.info("embedded Postgres stopped")
