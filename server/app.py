"""The FastAPI application factory: ``create_app(settings)`` wires the store, ingest, API and dashboard."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError

from fleetscope import __version__
from fleetscope.settings import Settings

from .auth import TokenVerifier
from .compactor import CompactionResult, Compactor
from .db import make_engine, upgrade
from .ingest import IngestService
from .metrics import ServiceMetrics

__all__ = ["create_app", "AppState"]

log = logging.getLogger(__name__)


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    ingest: IngestService
    compactor: Compactor
    tokens: TokenVerifier
    metrics: ServiceMetrics
    ready: bool = False


def _live_sample(state_ref: dict[str, Any]) -> dict[str, Any]:
    st: AppState | None = state_ref.get("state")
    if st is None:
        return {}
    pool = st.engine.pool
    out: dict[str, Any] = {
        "fleetscope_db_pool_checked_out": ("DB connections in use", float(getattr(pool, "checkedout", lambda: 0)()), None),
        "fleetscope_ingest_queue_depth": ("Batches waiting for a writer", float(st.ingest.admission.waiting), None),
        "fleetscope_ingest_active_writers": ("Batches being written", float(st.ingest.admission.active), None),
        "fleetscope_compaction_backlog_rows": ("Landed rank-steps not yet compacted", float(st.ingest.backlog_rows), None),
    }
    with st.engine.connect() as c:
        rows = c.execute(
            text("SELECT status, count(*), coalesce(sum(world_size), 0) FROM runs GROUP BY status")
        ).fetchall()
    out["fleetscope_runs"] = ("Runs by status", [((r[0],), float(r[1])) for r in rows], ("status",))
    out["fleetscope_active_ranks"] = (
        "Ranks of running runs",
        float(sum(r[2] for r in rows if r[0] == "running")),
        None,
    )
    return out


def create_app(settings: Settings, *, database_url: str | None = None, start_background: bool = True) -> FastAPI:
    """Build the app. ``database_url`` must be resolved already (embedded Postgres is the CLI's job)."""
    url = database_url or settings.database_url
    if not url:
        raise ValueError("create_app needs a database URL (the CLI starts embedded Postgres and passes it)")
    state_ref: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate:
            upgrade(url)
        engine = make_engine(url, pool_size=settings.pool_size)
        metrics = ServiceMetrics(lambda: _live_sample(state_ref))
        ingest = IngestService(
            engine,
            concurrency=settings.ingest_concurrency,
            queue=settings.ingest_queue,
            backlog_max_rows=settings.backlog_max_rows,
            max_batch_records=settings.max_batch_records,
        )

        def on_pass(res: CompactionResult) -> None:
            ingest.backlog_rows = res.backlog_rows
            if res.steps:
                metrics.compaction_seconds.observe(res.seconds)
                metrics.compacted.labels("rank_step").inc(res.rank_steps)
                metrics.compacted.labels("collective").inc(res.collectives)
                metrics.duplicates.inc(res.duplicates)

        compactor = Compactor(engine, grace_s=settings.compact_grace_s, on_pass=on_pass)
        state = AppState(settings, engine, ingest, compactor, TokenVerifier(engine), metrics)
        app.state.fs = state
        state_ref["state"] = state
        from .analysis.service import start_analysis

        stop_analysis = start_analysis(state, start_background=start_background)
        if settings.insecure_no_auth:
            log.warning("AUTH IS DISABLED (--insecure-no-auth): anyone who can reach this port can write data")
        if start_background:
            compactor.start(settings.compact_interval_s)
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            stop_analysis()
            compactor.stop()
            try:
                compactor.run_once()
            except Exception:  # noqa: BLE001 - shutdown must proceed; raw rows stay for the next start
                log.exception("final compaction failed")
            engine.dispose()

    app = FastAPI(
        title="fleetscope",
        version=__version__,
        description="Performance observability for training fleets: ingest and query API.",
        lifespan=lifespan,
    )

    from .routes import benchmarks, health, ingest, runs, traces

    app.include_router(health.router)
    app.include_router(ingest.router, prefix="/api/v1")
    app.include_router(runs.router, prefix="/api/v1")
    app.include_router(benchmarks.router, prefix="/api/v1")
    app.include_router(traces.router, prefix="/api/v1")
    try:
        from .routes import alerts

        app.include_router(alerts.router, prefix="/api/v1")
    except ImportError:  # pragma: no cover
        pass

    @app.exception_handler(DataError)
    @app.exception_handler(psycopg.DataError)
    async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
        # the database refused a value the client sent (NUL characters, out-of-range numbers or times):
        # a 422 naming the problem, never a 500
        msg = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
        return JSONResponse({"detail": f"invalid value: {msg}"}, status_code=422)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - last resort
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    _mount_dashboard(app, state_ref)
    return app


def _mount_dashboard(app: FastAPI, state_ref: dict[str, Any]) -> None:
    """Mount the Dash app at / when the dashboard package provides one."""
    try:
        from fleetscope.dashboard.app import mount  # type: ignore[attr-defined]
    except ImportError:
        from fastapi.responses import HTMLResponse

        @app.get("/", include_in_schema=False, response_class=HTMLResponse)
        def _index() -> str:
            return "<html><body><h1>fleetscope</h1><p>API: <a href='/docs'>/docs</a></p></body></html>"

        return
    mount(app, state_ref)
