"""The run page's health panel (it leads the page when the run is stalled, hung or failed: the finding,
the ranks that never arrived with their nodes and stacks, the failures, first first) and the job's
attempts table; the fleet page's health ordering (hung and failed runs first)."""

from __future__ import annotations

import os
from typing import Any

from dash import dcc, html

from . import _state
from .components import contained, section, simple_table, status_badge
from .theme import fmt_num, fmt_s, fmt_time

__all__ = ["health_panel", "attempts_table", "HEALTH_PANEL", "STATE_RANK", "run_health"]

HEALTH_PANEL = "run-health"
#: fleet ordering: the runs that need someone first
STATE_RANK = {"hung": 0, "stalled": 1, "failed": 2, "running": 3}


def _params() -> Any:
    from flask import request
    from fleetscope.server.reports.health import params_from

    st = getattr(request.environ.get("fleetscope.app_state"), "fs", None)
    return params_from(getattr(st, "settings", None))


def run_health(rid: int) -> dict[str, Any] | None:
    from fleetscope.server.reports.health import run_health as _run_health

    return _run_health(_state.engine(), rid, _params())


def _frame(f: dict[str, Any]) -> str:
    return f"{os.path.basename(str(f.get('file') or '?'))}:{f.get('line')} {f.get('func') or '?'}"


def _ranges(ranks: list[int]) -> str:
    from fleetscope.server.reports.health import rank_ranges

    return rank_ranges(ranks)


@contained("health panel")
def health_panel(rid: int, h: dict[str, Any] | None = None) -> html.Div | None:
    """The panel for a stalled / hung / failed run (None otherwise, or a pause note while one is open)."""
    h = h if h is not None else run_health(rid)
    if h is None:
        return None
    state = h["state"]
    if state in ("running", "finished"):
        p = h.get("pause")
        if p:
            return html.Div(f"Paused for {p['reason']} since {fmt_time(p.get('since'))} (declared by {p.get('ranks')} "
                            "ranks): the stall detector waits.", className="fs-note", id="run-health-pause")
        return None
    head = html.Div([status_badge(state), html.Span(f" since {fmt_time(h.get('since'))}", className="fs-muted")])
    parts: list[Any] = [head, html.P(h.get("finding") or f"The run is {state}.", id="run-health-finding",
                                     className="fs-health-finding")]
    facts = []
    if h.get("collective"):
        c = h["collective"]
        w = h.get("waiting") or {}
        facts.append(html.Li(f"{fmt_num(w.get('ranks'))} ranks wait in {c.get('op')} #{c.get('seq')}"
                             + (f" on dim {c['dim']}" if c.get("dim") else "")))
    if h.get("missing_ranks"):
        # the API lists the first ranks (limits.ranks_listed) and counts them all
        listed = h["missing_ranks"]
        total = max(int(h.get("missing_count") or 0), len(listed))
        what = (f"ranks {_ranges(listed)}" if total == len(listed)
                else f"{total:,} ranks; the first {len(listed):,}: {_ranges(listed)}")
        facts.append(html.Li([html.B("never arrived: "), what], id="run-health-missing"))
    if h.get("missing_nodes"):
        nodes = h["missing_nodes"]
        n_nodes = max(int(h.get("missing_nodes_count") or 0), len(nodes))
        facts.append(html.Li([html.B("nodes: "), ", ".join(nodes[:32])
                              + (f" and {n_nodes - 32:,} more" if n_nodes > 32 else "")], id="run-health-nodes"))
    if facts:
        parts.append(html.Ul(facts, className="fs-health-facts"))
    stacks = h.get("stacks") or {}
    if stacks:
        rows = [[r, html.Code(" → ".join(_frame(f) for f in frames[-4:]))] for r, frames in stacks.items()]
        first = " (the first of them)" if len(stacks) < int(h.get("missing_count") or 0) else ""
        parts.append(html.Div([html.H3(f"Stacks of the ranks that never arrived{first} (innermost last)",
                                       className="fs-h3"),
                               simple_table(["rank", "stack"], rows, tid="run-health-stacks")]))
    fails = h.get("failures") or []
    if fails:
        rows = []
        for i, f in enumerate(fails[:32]):
            what = f.get("exception") or f.get("signal") or (f"exit {f['exit_code']}" if f.get("exit_code") is not None
                                                             else f.get("source"))
            where = _frame(f["frames"][-1]) if f.get("frames") else ""
            rows.append(["root cause" if i == 0 else "", f["rank"], f.get("step"), f.get("source"), what,
                         (f.get("message") or "")[:200], where, fmt_time(f.get("ts"))])
        more = (h.get("failures_count") or 0) - len(rows)
        parts.append(html.Div([
            html.H3("Failures, first by time first" + (f" ({more:,} more)" if more > 0 else ""), className="fs-h3"),
            simple_table(["", "rank", "step", "source", "what", "message", "where", "time"], rows, numeric=(1, 2),
                         tid="run-health-failures")]))
    return html.Div(section(f"Run {state}", parts, cls=f"fs-health fs-health-{state}"), id=HEALTH_PANEL)


