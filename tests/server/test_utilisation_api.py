"""Fleet utilisation through the real server: runs of two teams and two families with known spans and world
sizes (one straddling a UTC midnight, one started before the window, one ending after it, one outside it, one
failed, one with compacted steps and model FLOPs) add up exactly per team, family and day — GPU-hours, idle
(allocated, no step running), failed work and MFU-weighted GPU-hours with the unknown share — in the API, the
client and on /metrics; bad windows are 4xx naming what was wrong."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import pytest
from health_util import steps_batch
from sqlalchemy import text

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
H = 3600.0
PEAK = 1e12


def _at(h: float) -> dt.datetime:
    return T0 + dt.timedelta(hours=h)


def _set_span(srv: Any, rid: int, start_h: float, end_h: float, status: str) -> None:
    with srv.state.engine.begin() as c:
        c.execute(text("UPDATE runs SET started_at = :s, finished_at = :e, last_seen_at = :e, status = :st "
                       "WHERE id = :r"), {"s": _at(start_h), "e": _at(end_h), "st": status, "r": rid})


def make_fleet(srv: Any) -> dict[str, int]:
    """The runs of both tests (docs: expected figures in ``EXPECTED``)."""
    from fleetscope.server.auth import create_token

    from fleetscope.client import Client

    eng = srv.state.engine
    vision = Client(srv.url, create_token(eng, "vision-ci", scope="ingest", team="vision"))
    lang = Client(srv.url, create_token(eng, "lang-ci", scope="ingest", team="lang"))
    ids = {
        # 4 GPUs, 20:00 day 1 → 04:00 day 2: 16 GPU-h each day; 10 steps of 0.1 h at MFU 0.5 on day 2
        "a": vision.register_run({"name": "vit-a", "model_family": "vit", "world_size": 4, "peak_flops": PEAK}),
        # 8 GPUs, from 2 h before the window to 03:00 day 1, failed: 24 GPU-h in the window
        "b": lang.register_run({"name": "llm-b", "model_family": "llm", "world_size": 8}),
        # 2 GPUs, 02:00 day 3 → 8 h after the window's end: 22 h × 2 in the window
        "c": lang.register_run({"name": "vit-c", "model_family": "vit", "world_size": 2}),
        # outside the window
        "d": lang.register_run({"name": "llm-d", "model_family": "llm", "world_size": 64}),
    }
    t_steps = _at(25).timestamp()
    batch = steps_batch(ids["a"], 4, range(10), t0=t_steps, step_s=0.1 * H)
    batch["rank_steps"]["flops"] = [0.5 * PEAK * 0.1 * H] * 40
    vision.ingest(batch, fmt="json")
    srv.compact()
    _set_span(srv, ids["a"], 20, 28, "finished")
    _set_span(srv, ids["b"], -2, 3, "failed")
    _set_span(srv, ids["c"], 50, 80, "finished")
    _set_span(srv, ids["d"], 100, 110, "finished")
    return ids


#: team / family / day → (GPU-hours, idle GPU-hours); busy: run a's 10 steps × 0.1 h × 4 GPUs = 4 GPU-h
EXPECTED = {
    "team": {"vision": (32.0, 28.0), "lang": (68.0, 68.0)},
    "family": {"vit": (76.0, 72.0), "llm": (24.0, 24.0)},
    "day": {"2026-01-01": (40.0, 40.0), "2026-01-02": (16.0, 12.0), "2026-01-03": (44.0, 44.0)},
}


def test_gpu_hours_per_team_family_and_day_add_up_exactly(live_server: Any) -> None:
    srv = live_server
    ids = make_fleet(srv)
    url = f"{srv.url}/api/v1/fleet/utilisation"
    since, until = T0.isoformat(), _at(72).timestamp()
    body = httpx.get(url, params={"since": since, "until": until}, timeout=60).json()
    for g, want in EXPECTED.items():
        name = "date" if g == "day" else g
        got = {r[name]: (r["gpu_hours"], r["idle_gpu_hours"]) for r in body[g]}
        assert got == {k: pytest.approx(v, abs=1e-6) for k, v in want.items()}, (g, body[g])
        assert sum(r["gpu_hours"] for r in body[g]) == pytest.approx(body["total"]["gpu_hours"], abs=1e-6)
    tot = body["total"]
    assert tot["gpu_hours"] == pytest.approx(100.0) and tot["runs"] == 3
    assert tot["busy_gpu_hours"] == pytest.approx(4.0) and tot["idle_gpu_hours"] == pytest.approx(96.0)
    assert tot["idle_share"] == pytest.approx(0.96)
    assert tot["failed_gpu_hours"] == pytest.approx(24.0) and tot["redone_gpu_hours"] == 0
    # MFU-weighted: 40 rank-steps × 0.5 × peak × 0.1 h / peak = 2 GPU-h; known only for run a (32 GPU-h)
    assert tot["mfu_gpu_hours"] == pytest.approx(2.0) and tot["mfu"] == pytest.approx(2.0 / 32.0, abs=1e-4)
    assert tot["mfu_unknown_gpu_hours"] == pytest.approx(68.0) and tot["mfu_unknown_share"] == pytest.approx(0.68)
    assert [r["team"] for r in body["team"]] == ["lang", "vision"]  # largest first
    vis = next(r for r in body["team"] if r["team"] == "vision")
    assert vis["mfu"] == pytest.approx(2.0 / 32.0, abs=1e-4) and vis["mfu_unknown_gpu_hours"] == 0
    # one grouping, Unix-second bounds: the same numbers
    fam = httpx.get(url, params={"since": T0.timestamp(), "until": until, "by": "family"}, timeout=60).json()
    assert "team" not in fam and {r["family"]: r["gpu_hours"] for r in fam["family"]} == pytest.approx(
        {"vit": 76.0, "llm": 24.0})
    # a window holding only part of run a's first day
    part = httpx.get(url, params={"since": _at(22).isoformat(), "until": _at(23).isoformat(), "by": "team"},
                     timeout=60).json()
    assert {r["team"]: r["gpu_hours"] for r in part["team"]} == pytest.approx({"vision": 4.0})
    # the client: one row per team, the totals in attrs
    df = srv.client().utilisation(since=since, until=until, by="team")
    assert dict(zip(df["team"], df["gpu_hours"], strict=True)) == pytest.approx({"vision": 32.0, "lang": 68.0})
    assert df.attrs["total"]["gpu_hours"] == pytest.approx(100.0)
    # Prometheus: per team and family over the last 24 h (here: day 3, run c's 22 h × 2 GPUs), bounded labels
    from fleetscope.server.prom_utilisation import utilisation_gauges

    g = utilisation_gauges(srv.state.engine, now=_at(72).timestamp())
    _, series, labels = g["fleetscope_team_gpu_hours_24h"]
    assert labels == ("team",) and {k[0]: v for k, v in series} == pytest.approx({"lang": 44.0})
    assert {k[0]: v for k, v in g["fleetscope_family_idle_gpu_hours_24h"][1]} == pytest.approx({"vit": 44.0})
    assert "# TYPE fleetscope_team_gpu_hours_24h gauge" in httpx.get(f"{srv.url}/metrics", timeout=60).text
    # bad windows: 422 naming the problem
    for params, words in (({"since": until, "until": since}, "before"),
                          ({"since": "2025-01-01", "until": "2026-01-01"}, "92 days"),
                          ({"since": "yesterday"}, "ISO 8601"), ({"by": "team,planet"}, "planet")):
        r = httpx.get(url, params=params, timeout=60)
        assert r.status_code == 422 and words in r.text, (params, r.text)
    assert ids["d"] > 0


def test_steps_redone_after_a_restart_count_as_redone_gpu_hours(live_server: Any) -> None:
    """Attempt 0 of a job ran steps 0–9 and failed; attempt 1 resumed from the step-5 checkpoint and ran 5–14:
    its steps 5–9 are redone work (5 steps × 0.1 h × 2 GPUs = 1 GPU-h)."""
    srv = live_server
    with srv.client() as c:
        first = c.register_run({"name": "job-r", "model_family": "llm", "world_size": 2, "job_id": "j-1", "attempt": 0})
        c.ingest(steps_batch(first, 2, range(10), t0=_at(1).timestamp(), step_s=0.1 * H), fmt="json")
        second = c.register_run({"name": "job-r", "model_family": "llm", "world_size": 2, "job_id": "j-1",
                                 "attempt": 1})
        c.ingest(steps_batch(second, 2, range(5, 15), t0=_at(3).timestamp() - 0.5 * H, step_s=0.1 * H), fmt="json")
    srv.compact()
    _set_span(srv, first, 1, 2, "failed")
    _set_span(srv, second, 3, 5, "finished")
    body = httpx.get(f"{srv.url}/api/v1/fleet/utilisation",
                     params={"since": T0.isoformat(), "until": _at(24).isoformat(), "by": "family"}, timeout=60).json()
    (llm,) = body["family"]
    assert llm["gpu_hours"] == pytest.approx(2.0 + 4.0) and llm["failed_gpu_hours"] == pytest.approx(2.0)
    assert llm["redone_gpu_hours"] == pytest.approx(1.0) and llm["busy_gpu_hours"] == pytest.approx(2.0 + 2.0)
