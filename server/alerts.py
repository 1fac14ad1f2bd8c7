"""Alerts: a lifecycle over detected regressions, stored in ``alerts``, deduplicated.

States: ``firing`` → ``acknowledged`` (a person saw it; it stays active) → ``resolved`` (the series
recovered — detected automatically — or a person resolved it). One active alert per (kind, series,
metric): a new detection of the same series updates it instead of raising another, so re-running
detection never storms. ``dedup_key`` = kind:series:metric:first-bad, unique: a regression a person
resolved by hand is not raised again; one resolved by recovery and detected again is reopened (the
recovery did not last); a new regression of the same series later is a new alert.

A regression resolves by itself only when a run of its own setup recovers: an active ``run_series``
alert that detection no longer reports is held (kept firing) until a run of the alert's family, config
signature, device type and world size, newer than the runs it was detected on, exists — a run of
another setup of the family never resolves it.

Regression alerts carry ``cause`` and ``diff`` (``analysis.explain``, computed by ``reports.regressions``) in
their ``details``; the reads show them as top-level keys, with the one-sentence ``explanation``. So do
``straggler`` alerts (the component of the straggler's excess work; the rank versus its peers).
Within-run detection (a run's steps) raises ``step_time_shift``, ``straggler`` (one per run) and
``slow_node`` (one per (run, node) the network analysis calls slow) alerts.

Run-health alerts (``hang``, ``node_lost``, ``failure``: one per incident, resolved when steps resume,
a failure also when a later attempt of the job runs) come from the health pass
(``health_pass.HealthWorker``) through the same reconciliation.

Every transition (raised, acknowledged, resolved by hand or by recovery, reopened) is in the table;
``AlertWorker`` and the routes hand it to the notifier at once, and the notifier's per-sink workers
deliver from the table (``store.alert_deliveries``), so what a crash or another instance missed is
delivered too. Detection runs on a background thread after compaction passes (throttled) — ingest never
waits on it and never sees its errors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from . import reports
from .analysis.regressions import MIN_RUN_STEPS, Regression, series_key
from .store import alerts as alert_store
from .store import runs as run_store

__all__ = ["sync", "set_state", "AlertWorker", "alert_url", "ALERT_STATES"]

log = logging.getLogger(__name__)

ALERT_STATES = ("firing", "acknowledged", "resolved")


def alert_url(public_url: str | None, path: str) -> str:
    return (public_url or "").rstrip("/") + path


def set_state(engine: Engine, alert_id: int, state: str, *, notifier: Any = None) -> dict[str, Any] | None:
    """Acknowledge or resolve an alert by hand (None if it does not exist). Resolving is final. A
    transition is handed to ``notifier`` (every configured sink hears of it once)."""
    if state not in ("acknowledged", "resolved"):
        raise ValueError(f"state must be 'acknowledged' or 'resolved', got {state!r}")
    # only a firing alert can be acknowledged; anything not yet resolved can be resolved
    alert, changed = alert_store.set_state(engine, alert_id, state,
                                           only_from="firing" if state == "acknowledged" else "unresolved")
    if changed and alert is not None and notifier is not None:
        try:
            notifier.notify(alert, state)
        except Exception:  # noqa: BLE001 - the transition is stored; the delivery workers find it in the table
            log.warning("alert %s: could not hand the transition to the notifier", alert_id, exc_info=True)
    return alert


def sync(engine: Engine, found: Iterable[Regression], evaluated: set[str], *,
         public_url: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Reconcile detections with stored alerts for the ``evaluated`` series: a detection updates the
    active alert of its (kind, series, metric), else raises a new one (unless its dedup key was seen
    before); an active alert of an evaluated series that nothing detects any more resolves.

    Returns the notifications to send: ("fired" | "reopened" | "resolved", alert)."""
    writes = [
        alert_store.AlertWrite(
            key=(f.kind, _series(f), f.metric), dedup_key=f.dedup_key, run_id=f.run_id, before=f.before, after=f.after,
            change=f.change, significance=f.significance, first_bad_json=json.dumps(f.first_bad, default=str),
            details_json=json.dumps({**f.details, "series": _series(f), "unit": f.unit}, default=str),
            url=alert_url(public_url, f.url_path),
        )
        for f in found
    ]
    active = alert_store.active_in_series(engine, sorted(evaluated), subseries=True)
    series = set(evaluated) | {str((a.get("details") or {}).get("series")) for a in active}
    hold = _not_recovered(engine, active, {w.key for w in writes}, {w.dedup_key for w in writes})
    return alert_store.reconcile(engine, writes, sorted(series), hold=hold)


