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
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetscope import __version__

from . import retention
from .alerts import AlertWorker
from .analysis.rollups import fold_rank_rollups
from .auth import TokenVerifier
from .compactor import CompactionResult, CompactionWorkers, Compactor
from .db import make_engine, upgrade
from .dcgm import DcgmReader
from .edge import EdgeMiddleware
from .errors import error_body
from .health_pass import HealthWorker, params_from
from .ingest import IngestService
from .logutil import log_throttled
from .metrics import ServiceMetrics
from .notifier import Notifier
from .openapi import api_schema
from .prom import scrape_groups
from .reads import CancelOnDisconnect, track_connections
from .routes import (
    alerts,
    baselines,
    benchmarks,
    compare,
    devices,
    health,
    ingest,
    kernels,
    memory,
    nodes,
    overlap,
    projection,
    run_health,
    runs,
    traces,
    utilisation,
)
from .settings import Settings
from .state import AppState
from .store import runs as run_store

__all__ = ["create_app"]

log = logging.getLogger(__name__)


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
    # reads: a pool of their own (ingest is never starved) whose statements Postgres cancels past the budget
    read_engine = make_engine(url, pool_size=settings.read_pool_size, statement_timeout_s=settings.read_timeout_s,
                              pool_timeout_s=max(1.0, settings.read_timeout_s))
    track_connections(read_engine)
    metrics = ServiceMetrics(scrape_groups(lambda: getattr(app.state, "fs", None)))
    ingest_service = IngestService(
        engine,
        concurrency=settings.ingest_concurrency,
        queue=settings.ingest_queue,
        backlog_max_rows=settings.backlog_max_rows,
        max_batch_records=settings.max_batch_records,
    )
    public = settings.public_url or f"http://{settings.host}:{settings.port}"

    def run_info(run_id: int) -> tuple[str, str | None] | None:
        r = run_store.runs_by_ids(engine, [run_id]).get(run_id)
        return None if r is None else (r.name, r.model_family)

    # delivery driven by the alerts table (store.alert_deliveries): one worker and queue per sink
    notifier = Notifier(slack_webhook_url=settings.slack_webhook_url, webhook_url=settings.alert_webhook_url,
                        alertmanager_url=settings.alertmanager_url, run_info=run_info, generator_url=public,
                        engine=engine)
    metrics.watch_alert_sinks(notifier.stats)
    worker = AlertWorker(engine, notifier=notifier, public_url=public, interval_s=settings.alert_interval_s,
                         step_check_interval_s=settings.alert_step_check_interval_s)

    def on_pass(res: CompactionResult) -> None:
        ingest_service.backlog_rows = res.backlog_rows
        if res.steps:
            metrics.compaction_pass(res.seconds, res.rank_steps, res.collectives, res.duplicates)
            if res.runs:
                worker.poke(runs=res.runs)  # newly compacted steps: look for regressions in those runs

    compactor = Compactor(engine, grace_s=settings.compact_grace_s, on_pass=on_pass)
    compactor.folds.append(fold_rank_rollups)
    health_worker = HealthWorker(engine, params_from(settings), notifier=notifier, public_url=public,
                                 interval_s=settings.health_interval_s)
    return AppState(settings=settings, engine=engine, ingest=ingest_service, compactor=compactor,
                    tokens=TokenVerifier(engine), metrics=metrics, notifier=notifier, alerts=worker,
                    health=health_worker, read_engine=read_engine)


