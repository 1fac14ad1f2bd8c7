"""Alerts: a lifecycle over detected regressions, stored in ``alerts``, deduplicated.

States: ``firing`` → ``acknowledged`` (a person saw it; it stays active) → ``resolved`` (the series
recovered — detected automatically — or a person resolved it). One active alert per (kind, series,
metric): a new detection of the same series updates it instead of raising another, so re-running
detection never storms. ``dedup_key`` = kind:series:metric:first-bad, unique: a regression a person
resolved by hand is not raised again; a new regression of the same series later is.

``AlertWorker`` runs detection on a background thread after compaction passes (throttled) and hands
new and resolved alerts to the notifier — ingest never waits on it and never sees its errors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["sync", "list_alerts", "get_alert", "set_state", "AlertWorker", "alert_url", "ALERT_STATES"]

log = logging.getLogger(__name__)

ALERT_STATES = ("firing", "acknowledged", "resolved")
_COLS = ("id, dedup_key, kind, metric, state, run_id, before, after, change, significance, first_bad, details, url, "
         "created_at, updated_at, acknowledged_at, resolved_at")


def _row(r: Any) -> dict[str, Any]:
    d = dict(r._mapping)
    for k in ("created_at", "updated_at", "acknowledged_at", "resolved_at"):
        if d.get(k) is not None:
            d[k] = d[k].isoformat()
    return d


def alert_url(public_url: str | None, path: str) -> str:
    return (public_url or "").rstrip("/") + path


def list_alerts(engine: Engine, *, state: str | None = None, kind: str | None = None, run_id: int | None = None,
                limit: int = 500) -> list[dict[str, Any]]:
    """Alerts newest first, optionally by state, kind or run."""
    where: list[str] = []
    params: dict[str, Any] = {"limit": limit}
    for col, v in (("state", state), ("kind", kind), ("run_id", run_id)):
        if v is not None:
            where.append(f"{col} = :{col}")
            params[col] = v
    sql = f"SELECT {_COLS} FROM alerts" + (f" WHERE {' AND '.join(where)}" if where else "")
    sql += " ORDER BY created_at DESC, id DESC LIMIT :limit"
    with engine.connect() as c:
        return [_row(r) for r in c.execute(text(sql), params)]


def get_alert(engine: Engine, alert_id: int) -> dict[str, Any] | None:
    with engine.connect() as c:
        r = c.execute(text(f"SELECT {_COLS} FROM alerts WHERE id = :id"), {"id": alert_id}).fetchone()
    return _row(r) if r is not None else None


def set_state(engine: Engine, alert_id: int, state: str) -> dict[str, Any] | None:
    """Acknowledge or resolve an alert by hand (None if it does not exist). Resolving is final."""
    if state not in ("acknowledged", "resolved"):
        raise ValueError(f"state must be 'acknowledged' or 'resolved', got {state!r}")
    stamp = "acknowledged_at" if state == "acknowledged" else "resolved_at"
    guard = " AND state = 'firing'" if state == "acknowledged" else " AND state <> 'resolved'"
    with engine.begin() as c:
        c.execute(
            text(f"UPDATE alerts SET state = :s, {stamp} = now(), updated_at = now() WHERE id = :id{guard}"),
            {"s": state, "id": alert_id},
        )
        r = c.execute(text(f"SELECT {_COLS} FROM alerts WHERE id = :id"), {"id": alert_id}).fetchone()
    return _row(r) if r is not None else None


def sync(engine: Engine, found: Iterable[Any], evaluated: set[str], *, public_url: str | None = None) -> list[tuple[str, dict]]:
    """Reconcile detections with stored alerts for the ``evaluated`` series.

    Returns the notifications to send: ("fired" | "resolved", alert)."""
    found = list(found)
    events: list[tuple[str, dict[str, Any]]] = []
    by_series = {(f.kind, f.series, f.metric): f for f in found}
    with engine.begin() as c:
        active = c.execute(
            text(f"SELECT {_COLS} FROM alerts WHERE state IN ('firing', 'acknowledged') AND details->>'series' = ANY(:s)"),
            {"s": list(evaluated)},
        ).fetchall()
        active_by = {(r.kind, r.details.get("series"), r.metric): r for r in active}
        for key, f in by_series.items():
            details = {**f.details, "series": f.series, "unit": f.unit}
            params = {"before": f.before, "after": f.after, "change": f.change, "sig": f.significance,
                      "first_bad": json.dumps(f.first_bad, default=str), "details": json.dumps(details, default=str),
                      "url": alert_url(public_url, f.url_path), "run_id": f.run_id}
            if key in active_by:
                c.execute(
                    text("UPDATE alerts SET before = :before, after = :after, change = :change, significance = :sig, "
                         "first_bad = CAST(:first_bad AS jsonb), details = CAST(:details AS jsonb), url = :url, "
                         "run_id = :run_id, updated_at = now() WHERE id = :id"),
                    {**params, "id": active_by[key].id},
                )
                continue
            r = c.execute(
                text(f"INSERT INTO alerts (dedup_key, kind, metric, state, run_id, before, after, change, significance, "
                     f"first_bad, details, url) VALUES (:dk, :kind, :metric, 'firing', :run_id, :before, :after, :change, "
                     f":sig, CAST(:first_bad AS jsonb), CAST(:details AS jsonb), :url) ON CONFLICT (dedup_key) DO NOTHING "
                     f"RETURNING {_COLS}"),
                {**params, "dk": f.dedup_key, "kind": f.kind, "metric": f.metric},
            ).fetchone()
            if r is not None:
                events.append(("fired", _row(r)))
        for key, r in active_by.items():
            if key not in by_series:
                row = c.execute(
                    text(f"UPDATE alerts SET state = 'resolved', resolved_at = now(), updated_at = now() WHERE id = :id "
                         f"AND state <> 'resolved' RETURNING {_COLS}"),
                    {"id": r.id},
                ).fetchone()
                if row is not None:
                    events.append(("resolved", _row(row)))
    return events


class AlertWorker:
    """Background detection after compaction passes; never raises into its caller."""

    def __init__(self, engine: Engine, *, notifier: Any = None, public_url: str | None = None,
                 interval_s: float = 5.0, step_check_interval_s: float = 60.0) -> None:
        self.engine = engine
        self.notifier = notifier
        self.public_url = public_url
        self.interval_s = interval_s
        self.step_check_interval_s = step_check_interval_s
        self._runs: set[int] = set()
        self._bench: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_step_check: dict[int, tuple[float, int]] = {}
        self._pass_lock = threading.Lock()  # one detection pass at a time (background + on demand)
        self._step_pending: set[int] = set()
        self.passes = 0
        self.errors = 0

    def poke(self, *, runs: Iterable[int] = (), benchmark_series: Iterable[int] = ()) -> None:
        """Mark runs / benchmark series as changed (cheap; called from the compactor's thread)."""
        with self._lock:
            self._runs.update(int(r) for r in runs)
            self._bench.update(int(s) for s in benchmark_series)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetscope-alerts", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            self._wake.wait(timeout=max(self.interval_s, 0.05))
            if self._stop.is_set():
                return
            wait = self.interval_s - (time.monotonic() - last)
            if wait > 0 and self._stop.wait(wait):
                return
            self._wake.clear()
            last = time.monotonic()
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - detection must never take the server down
                self.errors += 1
                log.exception("regression detection pass failed (will retry on the next pass)")

    def run_once(self, *, everything: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """One detection pass over what changed (or everything); returns the notifications sent."""
        with self._pass_lock:
            return self._run_once(everything)

    def _run_once(self, everything: bool) -> list[tuple[str, dict[str, Any]]]:
        from .analysis.regressions import (
            benchmark_regressions,
            run_series_regressions,
            series_key,
            step_shift_regression,
            straggler_finding,
        )

        with self._lock:
            runs, bench = set(self._runs), set(self._bench)
            self._runs.clear()
            self._bench.clear()
        events: list[tuple[str, dict[str, Any]]] = []
        if runs or everything:
            found, evaluated = run_series_regressions(self.engine, run_ids=None if everything else sorted(runs))
            events += sync(self.engine, found, evaluated, public_url=self.public_url)
            self._step_pending |= runs
        if self._step_pending:
            now = time.monotonic()
            with self.engine.connect() as c:
                info = {r[0]: (r[1], int(r[2] or 0)) for r in c.execute(
                    text("SELECT id, status, steps FROM runs WHERE id = ANY(:ids)"), {"ids": sorted(self._step_pending)})}
            for rid in sorted(self._step_pending):
                status, steps = info.get(rid, ("gone", 0))
                last_t, last_steps = self._last_step_check.get(rid, (-1e9, -1))
                # within-run detection reads the run's steps: for a running run at most once per interval,
                # and only when it has grown by 10 steps or 5 %; a finished run once more
                if status == "running" and (now - last_t < self.step_check_interval_s
                                            or steps - last_steps < max(10, 0.05 * last_steps)):
                    continue
                self._step_pending.discard(rid)
                if status == "gone":
                    continue
                self._last_step_check[rid] = (now, steps)
                reg = step_shift_regression(self.engine, rid)
                events += sync(self.engine, [reg] if reg else [], {series_key("steps", rid)}, public_url=self.public_url)
                st = straggler_finding(self.engine, rid)
                events += sync(self.engine, [st] if st else [], {series_key("stragglers", rid)},
                               public_url=self.public_url)
        if bench or everything:
            found, evaluated = benchmark_regressions(self.engine, series_ids=None if everything else sorted(bench))
            events += sync(self.engine, found, evaluated, public_url=self.public_url)
        self.passes += 1
        if self.notifier is not None:
            for event, alert in events:
                self.notifier.notify(alert, event)
        return events
