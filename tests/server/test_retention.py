"""Retention, automated: per-family policy, preview and apply (CLI and the server's own pass),
bounded batches, and thinned runs whose summaries and pages still work and say what was thinned."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from sqlalchemy import text

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows


def _load(c: Any, name: str, family: str, days_old: float, engine: Any) -> int:
    spec = RunSpec(name=name, family=family, world_size=4, steps=6)
    rid = c.register_run(spec.run_info())
    for step, rows in rank_step_rows(spec):
        c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    c.finish_run(rid)
    with engine.begin() as x:
        x.execute(text("UPDATE runs SET finished_at = now() - make_interval(days => :d) WHERE id = :r"),
                  {"d": int(days_old), "r": rid})
    return rid


def _settings(db_url: str, **kw: Any) -> Any:
    from fleetscope.server.settings import Settings

    return Settings(database_url=db_url, **kw)


def test_policy_preview_apply_and_thinned_runs_still_summarise(live_server: Any, engine: Any) -> None:
    from fleetscope.server import retention
    from fleetscope.server.store.steps import rank_step_matrix

    with live_server.client() as c:
        young = _load(c, "young", "a", 1, engine)
        mid = _load(c, "mid", "a", 10, engine)
        old = _load(c, "old", "a", 40, engine)
        _load(c, "ancient", "a", 400, engine)
        keep = _load(c, "kept-family", "b", 400, engine)  # family b keeps everything
        live_server.compact()
        before = {r: c.summary(r) for r in (mid, old)}
    settings = _settings(live_server.db_url, retention_blocks_days=7, retention_rollups_days=30,
                         retention_runs_days=365, retention_overrides={"b": {"blocks_days": None, "rollups_days": None,
                                                                               "runs_days": None}})
    plan = {a.name: a.action for a in retention.plan(engine, settings)}
    assert plan == {"mid": "blocks", "old": "rollups", "ancient": "delete"}
    with engine.connect() as x:  # a preview changes nothing
        assert x.execute(text("SELECT count(*) FROM runs WHERE thinned IS NOT NULL")).scalar() == 0

    done = retention.apply(engine, settings, limit=2)  # bounded: two runs this pass
    assert [d["name"] for d in done] == ["ancient", "old"]
    done += retention.apply(engine, settings)
    assert [d["name"] for d in done] == ["ancient", "old", "mid"]
    assert retention.plan(engine, settings) == []  # nothing left to do: a second pass is a no-op

    with live_server.client() as c:
        names = {r["name"] for r in c.run_list(limit=100)}
        assert "ancient" not in names and {"young", "mid", "old", "kept-family"} <= names
        for rid in (mid, old):
            s = c.summary(rid)
            assert s["decomposition"] == before[rid]["decomposition"]  # the figures survive thinning
            assert s["rank_steps"] == before[rid]["rank_steps"]
        assert set(c.summary(mid)["run"]["thinned"]) == {"blocks"}
        assert set(c.summary(old)["run"]["thinned"]) == {"rollups"}
        assert c.summary(young)["run"]["thinned"] is None and c.summary(keep)["run"]["thinned"] is None
    # the per-rank matrix of the thinned run is gone, the young one's is whole
    assert not (rank_step_matrix(engine, mid, "step_s")[2] > 0).any()
    assert (rank_step_matrix(engine, young, "step_s")[2] > 0).all()
    with engine.connect() as x:
        assert x.execute(text("SELECT count(*) FROM steps WHERE run_id = :r"), {"r": old}).scalar() == 0
        assert x.execute(text("SELECT count(*) FROM steps WHERE run_id = :r"), {"r": mid}).scalar() == 6


def test_bad_overrides_are_named() -> None:
    with pytest.raises(Exception, match=r"retention_overrides\['x'\]\.blocks_days"):
        _settings("postgresql://x/y", retention_overrides={"x": {"blocks_days": -1}})


def test_cli_previews_then_applies(live_server: Any, engine: Any) -> None:
    with live_server.client() as c:
        rid = _load(c, "cli-old", "a", 20, engine)
        live_server.compact()
    cmd = [sys.executable, "-m", "fleetscope.cli", "retention", "--database-url", live_server.db_url, "--blocks-days", "7"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "would do: 1 run" in out.stdout and "blocks" in out.stdout and "cli-old" in out.stdout
    out = subprocess.run([*cmd, "--apply"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "done: 1 run" in out.stdout and "(6 steps)" in out.stdout
    with engine.connect() as x:
        assert "blocks" in x.execute(text("SELECT thinned FROM runs WHERE id = :r"), {"r": rid}).scalar()
    none = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=120)
    assert none.returncode == 2 and "no retention limit set" in none.stderr


def test_the_server_applies_the_policy_itself(db_url: str, engine: Any) -> None:
    from conftest import start_server

    srv = start_server(db_url, retention_blocks_days=7, retention_interval_s=0.2)
    try:
        with srv.client() as c:
            rid = _load(c, "auto", "a", 9, engine)
            srv.compact()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not c.summary(rid)["run"]["thinned"]:
                time.sleep(0.2)
            assert set(c.summary(rid)["run"]["thinned"] or {}) == {"blocks"}
    finally:
        srv.stop()


def test_the_run_page_says_what_was_thinned(live_server: Any, engine: Any) -> None:
    import httpx
    from fleetscope.server import retention

    with live_server.client() as c:
        rid = _load(c, "page-thinned", "a", 40, engine)
        live_server.compact()
    retention.apply(engine, _settings(live_server.db_url, retention_blocks_days=7, retention_rollups_days=30))
    # the page layout is built per request from the run: the note is in it
    from fleetscope.dashboard import _state
    from fleetscope.dashboard.pages import run as run_page

    assert httpx.get(f"{live_server.url}/run/{rid}", timeout=30).status_code == 200
    old = _state.engine
    try:
        _state.engine = lambda: engine  # type: ignore[assignment]
        layout = run_page.layout(run_id=str(rid))
    finally:
        _state.engine = old  # type: ignore[assignment]
    flat = str(layout.to_plotly_json())
    assert "run-thinned" in flat and "Retention removed its per-step rows" in flat