class _CompactionFollower:
    """With compaction in worker processes: keep the ingest admission's backlog figure current and
    hand the runs the workers compacted to regression detection, as the in-process compactor's
    ``on_pass`` does."""

    def __init__(self, state: AppState, interval_s: float, workers: CompactionWorkers | None = None) -> None:
        self._state = state
        self._workers = workers
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
            if self._workers is not None:  # the workers' passes, counted in this process's metrics
                for p in self._workers.drain_passes():
                    self._state.metrics.compaction_pass(*p)
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
        dcgm_reader: DcgmReader | None = None
        if start_background:
            if settings.compaction_workers > 0:
                workers = CompactionWorkers(url, settings.compaction_workers, grace_s=settings.compact_grace_s,
                                            interval_s=settings.compact_interval_s)
                workers.start()
                follower = _CompactionFollower(state, settings.compact_interval_s, workers)
                follower.start()
                log.info("compaction in %d worker processes", settings.compaction_workers)
            else:
                state.compactor.start(settings.compact_interval_s)
            state.notifier.start()  # delivers what the alerts table holds undelivered (a restart, another instance)
            if settings.alerts_enabled:
                state.alerts.start()
            if settings.health_enabled and state.health is not None:
                state.health.start()
            if retention.policy_for(settings, None).any or settings.retention_overrides:
                keeper = retention.RetentionWorker(state.engine, settings)
                keeper.start()
            dcgm_reader = DcgmReader.from_settings(state.engine, settings)
            if dcgm_reader is not None:  # GPU telemetry from dcgm-exporter, for ranks without the agent's
                dcgm_reader.start()
        app.state.dcgm = dcgm_reader
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            if keeper is not None:
                keeper.stop()
            if dcgm_reader is not None:
                dcgm_reader.stop()
            if follower is not None:
                follower.stop()
            if workers is not None:
                workers.stop()
            state.alerts.stop()
            if state.health is not None:
                state.health.stop()
            state.notifier.close()
            state.compactor.stop()
            try:
                state.compactor.run_once()
            except Exception:  # noqa: BLE001 - shutdown must proceed; raw rows stay for the next start
                log.exception("final compaction failed")
            state.engine.dispose()
            if state.read_engine is not None:
                state.read_engine.dispose()

    app = FastAPI(
        title="fleetscope",
        version=__version__,
        description="Performance observability for training fleets: ingest and query API.",
        lifespan=lifespan,
    )

    app.add_middleware(EdgeMiddleware, settings=settings, get_state=lambda: getattr(app.state, "fs", None))
    # outermost: it alone reads a GET's receive channel; admits at most read_concurrency API reads at once
    app.add_middleware(CancelOnDisconnect, concurrency=settings.read_concurrency,
                       wait_s=max(1.0, settings.read_timeout_s))
    app.include_router(health.router)
    for r in (ingest.router, runs.router, benchmarks.router, traces.router, alerts.router, baselines.router, nodes.router,
              kernels.router, overlap.router, run_health.router, devices.router, compare.router,
              projection.router, memory.router, utilisation.router):
        app.include_router(r, prefix="/api/v1")

    @app.exception_handler(DataError)
    @app.exception_handler(psycopg.DataError)
    async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
        # the database refused a value the client sent (NUL characters, out-of-range numbers or times):
        # a 422 naming the problem, never a 500
        msg = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
        return JSONResponse(error_body(422, f"invalid value: {msg}"), status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each bad input whole (a 50 MB string, a lone surrogate that cannot
        # even be encoded): say where and what, with at most a short, ASCII-safe excerpt of the value
        return JSONResponse(error_body(422, [_brief_error(e) for e in exc.errors()[:20]]), status_code=422)

    @app.exception_handler(OperationalError)
    @app.exception_handler(psycopg.OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _db_down(request: Request, exc: Exception) -> JSONResponse:
        orig = getattr(exc, "orig", None) or exc
        if isinstance(orig, psycopg.errors.QueryCanceled):
            # the read's statement budget (read_timeout_s) or its client went away: not an outage
            budget = settings.read_timeout_s
            log_throttled(log, logging.INFO, f"read-budget:{request.url.path[:64]}",
                          "read over its %.1f s budget: %s %s", budget, request.method, request.url.path[:200])
            return JSONResponse(error_body(503, f"this read took longer than its budget ({budget:g} s, "
                                                "read_timeout_s) and was cancelled: narrow it (fewer filters, "
                                                "a smaller page) or retry later"),
                                status_code=503, headers={"Retry-After": "5"})
        if isinstance(orig, psycopg.errors.ProgramLimitExceeded):
            # the request asked for more than Postgres can do in one statement (columns, sort keys): the client's
            msg = str(orig).splitlines()[0][:200]
            return JSONResponse(error_body(422, f"the request exceeds a database limit: {msg}"), status_code=422)
        if isinstance(exc, PoolTimeout) and request.method == "GET":
            return JSONResponse(error_body(503, "too many reads at once; retry later"), status_code=503,
                                headers={"Retry-After": "2"})
        # Postgres unreachable or restarting: the client should come back, not see a server error
        log_throttled(log, logging.WARNING, "db-down", "database unavailable on %s %s: %s", request.method,
                      request.url.path[:200], type(exc).__name__)
        return JSONResponse(error_body(503, "database unavailable; retry later"), status_code=503,
                            headers={"Retry-After": "2"})

    @app.exception_handler(OverflowError)
    async def _out_of_range(request: Request, exc: OverflowError) -> JSONResponse:
        # a number or time too large to represent (since=1e20): the client's value, never a 500
        return JSONResponse(error_body(422, f"a value is out of range: {str(exc)[:200]}"), status_code=422)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - last resort
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # HTTPException from routes and dependencies (404, 403, 401, 503 ...): the one error body
        return JSONResponse(error_body(exc.status_code, exc.detail), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.openapi = lambda: api_schema(app)  # type: ignore[method-assign]
    return app
