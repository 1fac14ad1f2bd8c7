"""The FastAPI application factory: ``create_app(settings)`` wires the store, ingest, compaction, alerts and API."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from fleetscope import __version__

from . import retention
from .alerts import AlertWorker
from .analysis.rollups import fold_rank_rollups
from .auth import TokenVerifier
from .compactor import CompactionResult, CompactionWorkers, Compactor
from .db import make_engine, upgrade
from .edge import EdgeMiddleware
from .ingest import IngestService
from .metrics import ServiceMetrics
from .notifier import Notifier
from .routes import alerts, benchmarks, health, ingest, kernels, nodes, overlap, runs, traces
from .settings import Settings
from .state import AppState
from .store import runs as run_store
from .store.runs import runs_by_status

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _live_sample(app: FastAPI) -> dict[str, Any]:
    st: AppState | None = getattr(app.state, "fs", None)
    if st is None:
        return {}
    pool = st.engine.pool
    out: dict[str, Any] = {
        "fleetscope_db_pool_checked_out": ("DB connections in use", float(getattr(pool, "checkedout", lambda: 0)()), None),
        "fleetscope_ingest_queue_depth": ("Batches waiting for a writer", float(st.ingest.admission.waiting), None),
        "fleetscope_ingest_active_writers": ("Batches being written", float(st.ingest.admission.active), None),
        "fleetscope_compaction_backlog_rows": ("Landed rank-steps not yet compacted", float(st.ingest.backlog_rows), None),
    }
    rows = runs_by_status(st.engine)
    out["fleetscope_runs"] = ("Runs by status", [((r[0],), float(r[1])) for r in rows], ("status",))
    out["fleetscope_active_ranks"] = (
        "Ranks of running runs",
        float(sum(r[2] for r in rows if r[0] == "running")),
        None,
    )
    return out


def _brief_error(e: Any) -> dict[str, Any]:
    """One validation error for the client: location, message, type, and an excerpt of the input."""
    out = {"loc": [str(p)[:64] for p in e.get("loc", ())], "msg": str(e.get("msg", ""))[:300], "type": e.get("type")}
    if "input" in e and not isinstance(e["input"], (dict, list)):
        out["input"] = ascii(e["input"])[:80]
    return out


def _build_state(settings: Settings, url: str, app: FastAPI) -> AppState:
    """Every part of the server, wired explicitly: store, ingest, compaction (+ the straggler rollup
    fold), token checks, metrics, and regression detection with its notifier."""
    engine = make_engine(url, pool_size=settings.pool_size)
    metrics = ServiceMetrics(lambda: _live_sample(app))
    ingest_service = IngestService(
        engine,
        concurrency=settings.ingest_concurrency,
        queue=settings.ingest_queue,
        backlog_max_rows=settings.backlog_max_rows,
        max_batch_records=settings.max_batch_records,
    )
    notifier = Notifier(slack_webhook_url=settings.slack_webhook_url, webhook_url=settings.alert_webhook_url)
    public = settings.public_url or f"http://{settings.host}:{settings.port}"
    worker = AlertWorker(engine, notifier=notifier, public_url=public, interval_s=settings.alert_interval_s,
                         step_check_interval_s=settings.alert_step_check_interval_s)

    def on_pass(res: CompactionResult) -> None:
        ingest_service.backlog_rows = res.backlog_rows
        if res.steps:
            metrics.compaction_seconds.observe(res.seconds)
            metrics.compacted.labels("rank_step").inc(res.rank_steps)
            metrics.compacted.labels("collective").inc(res.collectives)
            metrics.duplicates.inc(res.duplicates)
            if res.runs:
                worker.poke(runs=res.runs)  # newly compacted steps: look for regressions in those runs

    compactor = Compactor(engine, grace_s=settings.compact_grace_s, on_pass=on_pass)
    compactor.folds.append(fold_rank_rollups)
    return AppState(settings=settings, engine=engine, ingest=ingest_service, compactor=compactor,
                    tokens=TokenVerifier(engine), metrics=metrics, notifier=notifier, alerts=worker)


class _CompactionFollower:
    """With compaction in worker processes: keep the ingest admission's backlog figure current and
    hand the runs the workers compacted to regression detection, as the in-process compactor's
    ``on_pass`` does."""

    def __init__(self, state: AppState, interval_s: float) -> None:
        self._state = state
        self._interval = max(0.2, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleetscope-compaction-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        since = None
        while not self._stop.wait(self._interval):
            try:
                backlog, runs, since = run_store.compaction_progress(self._state.engine, since)
                self._state.ingest.backlog_rows = backlog
                if runs:
                    self._state.alerts.poke(runs=runs)
            except Exception:  # noqa: BLE001 - a database outage: try again next time
                log.debug("compaction follower: poll failed", exc_info=True)


def create_app(settings: Settings, *, database_url: str | None = None, start_background: bool = True) -> FastAPI:
    """The API server (ingest, read API, /healthz, /metrics). ``database_url`` must be resolved already
    (embedded Postgres is the CLI's job); the dashboard is mounted by the caller (``fleetscope.webapp``)."""
    url = database_url or settings.database_url
    if not url:
        raise ValueError("create_app needs a database URL (the CLI starts embedded Postgres and passes it)")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate:
            upgrade(url)
        state = _build_state(settings, url, app)
        app.state.fs = state
        if settings.insecure_no_auth:
            log.warning("AUTH IS DISABLED (--insecure-no-auth): anyone who can reach this port can write data")
        workers: CompactionWorkers | None = None
        keeper: retention.RetentionWorker | None = None
        follower: _CompactionFollower | None = None
        if start_background:
            if settings.compaction_workers > 0:
                workers = CompactionWorkers(url, settings.compaction_workers, grace_s=settings.compact_grace_s,
                                            interval_s=settings.compact_interval_s)
                workers.start()
                follower = _CompactionFollower(state, settings.compact_interval_s)
                follower.start()
                log.info("compaction in %d worker processes", settings.compaction_workers)
            else:
                state.compactor.start(settings.compact_interval_s)
            if settings.alerts_enabled:
                state.alerts.start()
            if retention.policy_for(settings, None).any or settings.retention_overrides:
                keeper = retention.RetentionWorker(state.engine, settings)
                keeper.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            if keeper is not None:
                keeper.stop()
            if follower is not None:
                follower.stop()
            if workers is not None:
                workers.stop()
            state.alerts.stop()
            state.notifier.close()
            state.compactor.stop()
            try:
                state.compactor.run_once()
            except Exception:  # noqa: BLE001 - shutdown must proceed; raw rows stay for the next start
                log.exception("final compaction failed")
            state.engine.dispose()

    app = FastAPI(
        title="fleetscope",
        version=__version__,
        description="Performance observability for training fleets: ingest and query API.",
        lifespan=lifespan,
    )

    app.add_middleware(EdgeMiddleware, settings=settings, get_state=lambda: getattr(app.state, "fs", None))
    app.include_router(health.router)
    for r in (ingest.router, runs.router, benchmarks.router, traces.router, alerts.router, nodes.router,
              kernels.router, overlap.router):
        app.include_router(r, prefix="/api/v1")

    @app.exception_handler(DataError)
    @app.exception_handler(psycopg.DataError)
    async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
        # the database refused a value the client sent (NUL characters, out-of-range numbers or times):
        # a 422 naming the problem, never a 500
        msg = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
        return JSONResponse({"detail": f"invalid value: {msg}"}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each bad input whole (a 50 MB string, a lone surrogate that cannot
        # even be encoded): say where and what, with at most a short, ASCII-safe excerpt of the value
        return JSONResponse({"detail": [_brief_error(e) for e in exc.errors()[:20]]}, status_code=422)

    @app.exception_handler(OperationalError)
    @app.exception_handler(psycopg.OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _db_down(request: Request, exc: Exception) -> JSONResponse:
        # Postgres unreachable or restarting: the client should come back, not see a server error
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return JSONResponse({"detail": "database unavailable; retry later"}, status_code=503,
                            headers={"Retry-After": "2"})

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - last resort
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    return app
