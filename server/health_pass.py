"""The health pass: every few seconds, the state of every run that has not ended (docs/metrics.md "Run
states"), stored in ``run_health`` and ``runs.status``, with ``hang``, ``node_lost`` and ``failure``
alerts (one per incident, resolved by themselves when steps resume) handed to the notifier.

:func:`assess` is the one evaluation, shared by the pass and ``GET /runs/{id}/health``: it reads what
it needs (cheaply while a run makes progress; the wavefront — computed in SQL, ``store.health.wave_summary``
— only once it has stalled) and calls the pure state machine ``analysis.health.evaluate``.

One run never delays another's state (docs/metrics.md, "Run states: the pass at any size"):

- **Triage** (:meth:`HealthWorker.triage`, every ``interval_s``): one query for every run, then per run
  only cheap reads — failures, status, pauses, the stall threshold. Failed, finished, paused, running
  and resumed runs are concluded here, so a failure is marked within one interval whatever else runs.
  A stalled run needs its wavefront: a run of at most ``inline_ranks`` ranks is analysed here (tens of
  ms), a bigger one is handed to the analysis thread.
- **Analysis** (:meth:`HealthWorker.analyse_pending`, its own thread): the big stalled runs, smallest
  first, each under a time budget (``budget_s``: ``SET LOCAL statement_timeout`` on its transaction);
  a run whose analysis took ``t`` is analysed again only after ``max(interval_s, spacing × t)`` — in
  between its last conclusion is carried over. An analysis over budget concludes ``stalled`` (no
  wavefront) and says so. Before it is stored the run is re-read: if it resumed, failed or ended
  meanwhile, triage's conclusion stands.
- Ended runs are assessed again when failure records landed since their last conclusion (the stored
  ``detail.failures_seen`` differs from what ``store.health.progress`` counts: a record with an earlier
  time changes the root cause, and the alert's finding is updated in place — not a new page), and while
  a failure's cause is settling (``detail.settle_until``: a node not heard from may be lost; its alert
  waits until then).
- A run whose reads fail is skipped, the others go on; a database outage logs one line per cause per
  minute (``logutil.log_throttled``), not a traceback per run per pass.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc

from .analysis.health import (
    HealthParams,
    SilentNodes,
    Verdict,
    WaveSummary,
    evaluate,
    is_peer_error,
    root_cause,
    settle_s,
    stall_threshold,
)
from .limits import MAX_FAILURES_PER_RUN, MAX_HEALTH_RANKS_LISTED, MAX_HEALTH_STACKS
from .logutil import Throttle, log_throttled
from .store import alerts as alert_store
from .store import health as store

__all__ = ["HealthWorker", "assess", "params_from", "Assessment", "HEALTH_ALERT_KINDS", "INLINE_RANKS",
           "BUDGET_S", "SPACING"]

log = logging.getLogger(__name__)

HEALTH_ALERT_KINDS = ("hang", "node_lost", "failure")
_STATUS = {"running": "running", "stalled": "stalled", "hung": "hung", "failed": "failed"}

#: a stalled run of at most this many ranks has its wavefront computed by triage itself (16,384 ranks:
#: ~30 ms here); bigger ones go to the analysis thread
INLINE_RANKS = 16_384
#: time budget of one run's wavefront analysis in the pass (seconds; 262,144 ranks take ~0.5 s here)
BUDGET_S = 10.0
#: a run whose analysis took t seconds is analysed again after max(interval, SPACING × t)
SPACING = 10.0


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
    pending: bool = False  # stalled, and its wavefront not computed (``wavefront=False``)
    wave: WaveSummary | None = None  # the wavefront computed, if any
    unanalysed: str | None = None  # stalled, and why its wavefront could not be computed (over budget …)


def assess(engine: Engine, rp: store.RunProgress, params: HealthParams, *, full: bool = False,
           wavefront: bool = True, wave: WaveSummary | None = None, unanalysed: str | None = None,
           budget_s: float | None = None) -> Assessment:
    """The run's state now. ``full``: load failures and pauses even when the run is progressing (the API).
    A stalled run's wavefront: ``wave`` if given (computed before), else computed in SQL under
    ``budget_s`` when ``wavefront``, else not computed (``Assessment.pending``). ``unanalysed``: why it
    could not be computed (over its budget …): the run is concluded ``stalled`` and the finding says so."""
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
    silent: SilentNodes | None = None
    n_rows = n_failed_ranks = 0
    pending = stalled = False
    if cheap:
        v = Verdict("running")
    else:
        nodes: dict[int, str] = {}
        if rp.failures:
            fails = store.failures(engine, rp.run_id, limit=64)
            n_rows, n_failed_ranks = store.failure_count(engine, rp.run_id)
            if fails:  # the failure finding names the root cause's node: only the failed ranks' nodes are read
                nodes = store.node_map(engine, rp.run_id, sorted({f.rank for f in fails}))
                silent = _silent_nodes(engine, rp, params, fails, n_rows, budget_s)
        p99 = store.step_p99(engine, rp.run_id) if rp.steps else None
        pause = store.open_pause(engine, rp.run_id, rp.now, params.pause_max_s) if not ended else None
        pause_end = store.last_pause_end(engine, rp.run_id) if not ended else None
        ref_age = rp.now - max(progress_at, pause_end or 0.0)
        stalled = (not ended and root_cause(fails) is None and pause is None
                   and ref_age >= stall_threshold(params, rp.steps, p99))
        if stalled and wave is None and unanalysed is None:
            if wavefront:
                try:
                    wave = store.wave_summary(engine, rp.run_id, rp.world_size, params.silence_s,
                                              max_listed=params.max_listed, max_stacks=params.max_stacks,
                                              budget_s=budget_s)
                except Exception as e:
                    if not store.is_over_budget(e):
                        raise
                    unanalysed = f"over the {budget_s:g} s budget" if budget_s else "over the read budget"
            else:
                pending = True
        v = evaluate(name=rp.name, status=rp.status, world_size=rp.world_size, steps=rp.steps,
                     current_step=rp.current_step, now=rp.now, progress_at=progress_at, p99_step_s=p99,
                     failures=fails, n_failed_ranks=n_failed_ranks, finished_at=rp.finished_at, pauses=[],
                     positions=None, nodes=nodes, params=params, last_pause_end=pause_end,
                     wave=wave if stalled else None, pause=pause, silent=silent)
        if stalled and unanalysed and v.state == "stalled" and v.finding:
            v.finding += f"; the positions of its {rp.world_size:,} ranks were not analysed ({unanalysed})"
    hang_s = rp.hang_s
    if v.state in ("stalled", "hung") and v.since is not None:
        hang_s += max(rp.now - v.since, 0.0)
    return Assessment(rp, v, seen, progress_at, hang_s, fails, rp.failures, pending=pending, wave=wave,
                      unanalysed=unanalysed if stalled else None)


def _silent_nodes(engine: Engine, rp: store.RunProgress, params: HealthParams, fails: list[store.Failure],
                  n_rows: int, budget_s: float | None) -> SilentNodes | None:
    """The nodes that said nothing, when the failure's first record blames a peer (the node-lost rule,
    ``analysis.health._node_lost``); None when the rule does not apply: a real failure first, or failure
    records beyond the run's cap (MAX_FAILURES_PER_RUN: a node without one proves nothing then), or the
    read over its budget. While the failure settles, a run of more than ``INLINE_RANKS`` ranks is not
    read (``checked`` False): its nodes are read once, when the settle time is over."""
    first = root_cause(fails)
    if first is None or not is_peer_error(first) or n_rows >= MAX_FAILURES_PER_RUN:
        return None
    settling = rp.now - (first.ts if first.ts is not None else rp.now) < settle_s(params)
    if settling and rp.world_size > INLINE_RANKS:
        return SilentNodes(checked=False)
    try:
        return store.silent_nodes(engine, rp.run_id, rp.world_size, params.silence_s, max_listed=params.max_listed,
                                  budget_s=budget_s)
    except Exception as e:
        if not store.is_over_budget(e):
            raise
        log_throttled(log, logging.WARNING, "health:silent-over-budget", "health pass: the silent nodes of run %s "
                      "were not read within %s s", rp.run_id, budget_s, throttle=_THROTTLE)
        return None


_THROTTLE = Throttle(60.0)


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
    first = root_cause(a.failures) if kind == "failure" else None
    if v.cause == "node_lost":
        details["root_cause"] = {"cause": "node_lost", "nodes": v.missing_nodes[:16], "ranks": v.missing_ranks[:64],
                                 "rank_count": v.missing_count, "step": v.step}
    elif first is not None:
        details["root_cause"] = {"cause": "failure", "rank": first.rank, "exception": first.exception,
                                 "signal": first.signal, "exit_code": first.exit_code, "step": first.step}
    # a run fails once: its failure alert is one incident whatever record turns out to be the first, so
    # the key does not hold the time (a failure that lands late with an earlier time updates the alert
    # in place, and one resolved by hand is not raised again)
    dedup = (f"failure:health:{a.run.run_id}" if kind == "failure"
             else f"{kind}:health:{a.run.run_id}:{int(v.since or 0)}")
    return alert_store.AlertWrite(
        key=(kind, f"health:{a.run.run_id}", "run_state"),
        dedup_key=dedup,
        run_id=a.run.run_id, before=thr, after=age, change=(age / thr - 1.0) if thr > 0 else 0.0, significance=None,
        first_bad_json=json.dumps({"step": v.step, "since": v.since}), details_json=json.dumps(details, default=str),
        url=(public_url or "").rstrip("/") + f"/runs/{a.run.run_id}",
    )


def _db_unavailable(e: BaseException) -> bool:
    """The database cannot be reached (down, restarting, pool exhausted): not this run's fault."""
    if isinstance(e, (sa_exc.InterfaceError, sa_exc.TimeoutError)):
        return True
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, sa_exc.OperationalError):
        import psycopg

        return not isinstance(e.orig, psycopg.errors.QueryCanceled)
    try:
        import psycopg

        return isinstance(e, psycopg.OperationalError)
    except ImportError:  # pragma: no cover
        return False