@contained("attempts table")
def attempts_table(h: dict[str, Any] | None) -> html.Section | None:
    """The job's attempts in order (only when there is more than one)."""
    att = (h or {}).get("attempts") or []
    if len(att) < 2:
        return None
    rows = [[a["attempt"], dcc.Link(f"run {a['run_id']}", href=f"/runs/{a['run_id']}"), fmt_time(a.get("started_at")),
             fmt_time(a.get("ended_at")) if a.get("ended_at") else "—", status_badge(a.get("status")), fmt_num(a["steps"]),
             fmt_num(a["redone_steps"]), fmt_s(a["gap_s"]) if a.get("gap_s") is not None else "—"]
            for a in att]
    job = att[0].get("job_id")
    return section(f"Attempts of job {job}" if job else "Attempts of this job",
                   simple_table(["attempt", "run", "started", "ended", "status", "steps", "redone steps",
                                 "after the previous"], rows, numeric=(0, 5, 6), tid="run-attempts"),
                   sid="run-attempts-section")


def health_first(eng: Any, rows: list[dict[str, Any]], recent_s: float = 86_400.0) -> list[dict[str, Any]]:
    """The fleet rows with the runs that need someone first: hung, then stalled, then runs that failed in
    the last ``recent_s``, then the rest in their order; each row gets ``health_finding`` (the finding
    of the health pass for runs not running normally)."""
    import time

    from fleetscope.server.reports.health import fleet_health

    from .theme import to_utc

    ids = [int(r["id"]) for r in rows if r.get("status") in ("hung", "stalled", "failed")]
    found = fleet_health(eng, ids) if ids else {}
    now = time.time()

    def rank(i_r: tuple[int, dict[str, Any]]) -> tuple[int, int]:
        i, r = i_r
        st = r.get("status")
        if st == "failed":
            t = to_utc(r.get("last_seen_at") or r.get("started_at"))
            return (2 if t is not None and now - t.timestamp() < recent_s else 9, i)
        return (STATE_RANK.get(str(st), 9) if st in ("hung", "stalled") else 9, i)

    out = []
    for _, r in sorted(enumerate(rows), key=rank):
        h = found.get(int(r["id"])) if r.get("id") is not None else None
        out.append({**r, "health_finding": h["finding"] if h and h.get("finding") else None})
    return out


@contained("fleet goodput")
def fleet_goodput_kpi(eng: Any, days: int = 7) -> html.Div:
    """Fleet goodput of the runs started in the last ``days`` days, with the daily figures as its note."""
    from fleetscope.server.reports.health import fleet_goodput

    from .components import kpi

    rows = fleet_goodput(eng, days)
    prod = sum(r["productive_s"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    daily = " · ".join(f"{r['day'][5:]} {r['fraction'] * 100:.0f} %" for r in rows[-4:] if r["fraction"] is not None)
    return kpi(f"fleet goodput, {days} d", f"{prod / wall * 100:.0f} %" if wall > 0 else "–",
               daily or "productive step time over wall time", kid="fleet-goodput")