def _series(f: Regression) -> str:
    """The series an alert is stored under: a family-switch regression's is the family series plus its
    bad setup (``<series>@<config signature>:<world size>``), so a later switch of the family to another
    setup is an alert of its own and never rewrites or resolves this one."""
    d = f.details or {}
    if f.kind == "run_series" and d.get("scope") == "family":
        return f"{f.series}@{d.get('config_signature')}:{d.get('world_size')}"
    return f.series


def _not_recovered(engine: Engine, active: list[dict[str, Any]], detected: set[tuple[str, str, str]],
                   dedup_keys: set[str]) -> set[int]:
    """Of the ``active`` alerts, the run-series ones that detection no longer reports but that no run of
    their own setup has recovered (no run of the alert's family, config signature, device type and world
    size newer than those it was detected on): a run of another setup of the family — a new switch, an
    unrelated experiment — must not resolve them. (An alert detected again under another series key —
    stored before family alerts carried their setup — is held too: its dedup key is detected.)"""
    hold: set[int] = set()
    for a in active:
        d = a.get("details") or {}
        if a["kind"] != "run_series" or (a["kind"], d.get("series"), a["metric"]) in detected:
            continue
        if a.get("dedup_key") in dedup_keys:
            hold.add(int(a["id"]))
            continue
        if a.get("run_id") is None or d.get("world_size") is None or "config_signature" not in d:
            continue  # an alert from before these details were stored: resolves as it always did
        try:
            ws = int(d["world_size"])
        except (TypeError, ValueError):
            continue
        if not alert_store.newer_run_of_setup(
                engine, run_id=int(a["run_id"]), family=d.get("family"), config_signature=d.get("config_signature"),
                device_type=d.get("device_type"), world_size=ws,
                exclude=[int(x) for x in d.get("runs") or [] if isinstance(x, int)], min_steps=MIN_RUN_STEPS):
            hold.add(int(a["id"]))
    return hold


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
        with self._lock:
            runs, bench = set(self._runs), set(self._bench)
            self._runs.clear()
            self._bench.clear()
        events: list[tuple[str, dict[str, Any]]] = []
        if runs or everything:
            found, evaluated = reports.run_series_regressions(self.engine, run_ids=None if everything else sorted(runs))
            events += sync(self.engine, found, evaluated, public_url=self.public_url)
            self._step_pending |= runs
        if self._step_pending:
            now = time.monotonic()
            info = run_store.running_steps(self.engine, sorted(self._step_pending))
            for rid in sorted(self._step_pending):
                status, steps = info.get(rid, ("gone", 0))
                last_t, last_steps = self._last_step_check.get(rid, (-1e9, -1))
                # within-run detection reads the run's steps: for a running run at most once per interval,
                # and only when it has grown by 10 steps or 5 %; a finished run once more
                if status in ("running", "stalled", "hung") and (now - last_t < self.step_check_interval_s
                                            or steps - last_steps < max(10, 0.05 * last_steps)):
                    continue
                self._step_pending.discard(rid)
                if status == "gone":
                    continue
                self._last_step_check[rid] = (now, steps)
                reg = reports.step_shift_regression(self.engine, rid)
                events += sync(self.engine, [reg] if reg else [], {series_key("steps", rid)}, public_url=self.public_url)
                st = reports.straggler_finding(self.engine, rid)
                events += sync(self.engine, [st] if st else [], {series_key("stragglers", rid)},
                               public_url=self.public_url)
                sn, sn_series = reports.slow_node_findings(self.engine, rid)
                events += sync(self.engine, sn, sn_series, public_url=self.public_url)
                dv, dv_series = reports.device_findings(self.engine, rid)  # XID / ECC / heat (device telemetry)
                events += sync(self.engine, dv, dv_series, public_url=self.public_url)
        if bench or everything:
            found, evaluated = reports.benchmark_regressions(self.engine, series_ids=None if everything else sorted(bench))
            events += sync(self.engine, found, evaluated, public_url=self.public_url)
        self.passes += 1
        if self.notifier is not None:
            for event, alert in events:
                self.notifier.notify(alert, event)
        return events