class HealthWorker:
    """The periodic health pass: triage on one background thread, the analysis of big stalled runs on
    another (see the module doc); never raises into its caller. :meth:`run_once` is one whole pass
    (triage, then the analyses due) in the calling thread."""

    def __init__(self, engine: Engine, params: HealthParams, *, notifier: Any = None, public_url: str | None = None,
                 interval_s: float = 5.0, budget_s: float = BUDGET_S, inline_ranks: int = INLINE_RANKS,
                 spacing: float = SPACING, log_interval_s: float = 60.0) -> None:
        self.engine = engine
        self.params = params
        self.notifier = notifier
        self.public_url = public_url
        self.interval_s = interval_s
        self.budget_s = budget_s
        self.inline_ranks = inline_ranks
        self.spacing = spacing
        self._throttle = Throttle(log_interval_s)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._deep_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one triage at a time
        self._deep_lock = threading.Lock()  # one analysis pass at a time
        self._save_lock = threading.Lock()  # a run's conclusion is stored by one thread at a time
        self._pending: dict[int, store.RunProgress] = {}  # stalled runs waiting for their analysis
        self._due: dict[int, float] = {}  # run -> monotonic time its next analysis is due
        self.passes = 0
        self.errors = 0
        self.last_pass_s = 0.0
        self.last_runs = 0
        self.analyses = 0
        self.over_budget = 0
        self.last_analysis_s: dict[int, float] = {}  # run -> seconds its last analysis took (bounded: pending runs)
        #: (phase, run id) of what the last passes concluded, in order (bounded): "triage" or "analysis"
        self.trace: list[tuple[str, int]] = []

    # -------------------------------------------------------------------------------------- threads

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetscope-health", daemon=True)
        self._deep_thread = threading.Thread(target=self._deep_loop, name="fleetscope-health-analysis", daemon=True)
        self._thread.start()
        self._deep_thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in (self._thread, self._deep_thread):
            if t is not None:
                t.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(max(self.interval_s, 0.05)):
            try:
                self._notify(self.triage())
            except Exception as e:  # noqa: BLE001 - the pass must never take the server down
                self._failed(e, "triage")
            self._wake.set()

    def _deep_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(max(self.interval_s, 0.05))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._notify(self.analyse_pending())
            except Exception as e:  # noqa: BLE001 - the pass must never take the server down
                self._failed(e, "analysis")

    def _notify(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        if self.notifier is not None:
            for event, alert in events:
                try:
                    self.notifier.notify(alert, event)
                except Exception:  # noqa: BLE001 - the pass must never take the server down
                    log_throttled(log, logging.WARNING, "health:notify", "health pass: an alert notification failed",
                                  exc_info=True, throttle=self._throttle)

    # -------------------------------------------------------------------------------------- passes

    def run_once(self) -> list[tuple[str, dict[str, Any]]]:
        """One whole pass in the calling thread: triage of every run, then the analyses due; returns the
        alert events it sent."""
        events = self.triage()
        events += self.analyse_pending()
        self._notify(events)
        return events

    def _failed(self, e: BaseException, what: str, run_id: int | None = None) -> None:
        """Log a failure once per cause per interval: an outage as one line without a traceback."""
        self.errors += 1
        if _db_unavailable(e):
            log_throttled(log, logging.WARNING, "health:db-unavailable",
                          "health pass: database unavailable (%s: %s); retrying every pass", type(e).__name__,
                          str(e).splitlines()[0][:200] if str(e) else "", throttle=self._throttle)
        else:
            log_throttled(log, logging.ERROR, f"health:{what}:{type(e).__name__}", "health pass: %s failed%s",
                          what, f" for run {run_id}" if run_id is not None else "", exc_info=True,
                          throttle=self._throttle)

    def _record(self, phase: str, run_id: int) -> None:
        self.trace.append((phase, run_id))
        if len(self.trace) > 4096:
            del self.trace[:2048]

    def triage(self) -> list[tuple[str, dict[str, Any]]]:
        """Every run that has not ended, cheaply (see the module doc); returns the alert events."""
        events: list[tuple[str, dict[str, Any]]] = []
        with self._lock:
            t0 = time.perf_counter()
            try:
                runs = store.progress(self.engine)
            except Exception as e:  # noqa: BLE001 - the pass must never take the server down
                self._failed(e, "triage")
                return events
            pending: dict[int, store.RunProgress] = {}
            for rp in runs:
                try:
                    a = assess(self.engine, rp, self.params, wavefront=rp.world_size <= self.inline_ranks,
                               budget_s=self.budget_s)
                    if a.pending:
                        pending[rp.run_id] = rp
                        continue
                    with self._save_lock:
                        events += self._conclude(rp, a)
                    self._record("triage", rp.run_id)
                except Exception as e:  # noqa: BLE001 - one run's bad data must not stop the others
                    self._failed(e, "run", rp.run_id)
            with self._save_lock:
                self._pending = pending
                for rid in [r for r in self._due if r not in pending]:
                    del self._due[rid]
                for rid in [r for r in self.last_analysis_s if r not in pending]:
                    del self.last_analysis_s[rid]
            self.passes += 1
            self.last_runs = len(runs)
            self.last_pass_s = time.perf_counter() - t0
        return events

    def analyse_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """The wavefront of each stalled run triage handed over whose analysis is due, smallest first,
        each under the budget; returns the alert events."""
        events: list[tuple[str, dict[str, Any]]] = []
        with self._deep_lock:
            with self._save_lock:
                todo = sorted(self._pending.values(), key=lambda r: (r.world_size, r.run_id))
            for rp in todo:
                if self._stop.is_set():
                    break
                if time.monotonic() < self._due.get(rp.run_id, 0.0):
                    continue  # analysed recently: its last conclusion is carried over
                try:
                    events += self._analyse(rp)
                except Exception as e:  # noqa: BLE001 - one run's bad data must not stop the others
                    self._failed(e, "analysis", rp.run_id)
                    self._due[rp.run_id] = time.monotonic() + max(self.interval_s, self.spacing * self.budget_s)
                    if not _db_unavailable(e):  # still mark it stalled, without the wavefront
                        try:
                            events += self._store(rp, None, f"an error: {type(e).__name__}, see the server log")
                        except Exception as e2:  # noqa: BLE001
                            self._failed(e2, "analysis", rp.run_id)
        return events

    def _analyse(self, rp: store.RunProgress) -> list[tuple[str, dict[str, Any]]]:
        t = time.perf_counter()
        a = assess(self.engine, rp, self.params, wavefront=True, budget_s=self.budget_s)
        took = time.perf_counter() - t
        self.analyses += 1
        self.over_budget += int(a.unanalysed is not None)
        with self._save_lock:
            self.last_analysis_s[rp.run_id] = took
            self._due[rp.run_id] = time.monotonic() + max(self.interval_s, self.spacing * took)
        if a.wave is None and a.unanalysed is None:
            return []  # not stalled any more: triage concludes
        return self._store(rp, a.wave, a.unanalysed)

    def _store(self, rp: store.RunProgress, wave: WaveSummary | None, unanalysed: str | None) -> list[tuple[str, dict[str, Any]]]:
        """Conclude on a stalled run with the wavefront computed (or why not), on what the run is now."""
        with self._save_lock:
            if rp.run_id not in self._pending:
                return []  # triage has concluded on it since (resumed, failed, ended)
            # the run may have moved on while it was analysed: conclude on what it is now
            fresh = store.progress(self.engine, [rp.run_id])
            if not fresh or not assess(self.engine, fresh[0], self.params, wavefront=False).pending:
                return []  # no longer stalled: the next triage concludes
            b = assess(self.engine, fresh[0], self.params, wave=wave, unanalysed=None if wave else unanalysed,
                       budget_s=self.budget_s)
            out = self._conclude(fresh[0], b)
        self._record("analysis", rp.run_id)
        return out

    def _conclude(self, rp: store.RunProgress, a: Assessment) -> list[tuple[str, dict[str, Any]]]:
        """Store the assessment and reconcile the run's health alerts (under ``_save_lock``)."""
        v = a.verdict
        prev = rp.state
        if prev in ("finished", "failed") and v.state in ("running", "stalled", "hung") and a.seen_step == rp.seen_step:
            # ended, then reopened by a write that brought no step (a trace attached, a registration, a late
            # record): it stays as the pass concluded — no running state, so no hang alert later either
            return []
        changed = (prev != v.state or a.seen_step != rp.seen_step or v.state in ("stalled", "hung", "failed")
                   or rp.progress_at is None or (rp.detail.get("failures_seen") or 0) != rp.failures)
        if changed:
            since = v.since if v.state != "running" else None
            # failures_seen: the failure records this conclusion stands on (progress() re-assesses the run,
            # ended or not, once more landed); settle_until (in the detail): assessed again until then
            store.save_health(self.engine, rp.run_id, state=v.state, since=since, finding=v.finding,
                              detail={**v.detail(), "failures_seen": rp.failures}, seen_step=a.seen_step,
                              progress_at=a.progress_at, hang_s=_closed_hang_s(rp, v), status=_STATUS.get(v.state))
        # alerts: one per incident; a hang only when the pass saw the run progress before (a run that
        # was already stopped when this server first looked at it is marked, not paged); a failure whose
        # cause is still settling (a node not heard from yet) is paged once it is known
        alertable = v.kind is not None and (v.kind == "failure" or prev is not None)
        out: list[tuple[str, dict[str, Any]]] = []
        if v.settle_until is not None:
            return out  # the run's alerts stay as they are until its cause is known (a few seconds)
        if alertable or prev in ("stalled", "hung", "failed") or prev != v.state:
            writes = [_alert(a, self.public_url)] if alertable else []
            out = alert_store.reconcile(self.engine, writes, [f"health:{rp.run_id}"])
        if v.state in ("running", "finished") and a.seen_step is not None and (prev != v.state or rp.seen_step is None):
            # this attempt runs (or finished): the failure alerts of the job's earlier attempts resolve
            out += alert_store.resolve_earlier_failures(self.engine, rp.run_id)
        return out
