"""The health pass: every few seconds, the state of every run that has not ended (docs/metrics.md "Run
states"), stored in ``run_health`` and ``runs.status``, with ``hang``, ``node_lost`` and ``failure``
alerts (one per incident, resolved by themselves when steps resume) handed to the notifier.

:func:`assess` is the one evaluation, shared by the pass and ``GET /runs/{id}/health``: it reads what
it needs (cheaply while a run makes progress: positions only once it has stalled) and calls the pure
state machine ``analysis.health.evaluate``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from .analysis.health import HealthParams, Verdict, evaluate, stall_threshold
from .limits import MAX_HEALTH_RANKS_LISTED, MAX_HEALTH_STACKS
from .store import alerts as alert_store
from .store import health as store

__all__ = ["HealthWorker", "assess", "params_from", "Assessment", "HEALTH_ALERT_KINDS"]

log = logging.getLogger(__name__)

HEALTH_ALERT_KINDS = ("hang", "node_lost", "failure")
_STATUS = {"running": "running", "stalled": "stalled", "hung": "hung", "failed": "failed"}


def params_from(settings: Any) -> HealthParams:
    return HealthParams(
        stall_min_s=float(getattr(settings, "stall_min_s", 60.0)),
        stall_factor=float(getattr(settings, "stall_factor", 10.0)),
        stall_first_s=float(getattr(settings, "stall_first_s", 600.0)),
        silence_s=float(getattr(settings, "stall_silence_s", 30.0)),
        pause_max_s=float(getattr(settings, "pause_max_s", 1800.0)),
        max_listed=MAX_HEALTH_RANKS_LISTED, max_stacks=MAX_HEALTH_STACKS,
    )


@dataclass
class Assessment:
    run: store.RunProgress
    verdict: Verdict
    seen_step: int | None
    progress_at: float
    hang_s: float  # hang time of ended incidents plus the open one
    failures: list[store.Failure]
    n_failures: int


def assess(engine: Engine, rp: store.RunProgress, params: HealthParams, *, full: bool = False) -> Assessment:
    """The run's state now. ``full``: load failures and pauses even when the run is progressing (the API)."""
    seen, progress_at = rp.seen_step, rp.progress_at
    if rp.current_step is not None and (seen is None or rp.current_step > seen):
        seen, progress_at = rp.current_step, rp.now
    if progress_at is None:
        progress_at = min(rp.started_at, rp.now)
    age = rp.now - progress_at
    ended = rp.status not in ("running", "stalled", "hung")
    cheap = (not full and not ended and rp.failures == 0 and rp.state in ("running", None)
             and age < min(params.stall_min_s, params.stall_first_s))
    fails: list[store.Failure] = []
    n_failed_ranks = 0
    if cheap:
        v = Verdict("running")
    else:
        if rp.failures:
            fails = store.failures(engine, rp.run_id, limit=64)
            n_failed_ranks = store.failure_count(engine, rp.run_id)[1]
        p99 = store.step_p99(engine, rp.run_id) if rp.steps else None
        open_pauses = store.pauses(engine, rp.run_id, open_only=True, limit=4096) if not ended else []
        pause_end = store.last_pause_end(engine, rp.run_id) if not ended else None
        nodes: dict[int, str] = {}
        positions = None
        ref_age = rp.now - max(progress_at, pause_end or 0.0)
        if not ended and ref_age >= stall_threshold(params, rp.steps, p99):
            positions = store.positions(engine, rp.run_id, limit=rp.world_size)
            nodes = store.node_map(engine, rp.run_id)
        elif fails:
            nodes = store.node_map(engine, rp.run_id)
        v = evaluate(name=rp.name, status=rp.status, world_size=rp.world_size, steps=rp.steps,
                     current_step=rp.current_step, now=rp.now, progress_at=progress_at, p99_step_s=p99,
                     failures=fails, n_failed_ranks=n_failed_ranks, finished_at=rp.finished_at, pauses=open_pauses,
                     positions=positions, nodes=nodes, params=params, last_pause_end=pause_end)
    hang_s = rp.hang_s
    if v.state in ("stalled", "hung") and v.since is not None:
        hang_s += max(rp.now - v.since, 0.0)
    return Assessment(rp, v, seen, progress_at, hang_s, fails, rp.failures)


