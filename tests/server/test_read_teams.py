"""Teams on the read side, through the real server (``--read-auth``) and real Postgres.

A read token created with a team lists, filters and opens only its team's runs (and runs without an
owner); another team's run is a 404 on every per-run read; an admin sees every run. Regression
baselines and ``fleetscope check`` use the run's own namespace, so another team's runs never move a
verdict, and ``check --run NAME`` refuses a name that several owners' jobs share."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import httpx
import pytest
from analysis_util import load
from conftest import start_server
from fleetscope.server.auth import create_token

from fleetscope.synthetic import RunSpec

DAY = 86400.0


@pytest.fixture
def teams(db_url: str) -> Any:
    srv = start_server(db_url, read_auth=True)
    try:
        eng = srv.state.engine
        toks = {
            "a_ingest": create_token(eng, "a-ingest", scope="ingest", team="team-a"),
            "b_ingest": create_token(eng, "b-ingest", scope="ingest", team="team-b"),
            "a_read": create_token(eng, "a-read", scope="read", team="team-a"),
        }
        yield srv, toks
    finally:
        srv.stop()


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _register(srv: Any, token: str, name: str, **extra: Any) -> int:
    r = httpx.post(f"{srv.url}/api/v1/runs", json={"name": name, "model_family": "vla", "world_size": 2, **extra},
                   headers=_h(token), timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["id"])


def test_a_team_read_token_sees_only_its_teams_runs(teams: Any) -> None:
    srv, t = teams
    a = _register(srv, t["a_ingest"], "a-run", config={"secret": "A"})
    b = _register(srv, t["b_ingest"], "b-run", config={"secret": "B"})
    with httpx.Client(base_url=srv.url, timeout=30, headers=_h(t["a_read"])) as c:
        body = c.get("/api/v1/runs").json()
        assert [r["id"] for r in body["runs"]] == [a] and body["total"] == 1
        assert c.get("/api/v1/runs", params={"config.secret": "B"}).json()["total"] == 0
        assert c.get("/api/v1/runs", params={"group_by": "config.secret"}).json()["groups"] == [
            {"config.secret": "A", "count": 1, "median_mfu": None, "median_tokens_per_s_per_gpu": None,
             "median_step_s": None}]
        for path in ("", "/summary", "/health", "/steps", "/scalars", "/collectives", "/check", "/traces"):
            r = c.get(f"/api/v1/runs/{b}{path}")
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert "B" not in r.text.replace("Bearer", "")
            assert c.get(f"/api/v1/runs/{a}{path}").status_code == 200, path
    # an admin reads every run
    body = httpx.get(f"{srv.url}/api/v1/runs", headers=_h(srv.token), timeout=30).json()
    assert {r["id"] for r in body["runs"]} == {a, b}


def test_the_facade_scopes_lists_for_the_dashboard(teams: Any) -> None:
    from fleetscope.server import reports
    from fleetscope.server.auth import Principal
    from fleetscope.server.reports import research, scope

    srv, t = teams
    a = _register(srv, t["a_ingest"], "a-run")
    b = _register(srv, t["b_ingest"], "b-run")
    eng = srv.state.read_engine
    reader = Principal(1, "a-read", "read", team="team-a")
    with scope.viewing(reader):
        assert [r["id"] for r in reports.fleet_rows(eng)] == [a]
        assert [r["id"] for r in reports.run_options(eng)] == [a]
        assert reports.get_run(eng, b) is None and reports.get_run(eng, a) is not None
        assert reports.run_summary(eng, b) is None
        with pytest.raises(LookupError):
            reports.run_series(eng, b)
        q = research.parse_query([])
        assert [r["id"] for r in research.runs_view(eng, q)["runs"]] == [a]
        assert [r["id"] for r in reports.compare_view(eng, [a, b])["runs"]] == [a]
    # the dashboard's way in: the principal the edge put in the request's ASGI scope
    from flask import Flask
    from fleetscope.dashboard import _state

    with Flask(__name__).test_request_context(environ_base={"fleetscope.app_state": srv.app.state,
                                                            "asgi.scope": {"state": {"principal": reader}}}):
        e = _state.engine()
        assert e is srv.state.read_engine
        assert [r["id"] for r in reports.fleet_rows(e)] == [a]
    with Flask(__name__).test_request_context(environ_base={"fleetscope.app_state": srv.app.state}):
        assert {r["id"] for r in reports.fleet_rows(_state.engine())} == {a, b}  # no principal: all
    scope.set_viewer(None)


def test_baselines_and_check_stay_in_the_runs_namespace(teams: Any) -> None:
    srv, t = teams
    a_srv = dataclasses.replace(srv, token=t["a_ingest"])
    b_srv = dataclasses.replace(srv, token=t["b_ingest"])
    a_ids = {load(a_srv, RunSpec(name=f"a-base-{d}", family="vla-7b", world_size=8, steps=5, seed=d,
                                 start_ts=1.7e9 + d * DAY), collectives=False) for d in range(3)}
    # team B's runs of the same family and setup: many more, and much faster — they would be the baseline
    for d in range(7):
        load(b_srv, RunSpec(name=f"b-base-{d}", family="vla-7b", world_size=8, steps=5, seed=10 + d,
                            start_ts=1.7e9 + (3 + d) * DAY, slow_factor=0.6), collectives=False)
    cand = load(a_srv, RunSpec(name="pr", family="vla-7b", world_size=8, steps=5, seed=50,
                               start_ts=1.7e9 + 10 * DAY), collectives=False)
    load(b_srv, RunSpec(name="pr", family="vla-7b", world_size=8, steps=5, seed=51,
                        start_ts=1.7e9 + 11 * DAY, slow_factor=0.6), collectives=False)
    res = httpx.get(f"{srv.url}/api/v1/runs/{cand}/check", headers=_h(srv.token), timeout=60).json()
    assert res["regressed"] is False, res
    assert set(res["baseline"]["runs"]) == a_ids, res["baseline"]

    cli = [sys.executable, "-m", "fleetscope", "check", "--server", srv.url, "--run", "pr"]
    # an admin sees both teams' "pr": ambiguous, refused with the ids
    p = subprocess.run([*cli, "--token", srv.token], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "several owners" in p.stderr and str(cand) in p.stderr, p.stderr
    # team A's read token sees its own "pr" only: checked, no regression
    p = subprocess.run([*cli, "--token", t["a_read"]], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "no regression" in p.stdout, p.stdout + p.stderr


def test_regression_series_are_per_namespace(teams: Any) -> None:
    from fleetscope.server import reports

    srv, t = teams
    a_srv = dataclasses.replace(srv, token=t["a_ingest"])
    b_srv = dataclasses.replace(srv, token=t["b_ingest"])
    a_ids = {load(a_srv, RunSpec(name=f"a-{d}", family="vla-7b", world_size=8, steps=5, seed=d,
                                 start_ts=1.7e9 + d * DAY), collectives=False) for d in range(3)}
    b_ids = {load(b_srv, RunSpec(name=f"b-{d}", family="vla-7b", world_size=8, steps=5, seed=10 + d,
                                 start_ts=1.7e9 + (3 + d) * DAY, slow_factor=1.6), collectives=False) for d in range(3)}
    found, evaluated = reports.run_series_regressions(srv.state.engine)
    # B's slower runs never form a regression of A's series (nor one series with A's runs)
    for reg in found:
        ids = set(reg.details.get("good_runs") or []) | set(reg.details.get("bad_runs") or [])
        assert ids <= a_ids or ids <= b_ids, reg.details
    # the same family and setup in two namespaces: two series
    _, only_a = reports.run_series_regressions(srv.state.engine, run_ids=list(a_ids))
    _, only_b = reports.run_series_regressions(srv.state.engine, run_ids=list(b_ids))
    assert only_a and only_b and not (only_a & only_b)


def test_benchmark_series_are_owned_like_runs(teams: Any) -> None:
    srv, t = teams
    body = {"cluster": "c1", "points": [{"name": "allreduce_busbw", "params": {"size": "1GiB"}, "unit": "GB/s",
                                         "value": 180.0}]}
    ids = {}
    for who in ("a_ingest", "b_ingest"):
        r = httpx.post(f"{srv.url}/api/v1/benchmarks", json=body, headers=_h(t[who]), timeout=30)
        assert r.status_code == 200, r.text
        ids[who] = r.json()["series"][0]
    assert ids["a_ingest"] != ids["b_ingest"]  # B's points never land in A's series
    seen = httpx.get(f"{srv.url}/api/v1/benchmarks", headers=_h(t["a_read"]), timeout=30).json()
    assert [s["id"] for s in seen["series"]] == [ids["a_ingest"]]
    assert httpx.get(f"{srv.url}/api/v1/benchmarks/{ids['b_ingest']}", headers=_h(t["a_read"]),
                     timeout=30).status_code == 404
    everything = httpx.get(f"{srv.url}/api/v1/benchmarks", headers=_h(srv.token), timeout=30).json()
    assert {s["id"] for s in everything["series"]} == set(ids.values())
