"""The ``alerts`` table: reads for the API and the pages, hand transitions, and the reconciliation of
detections with stored alerts (one transaction; the lifecycle rules are ``server/alerts.py``)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["AlertWrite", "list_alerts", "get_alert", "set_state", "reconcile", "firing_counts", "alerts_with_runs",
           "active_in_series", "newer_run_of_setup", "resolve_earlier_failures"]

_COLS = ("id, dedup_key, kind, metric, state, run_id, before, after, change, significance, first_bad, details, url, "
         "created_at, updated_at, acknowledged_at, resolved_at")


def _lift(d: dict[str, Any]) -> dict[str, Any]:
    """``cause`` and ``diff`` are stored in ``details`` and shown as top-level keys (null when absent)."""
    details = dict(d.get("details") or {})
    d["cause"] = details.pop("cause", None)
    d["diff"] = details.pop("diff", None)
    d["details"] = details
    return d


def _row(r: Any) -> dict[str, Any]:
    d = dict(r._mapping)
    for k in ("created_at", "updated_at", "acknowledged_at", "resolved_at"):
        if d.get(k) is not None:
            d[k] = d[k].isoformat()
    return _lift(d)


@dataclass(frozen=True)
class AlertWrite:
    """A detection as stored: ``key`` = (kind, series, metric) names the active alert it updates;
    ``first_bad_json``/``details_json`` are JSON texts (``details`` carries ``series``, and ``cause`` and
    ``diff``, which the reads show as top-level keys)."""

    key: tuple[str, str, str]
    dedup_key: str
    run_id: int | None
    before: float
    after: float
    change: float
    significance: float | None
    first_bad_json: str
    details_json: str
    url: str


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


def set_state(engine: Engine, alert_id: int, state: str, *, only_from: str) -> tuple[dict[str, Any] | None, bool]:
    """Move an alert to ``state`` (stamping ``<state>_at``; a resolution records ``details.resolution``
    ``{"by": "hand"}``) when its state matches ``only_from`` (``firing`` or ``unresolved``); returns the
    alert as it is then (None when it does not exist) and whether it changed state."""
    stamp = "acknowledged_at" if state == "acknowledged" else "resolved_at"
    guard = " AND state = 'firing'" if only_from == "firing" else " AND state <> 'resolved'"
    how = (", details = details || jsonb_build_object('resolution', jsonb_build_object('by', 'hand'))"
           if state == "resolved" else "")
    with engine.begin() as c:
        changed = c.execute(
            text(f"UPDATE alerts SET state = :s, {stamp} = now(), updated_at = now(){how} WHERE id = :id{guard} "
                 "RETURNING id"),
            {"s": state, "id": alert_id},
        ).fetchone() is not None
        r = c.execute(text(f"SELECT {_COLS} FROM alerts WHERE id = :id"), {"id": alert_id}).fetchone()
    return (_row(r) if r is not None else None), changed


#: what a resolution by recovery records in ``details.resolution``
_RECOVERED = "jsonb_build_object('resolution', jsonb_build_object('by', 'recovery'))"


def reconcile(engine: Engine, writes: Iterable[AlertWrite], series: Sequence[str], *,
              hold: Collection[int] = ()) -> list[tuple[str, dict[str, Any]]]:
    """In one transaction: update the active alert of each write's key, else insert it (a dedup key
    already stored and resolved by hand is not raised again; a regression resolved by recovery is
    reopened — the recovery did not last; run-health incidents are never reopened); resolve the active
    alerts of ``series`` that no write names, except those in ``hold`` (``details.resolution`` says
    ``{"by": "recovery"}``). Returns ("fired" | "reopened" | "resolved", alert) for what changed state."""
    events: list[tuple[str, dict[str, Any]]] = []
    by_key = {w.key: w for w in writes}
    with engine.begin() as c:
        active = c.execute(
            text(f"SELECT {_COLS} FROM alerts WHERE state IN ('firing', 'acknowledged') AND details->>'series' = ANY(:s)"),
            {"s": list(series)},
        ).fetchall()
        active_by = {(r.kind, r.details.get("series"), r.metric): r for r in active}
        for key, w in by_key.items():
            params = {"before": w.before, "after": w.after, "change": w.change, "sig": w.significance,
                      "first_bad": w.first_bad_json, "details": w.details_json, "url": w.url, "run_id": w.run_id}
            if key in active_by:
                # the reopen count and time carried over, merged here: Citus refuses a STABLE function
                # (jsonb_build_object) over column references in an UPDATE
                kept = {k: v for k, v in (active_by[key].details or {}).items()
                        if k in ("reopens", "reopened_at") and v is not None}
                c.execute(
                    text("UPDATE alerts SET before = :before, after = :after, change = :change, significance = :sig, "
                         "first_bad = CAST(:first_bad AS jsonb), details = CAST(:details AS jsonb) || "
                         "CAST(:kept AS jsonb), url = :url, run_id = :run_id, updated_at = now() WHERE id = :id"),
                    {**params, "id": active_by[key].id, "kept": json.dumps(kept)},
                )
                continue
            r = c.execute(
                text(f"INSERT INTO alerts (dedup_key, kind, metric, state, run_id, before, after, change, significance, "
                     f"first_bad, details, url) VALUES (:dk, :kind, :metric, 'firing', :run_id, :before, :after, :change, "
                     f":sig, CAST(:first_bad AS jsonb), CAST(:details AS jsonb), :url) ON CONFLICT (dedup_key) DO NOTHING "
                     f"RETURNING {_COLS}"),
                {**params, "dk": w.dedup_key, "kind": key[0], "metric": key[2]},
            ).fetchone()
            if r is not None:
                events.append(("fired", _row(r)))
                continue
            # the dedup key is stored: reopen it if it was resolved by recovery (not by hand); the reopen
            # count read first (Citus: no STABLE function over column references in an UPDATE)
            prev = c.execute(text("SELECT details->>'reopens' FROM alerts WHERE dedup_key = :dk"),
                             {"dk": w.dedup_key}).scalar()
            reopens = (int(prev) if prev is not None and str(prev).isdigit() else 0) + 1
            r = c.execute(
                text(f"UPDATE alerts SET state = 'firing', resolved_at = NULL, acknowledged_at = NULL, "
                     f"before = :before, after = :after, change = :change, significance = :sig, "
                     f"first_bad = CAST(:first_bad AS jsonb), details = CAST(:details AS jsonb) || jsonb_build_object("
                     f"'reopens', CAST(:reopens AS integer), 'reopened_at', now()), "
                     f"url = :url, run_id = :run_id, updated_at = now() "
                     f"WHERE dedup_key = :dk AND state = 'resolved' AND details->'resolution'->>'by' = 'recovery' "
                     f"AND kind NOT IN ('hang', 'node_lost', 'failure') "
                     f"RETURNING {_COLS}"),
                {**params, "dk": w.dedup_key, "reopens": reopens},
            ).fetchone()
            if r is not None:
                events.append(("reopened", _row(r)))
        held = set(hold)
        for key, r in active_by.items():
            if key not in by_key and r.id not in held:
                row = c.execute(
                    text(f"UPDATE alerts SET state = 'resolved', resolved_at = now(), updated_at = now(), "
                         f"details = details || {_RECOVERED} WHERE id = :id "
                         f"AND state <> 'resolved' RETURNING {_COLS}"),
                    {"id": r.id},
                ).fetchone()
                if row is not None:
                    events.append(("resolved", _row(row)))
    return events


def active_in_series(engine: Engine, series: Sequence[str], *, subseries: bool = False) -> list[dict[str, Any]]:
    """The active (firing or acknowledged) alerts of these series (with ``subseries``, also those stored
    under ``<series>@<setup>``: family-switch regressions)."""
    sub = " OR split_part(details->>'series', '@', 1) = ANY(:s)" if subseries else ""
    with engine.connect() as c:
        return [_row(r) for r in c.execute(
            text(f"SELECT {_COLS} FROM alerts WHERE state IN ('firing', 'acknowledged') "
                 f"AND (details->>'series' = ANY(:s){sub})"),
            {"s": list(series)})]


def newer_run_of_setup(engine: Engine, *, run_id: int, family: str | None, config_signature: str | None,
                       device_type: str | None, world_size: int, exclude: Sequence[int], min_steps: int) -> bool:
    """Whether a run of this setup (family, config signature, device type, world size), in the namespace
    of ``run_id``, with at least ``min_steps`` steps, started after ``run_id`` and is not in ``exclude``."""
    with engine.connect() as c:
        return c.execute(text(
            "SELECT 1 FROM runs o JOIN runs a ON a.id = :rid WHERE o.owner_key = a.owner_key "
            "AND o.model_family IS NOT DISTINCT FROM :fam AND o.config_signature IS NOT DISTINCT FROM :sig "
            "AND o.device_type IS NOT DISTINCT FROM :dev AND o.world_size = :ws AND o.steps >= :n "
            "AND NOT (o.id = ANY(:ex)) AND (o.started_at > a.started_at OR o.started_at = a.started_at AND o.id > a.id) "
            "LIMIT 1"),
            {"rid": run_id, "fam": family, "sig": config_signature, "dev": device_type, "ws": world_size,
             "n": min_steps, "ex": list(exclude)}).fetchone() is not None


def resolve_earlier_failures(engine: Engine, run_id: int) -> list[tuple[str, dict[str, Any]]]:
    """Resolve the unresolved ``failure`` alerts of the earlier attempts of ``run_id``'s job (runs of the
    same owner with the same job id — or, without one, the same name — and a lower attempt): this attempt
    runs. ``details.resolution`` names it. Returns ("resolved", alert) per alert resolved."""
    with engine.begin() as c:
        me = c.execute(text("SELECT attempt, name FROM runs WHERE id = :r"), {"r": run_id}).fetchone()
        if me is None or not me[0]:
            return []
        ids = [int(x[0]) for x in c.execute(text(
            "SELECT a.id FROM runs r JOIN runs o ON o.owner_key = r.owner_key AND o.attempt < r.attempt AND "
            "(CASE WHEN r.job_id IS NOT NULL THEN o.job_id = r.job_id ELSE o.job_id IS NULL AND o.name = r.name END) "
            "JOIN alerts a ON a.run_id = o.id WHERE r.id = :r AND a.kind = 'failure' AND a.state <> 'resolved'"),
            {"r": run_id})]
        if not ids:
            return []
        rows = c.execute(text(
            f"UPDATE alerts SET state = 'resolved', resolved_at = now(), updated_at = now(), details = details || "
            f"jsonb_build_object('resolution', jsonb_build_object('by', 'recovery', 'run_id', CAST(:r AS integer), "
            f"'attempt', CAST(:att AS integer), 'note', CAST(:note AS text))) "
            f"WHERE id = ANY(:ids) AND state <> 'resolved' RETURNING {_COLS}"),
            {"r": run_id, "att": int(me[0]), "ids": ids,
             "note": f"attempt {int(me[0])} of the job (run {run_id}) runs"}).fetchall()
    return [("resolved", _row(r)) for r in rows]


def firing_counts(engine: Engine, run_ids: Sequence[int]) -> dict[int, int]:
    """{run id: firing alerts} for the runs that have any."""
    with engine.connect() as c:
        return {int(k): int(v) for k, v in c.execute(
            text("SELECT run_id, count(*) FROM alerts WHERE state = 'firing' AND run_id = ANY(:ids) GROUP BY run_id"),
            {"ids": list(run_ids)}).fetchall()}


def alerts_with_runs(engine: Engine, *, state: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    """Alerts newest first with their run's name and family (the Regressions page)."""
    sql = (
        "SELECT a.id, a.kind, a.metric, a.state, a.run_id, r.name AS run_name, r.model_family, a.before, a.after, "
        "a.change, a.significance, a.first_bad, a.details, a.url, a.created_at, a.updated_at, a.resolved_at "
        "FROM alerts a LEFT JOIN runs r ON r.id = a.run_id"
    )
    params: dict[str, Any] = {"n": limit}
    if state:
        sql += " WHERE a.state = :state"
        params["state"] = state
    sql += " ORDER BY a.created_at DESC, a.id DESC LIMIT :n"
    with engine.connect() as c:
        return [_lift(dict(r._mapping)) for r in c.execute(text(sql), params)]
