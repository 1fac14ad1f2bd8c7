"""Baselines that hold: a regression that is never fixed never becomes the baseline, so `fleetscope check`
keeps failing on it until someone pins a new baseline (`fleetscope baseline pin RUN` / the API); the verdict
says which baseline it used. Real server, real Postgres, the real CLI."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
from analysis_util import load

from fleetscope.synthetic import RunSpec

DAY = 86400.0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetscope", *args], capture_output=True, text=True, timeout=120)


def test_a_persistent_regression_fails_every_check_until_a_baseline_is_pinned(live_server: Any) -> None:
    # the demo's nightly series in small: 6 good nights, then 8 nights 18 % slower that nobody fixes
    ids = []
    for d in range(14):
        ids.append(load(live_server, RunSpec(name=f"nightly-{d}", family="vla-7b", world_size=8, steps=5, seed=d,
                                             start_ts=1.7e9 + d * DAY, slow_factor=1.18 if d >= 6 else 1.0),
                        collectives=False))
    srv = ["--server", live_server.url, "--token", live_server.token]
    last = _cli("check", *srv, "--run", "nightly-13")
    # with a "median of the last 20 runs" baseline, 8 slow nights of 14 would have made slow the norm
    assert last.returncode == 1, last.stdout + last.stderr
    assert "REGRESSION" in last.stdout
    res = httpx.get(f"{live_server.url}/api/v1/runs/{ids[13]}/check", timeout=60).json()
    assert set(res["baseline"]["runs"]) <= set(ids[:6]), res["baseline"]
    assert res["baseline"]["pinned"] is None and "passed" in res["baseline"]["basis"]

    # the team accepts the new speed: pin night 12; night 13 now passes against it
    pin = _cli("baseline", "pin", "nightly-12", *srv)
    assert pin.returncode == 0 and "pinned run 'nightly-12'" in pin.stdout, pin.stdout + pin.stderr
    ok = _cli("check", *srv, "--run", "nightly-13")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    res = httpx.get(f"{live_server.url}/api/v1/runs/{ids[13]}/check", timeout=60).json()
    assert res["baseline"]["pinned"] == ids[12] and res["baseline"]["runs"] == [ids[12]]
    pins = httpx.get(f"{live_server.url}/api/v1/baselines", timeout=30).json()["baselines"]
    assert [p["run_id"] for p in pins] == [ids[12]]


def test_pinning_needs_a_run_of_ones_own(live_server: Any) -> None:
    from fleetscope.server.auth import create_token

    rid = load(live_server, RunSpec(name="mine", family="vla-7b", world_size=8, steps=5), collectives=False)
    other = create_token(live_server.state.engine, "other-team", scope="ingest", team="other")
    r = httpx.post(f"{live_server.url}/api/v1/baselines", json={"run_id": rid},
                   headers={"Authorization": f"Bearer {other}"}, timeout=30)
    assert r.status_code == 403, r.text
    r = httpx.post(f"{live_server.url}/api/v1/baselines", json={"run_id": 99999},
                   headers={"Authorization": f"Bearer {live_server.token}"}, timeout=30)
    assert r.status_code == 404, r.text


def test_scaling_sets_apart_failed_and_straggler_runs_and_the_url_overrides(live_server: Any) -> None:
    from fleetscope.server import reports

    good = {n: load(live_server, RunSpec(name=f"s{n}", family="scal", world_size=n, steps=5, seed=n),
                    collectives=False) for n in (8, 16)}
    slow = load(live_server, RunSpec(name="s16-straggler", family="scal", world_size=16, steps=5, seed=99,
                                     straggler={3: 2.5}), collectives=False)
    failed = load(live_server, RunSpec(name="s8-failed", family="scal", world_size=8, steps=5, seed=98),
                  collectives=False)
    r = httpx.post(f"{live_server.url}/api/v1/runs/{failed}/finish", json={"status": "failed"},
                   headers={"Authorization": f"Bearer {live_server.token}"}, timeout=30)
    assert r.status_code == 200, r.text
    eng = live_server.state.engine

    def on_curve(**kw: Any) -> set[int]:
        v = reports.scaling_view(eng, "scal", **kw)
        return {rid for c in v["configs"] for p in c["points"] for rid in p["runs"]}

    view = reports.scaling_view(eng, "scal")
    apart = {e["run"]: e["reason"] for e in view["excluded"]}
    assert set(apart) == {slow, failed}, apart
    assert "failed" in apart[failed] and "straggler" in apart[slow]
    assert on_curve() == set(good.values())
    assert on_curve(include=[slow]) == {*good.values(), slow}
    assert on_curve(exclude=[good[8]]) == {good[16]}
    # the page reads the same from its URL
    page = httpx.get(f"{live_server.url}/scaling", params={"family": "scal", "exclude": str(good[8])}, timeout=30)
    assert page.status_code == 200