def _closed_hang_s(rp: store.RunProgress, v: Verdict) -> float:
    """The hang seconds of ended incidents after this pass: an incident that ended now is added."""
    if rp.state in ("stalled", "hung") and v.state not in ("stalled", "hung") and rp.since is not None:
        return rp.hang_s + max(rp.now - rp.since, 0.0)
    return rp.hang_s


def _alert(a: Assessment, public_url: str | None) -> alert_store.AlertWrite:
    v = a.verdict
    kind = v.kind or "hang"
    thr = v.threshold_s or 0.0
    age = max(a.run.now - (v.since or a.run.now), 0.0)
    details = {"series": f"health:{a.run.run_id}", "unit": "s", "finding": v.alert_finding or v.finding,
               "state": v.state,
               "run_name": a.run.name, "step": v.step, "missing_ranks": v.missing_ranks[:64],
               "missing_count": v.missing_count, "missing_nodes": v.missing_nodes[:16], "collective": v.collective,
               "stuck": v.stuck}
    if kind == "failure" and a.failures:
        f = a.failures[0]
        details["root_cause"] = {"rank": f.rank, "exception": f.exception, "signal": f.signal,
                                 "exit_code": f.exit_code, "step": f.step}
    return alert_store.AlertWrite(
        key=(kind, f"health:{a.run.run_id}", "run_state"),
        dedup_key=f"{kind}:health:{a.run.run_id}:{int(v.since or 0)}",
        run_id=a.run.run_id, before=thr, after=age, change=(age / thr - 1.0) if thr > 0 else 0.0, significance=None,
        first_bad_json=json.dumps({"step": v.step, "since": v.since}), details_json=json.dumps(details, default=str),
        url=(public_url or "").rstrip("/") + f"/runs/{a.run.run_id}",
    )


class HealthWorker:
    """The periodic health pass on a background thread; never raises into its caller."""

    def __init__(self, engine: Engine, params: HealthParams, *, notifier: Any = None, public_url: str | None = None,
                 interval_s: float = 5.0) -> None:
        self.engine = engine
        self.params = params
        self.notifier = notifier
        self.public_url = public_url
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.passes = 0
        self.errors = 0
        self.last_pass_s = 0.0
        self.last_runs = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetscope-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(max(self.interval_s, 0.05)):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the pass must never take the server down
                self.errors += 1
                log.exception("health pass failed (will retry on the next pass)")

    def run_once(self) -> list[tuple[str, dict[str, Any]]]:
        """One pass over the runs that have not ended; returns the alert events it sent."""
        with self._lock:
            t0 = time.perf_counter()
            events: list[tuple[str, dict[str, Any]]] = []
            runs = store.progress(self.engine)
            for rp in runs:
                try:
                    events += self._one(rp)
                except Exception:  # noqa: BLE001 - one run's bad data must not stop the others
                    self.errors += 1
                    log.exception("health pass: run %s failed", rp.run_id)
            self.passes += 1
            self.last_runs = len(runs)
            self.last_pass_s = time.perf_counter() - t0
        if self.notifier is not None:
            for event, alert in events:
                self.notifier.notify(alert, event)
        return events

    def _one(self, rp: store.RunProgress) -> list[tuple[str, dict[str, Any]]]:
        a = assess(self.engine, rp, self.params)
        v = a.verdict
        prev = rp.state
        changed = (prev != v.state or a.seen_step != rp.seen_step or v.state in ("stalled", "hung", "failed")
                   or rp.progress_at is None)
        if changed:
            since = v.since if v.state != "running" else None
            store.save_health(self.engine, rp.run_id, state=v.state, since=since, finding=v.finding,
                              detail=v.detail(), seen_step=a.seen_step, progress_at=a.progress_at,
                              hang_s=_closed_hang_s(rp, v), status=_STATUS.get(v.state))
        # alerts: one per incident; a hang only when the pass saw the run progress before (a run that
        # was already stopped when this server first looked at it is marked, not paged)
        alertable = v.kind is not None and (v.kind == "failure" or prev is not None)
        if alertable or prev in ("stalled", "hung", "failed") or prev != v.state:
            writes = [_alert(a, self.public_url)] if alertable else []
            return alert_store.reconcile(self.engine, writes, [f"health:{rp.run_id}"])
        return []
