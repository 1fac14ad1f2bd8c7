"""The ``alert_deliveries`` table: what each sink (``slack``, ``webhook``, ``alertmanager``) was last told
about each alert, and which server instance is delivering it now (migration 0019).

What is due is computed here from ``alerts`` and this table — by any instance, after any restart:

- a **transition** a sink was not told: the alert's transition number (:data:`SEQ_SQL`: 3 × its reopen
  count + 0 fired / 1 acknowledged / 2 resolved) above the row's ``seq``, for alerts changed within the
  horizon;
- a **re-send** (Alertmanager only): an alert still firing or acknowledged last posted more than
  ``resend_s`` ago (or never).

A row is delivered by the instance holding its claim (``claimed_by`` until ``claimed_until``): :func:`claim`
takes free or expired claims only, so two instances never deliver one transition twice; what was sent
is recorded under that claim (:func:`record_sent`), failures push ``next_at`` back (:func:`record_failed`).
A reference table on Citus, like ``alerts``; every statement here touches only reference tables.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

from .alerts import _COLS, _row

__all__ = ["SINKS", "SEQ_SQL", "Due", "due", "claim", "load", "record_sent", "record_failed", "defer", "release",
           "forget", "forget_missing", "told"]

SINKS = ("slack", "webhook", "alertmanager")

#: the alert's latest transition as a number: 3 × reopens + 0 firing / 1 acknowledged / 2 resolved
SEQ_SQL = ("(3 * coalesce(CAST(a.details->>'reopens' AS integer), 0) + "
           "CASE a.state WHEN 'firing' THEN 0 WHEN 'acknowledged' THEN 1 ELSE 2 END)")


@dataclass
class Due:
    """One alert as a sink's delivery sees it: the alert (as the API shows it, plus ``run_name`` and
    ``run_family``), what the sink was told (``told_seq``: -1 never), the transition times (unix s)."""

    alert: dict[str, Any]
    told_seq: int
    told_state: str | None
    told_age_s: float | None  # seconds since it was last told (None: never)
    attempts: int
    t_fire: float  # raised, or reopened
    t_ack: float | None
    t_res: float | None
    now: float


def due(engine: Engine, sink: str, *, horizon_s: float, resend_s: float | None, limit: int = 500) -> list[int]:
    """Alert ids with something due for ``sink`` that no instance holds: a transition not told (alerts
    changed within ``horizon_s``) or, with ``resend_s``, an active alert not posted for that long."""
    resend = "" if resend_s is None else (
        " OR (a.state <> 'resolved' AND (d.told_at IS NULL OR d.told_at < now() - make_interval(secs => :resend)))")
    sql = (f"SELECT a.id FROM alerts a LEFT JOIN alert_deliveries d ON d.alert_id = a.id AND d.sink = :sink "
           f"WHERE (d.next_at IS NULL OR d.next_at <= now()) AND (d.claimed_until IS NULL OR d.claimed_until < now()) "
           f"AND ((a.updated_at > now() - make_interval(secs => :horizon) AND {SEQ_SQL} > coalesce(d.seq, -1)){resend}) "
           f"ORDER BY a.id LIMIT :n")
    with engine.connect() as c:
        return [int(r[0]) for r in c.execute(text(sql), {"sink": sink, "horizon": float(horizon_s),
                                                         "resend": float(resend_s or 0.0), "n": limit})]


def claim(engine: Engine, sink: str, alert_ids: Iterable[int], me: str, lease_s: float) -> list[int]:
    """Take the delivery of these alerts for ``sink`` for ``lease_s`` (rows free, expired or already
    ours, and not put off by a failure: ``next_at``); returns the ids taken. An id with no row gets one (its alert may not exist: see :func:`load`)."""
    ids = sorted({int(i) for i in alert_ids})
    if not ids:
        return []
    # the times as parameters, read from the database first: Citus refuses a function that is not
    # IMMUTABLE (now()) in the DO UPDATE clause of an INSERT on its tables
    values = ", ".join(f"(:a{i}, :sink, :me, :until, :now)" for i in range(len(ids)))
    params: dict[str, Any] = {f"a{i}": a for i, a in enumerate(ids)}
    params.update(sink=sink, me=me)
    sql = (f"INSERT INTO alert_deliveries (alert_id, sink, claimed_by, claimed_until, updated_at) VALUES {values} "
           "ON CONFLICT (alert_id, sink) DO UPDATE SET claimed_by = excluded.claimed_by, "
           "claimed_until = excluded.claimed_until, updated_at = excluded.updated_at "
           "WHERE (alert_deliveries.claimed_until IS NULL OR alert_deliveries.claimed_until < excluded.updated_at "
           "OR alert_deliveries.claimed_by = excluded.claimed_by) "
           "AND (alert_deliveries.next_at IS NULL OR alert_deliveries.next_at <= excluded.updated_at) RETURNING alert_id")
    with engine.begin() as c:
        now = c.execute(text("SELECT now()")).scalar_one()
        params.update(now=now, until=now + dt.timedelta(seconds=float(lease_s)))
        return sorted(int(r[0]) for r in c.execute(text(sql), params))


def load(engine: Engine, sink: str, alert_ids: Sequence[int]) -> list[Due]:
    """The alerts (claimed by the caller) with what ``sink`` was told; ids without an alert are left out."""
    if not alert_ids:
        return []
    cols = ", ".join(f"a.{c.strip()}" for c in _COLS.split(","))
    sql = (f"SELECT {cols}, r.name AS run_name_, r.model_family AS run_family_, d.seq AS told_seq_, "
           "d.state AS told_state_, extract(epoch FROM now() - d.told_at) AS told_age_, d.attempts AS attempts_, "
           "extract(epoch FROM coalesce(CAST(a.details->>'reopened_at' AS timestamptz), a.created_at)) AS t_fire_, "
           "extract(epoch FROM a.acknowledged_at) AS t_ack_, extract(epoch FROM a.resolved_at) AS t_res_, "
           "extract(epoch FROM now()) AS now_ "
           "FROM alerts a LEFT JOIN alert_deliveries d ON d.alert_id = a.id AND d.sink = :sink "
           "LEFT JOIN runs r ON r.id = a.run_id WHERE a.id = ANY(:ids) ORDER BY a.id")
    out = []
    with engine.connect() as c:
        for r in c.execute(text(sql), {"sink": sink, "ids": list(alert_ids)}):
            m = r._mapping
            extra = {k: m[k] for k in ("run_name_", "run_family_", "told_seq_", "told_state_", "told_age_", "attempts_",
                                       "t_fire_", "t_ack_", "t_res_", "now_")}
            alert = _row(_Strip(r, extra))
            alert["run_name"], alert["run_family"] = extra["run_name_"], extra["run_family_"]
            out.append(Due(alert=alert, told_seq=-1 if extra["told_seq_"] is None else int(extra["told_seq_"]),
                           told_state=extra["told_state_"],
                           told_age_s=None if extra["told_age_"] is None else float(extra["told_age_"]),
                           attempts=int(extra["attempts_"] or 0), t_fire=float(extra["t_fire_"]),
                           t_ack=None if extra["t_ack_"] is None else float(extra["t_ack_"]),
                           t_res=None if extra["t_res_"] is None else float(extra["t_res_"]), now=float(extra["now_"])))
    return out


class _Strip:
    """A row without the delivery columns, for ``alerts._row``."""

    def __init__(self, r: Any, drop: dict[str, Any]) -> None:
        self._mapping = {k: v for k, v in r._mapping.items() if k not in drop}


def record_sent(engine: Engine, sink: str, told: Sequence[tuple[int, int, str]], me: str, *,
                release: bool = True) -> set[int]:
    """Record (alert id, transition number, state) as told to ``sink`` now, under our claim (released
    unless ``release`` is off); returns the ids recorded (a claim another instance took since is not)."""
    if not told:
        return set()
    rel = ", claimed_by = NULL, claimed_until = NULL" if release else ""
    done: set[int] = set()
    with engine.begin() as c:
        for alert_id, seq, state in told:
            r = c.execute(text(f"UPDATE alert_deliveries SET seq = greatest(coalesce(seq, -1), :seq), state = :st, "
                               f"told_at = now(), attempts = 0, next_at = NULL, updated_at = now(){rel} "
                               f"WHERE alert_id = :a AND sink = :sink AND claimed_by = :me RETURNING alert_id"),
                          {"seq": seq, "st": state, "a": alert_id, "sink": sink, "me": me}).fetchone()
            if r is not None:
                done.add(alert_id)
    return done


def record_failed(engine: Engine, sink: str, alert_ids: Sequence[int], me: str, *, base_s: float, cap_s: float) -> None:
    """Count a failed delivery: the next try after ``base_s`` × 2^(failures so far), at most ``cap_s``;
    the claim is released."""
    if not alert_ids:
        return
    with engine.begin() as c:
        c.execute(text("UPDATE alert_deliveries SET attempts = attempts + 1, "
                       "next_at = now() + make_interval(secs => least(CAST(:cap AS float8), "
                       "CAST(:base AS float8) * power(2, least(attempts, 20)))), "
                       "claimed_by = NULL, claimed_until = NULL, updated_at = now() "
                       "WHERE alert_id = ANY(:ids) AND sink = :sink AND claimed_by = :me"),
                  {"cap": float(cap_s), "base": float(base_s), "ids": list(alert_ids), "sink": sink, "me": me})


def defer(engine: Engine, sink: str, alert_ids: Sequence[int], me: str, in_s: float) -> None:
    """Put these deliveries off for ``in_s`` (the sink is down: not tried, not counted); claims released."""
    if not alert_ids:
        return
    with engine.begin() as c:
        c.execute(text("UPDATE alert_deliveries SET next_at = now() + make_interval(secs => :s), claimed_by = NULL, "
                       "claimed_until = NULL, updated_at = now() WHERE alert_id = ANY(:ids) AND sink = :sink "
                       "AND claimed_by = :me"), {"s": float(in_s), "ids": list(alert_ids), "sink": sink, "me": me})


def release(engine: Engine, sink: str, alert_ids: Sequence[int], me: str) -> None:
    """Give up our claims on these rows (nothing was due, or we stop)."""
    if not alert_ids:
        return
    with engine.begin() as c:
        c.execute(text("UPDATE alert_deliveries SET claimed_by = NULL, claimed_until = NULL WHERE alert_id = ANY(:ids) "
                       "AND sink = :sink AND claimed_by = :me"), {"ids": list(alert_ids), "sink": sink, "me": me})


def forget(engine: Engine, sink: str, alert_ids: Sequence[int]) -> None:
    """Delete the rows of these ids for ``sink`` (claimed for an alert that is not in the table)."""
    if not alert_ids:
        return
    with engine.begin() as c:
        c.execute(text("DELETE FROM alert_deliveries d WHERE d.sink = :sink AND d.alert_id = ANY(:ids) "
                       "AND NOT EXISTS (SELECT 1 FROM alerts a WHERE a.id = d.alert_id)"),
                  {"sink": sink, "ids": list(alert_ids)})


def forget_missing(engine: Engine) -> int:
    """Delete the rows of alerts that no longer exist (their run was deleted); returns how many."""
    with engine.begin() as c:
        r = c.execute(text("DELETE FROM alert_deliveries d WHERE NOT EXISTS (SELECT 1 FROM alerts a WHERE a.id = d.alert_id) "
                           "AND (d.claimed_until IS NULL OR d.claimed_until < now())"))
        return int(r.rowcount or 0)


def told(engine: Engine, alert_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The delivery rows (of these alerts, else all): alert id, sink, seq, state, told_at (ISO), attempts."""
    where = "WHERE alert_id = ANY(:ids)" if alert_ids is not None else ""
    with engine.connect() as c:
        rows = c.execute(text(f"SELECT alert_id, sink, seq, state, told_at, attempts FROM alert_deliveries {where} "
                              "ORDER BY alert_id, sink"), {"ids": list(alert_ids or [])}).fetchall()
    return [{"alert_id": r[0], "sink": r[1], "seq": r[2], "state": r[3],
             "told_at": r[4].isoformat() if r[4] is not None else None, "attempts": r[5]} for r in rows]
