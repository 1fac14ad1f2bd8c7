"""`fleetscope check` exit codes against a live server, benchmark series and their regressions,
and `fleetscope bench` recording real microbenchmarks."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
from analysis_util import load, scale_rows

from fleetscope.synthetic import RunSpec

DAY = 86400.0


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetscope", *args], capture_output=True, text=True, timeout=timeout)


def _inproc(*args: str) -> Any:
    """The same command in this process (typer's runner): the exit-code contract without a start-up."""
    from typer.testing import CliRunner

    from fleetscope.cli import app

    return CliRunner().invoke(app, list(args))


def test_check_exit_codes(live_server: Any) -> None:
    for d in range(6):
        load(live_server, RunSpec(name=f"base-{d}", family="vla-7b", world_size=8, steps=5, seed=d,
                                  start_ts=1.7e9 + d * DAY), collectives=False)
    load(live_server, RunSpec(name="pr-slow", family="vla-7b", world_size=8, steps=5, seed=50,
                              start_ts=1.7e9 + 9 * DAY, slow_factor=1.15), collectives=False)
    load(live_server, RunSpec(name="pr-ok", family="vla-7b", world_size=8, steps=5, seed=51,
                              start_ts=1.7e9 + 10 * DAY), collectives=False)
    load(live_server, RunSpec(name="pr-shift", family="vit-h", world_size=4, steps=60, seed=52),
         transform=scale_rows(1.3, 30), collectives=False)
    srv = ["--server", live_server.url, "--token", live_server.token]
    ok = _cli("check", *srv, "--run", "pr-ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "no regression" in ok.stdout and "baseline run(s)" in ok.stdout
    # the baseline is the earlier runs that passed: pr-slow regressed, so it never joins it
    runs = {r["name"]: r["id"] for r in httpx.get(f"{live_server.url}/api/v1/runs", timeout=30).json()["runs"]}
    verdict = httpx.get(f"{live_server.url}/api/v1/runs/{runs['pr-ok']}/check", timeout=60).json()
    assert runs["pr-slow"] not in verdict["baseline"]["runs"] and len(verdict["baseline"]["runs"]) >= 5
    slow = _cli("check", *srv, "--run", "pr-slow")
    assert slow.returncode == 1, slow.stdout + slow.stderr
    assert "REGRESSION: tokens_per_s_per_gpu" in slow.stdout and "baseline run(s)" in slow.stdout
    assert "-1" in slow.stdout  # the relative change is printed, e.g. -13.1%
    unknown = _cli("check", *srv, "--run", "no-such-run")
    assert unknown.returncode == 2 and "no run named" in unknown.stderr
    shift = _inproc("check", *srv, "--run", "pr-shift")
    assert shift.exit_code == 1 and "within the run" in shift.output and "step_s" in shift.output
    assert _inproc("check", *srv, "--run", "base-0").exit_code == 0  # the first run has no baseline
    assert _inproc("check", "--server", "http://127.0.0.1:9", "--run", "x").exit_code == 2  # unreachable
    assert _inproc("check", "--run", "x", "--server", "").exit_code == 2


def test_benchmark_series_are_recorded_and_a_drop_alerts(live_server: Any) -> None:
    hdr = {"Authorization": f"Bearer {live_server.token}"}
    pts = [{"name": "all_reduce_busbw", "params": {"bytes": 1 << 20, "world": 8}, "unit": "GB/s",
            "value": (100.0 if i < 14 else 80.0) + (i % 3) * 0.5, "ts": 1.7e9 + i * DAY, "git_commit": f"c{i:03d}"}
           for i in range(20)]
    assert httpx.post(f"{live_server.url}/api/v1/benchmarks", json={"cluster": "a", "points": pts}).status_code == 401
    r = httpx.post(f"{live_server.url}/api/v1/benchmarks", json={"cluster": "a", "points": pts}, headers=hdr)
    assert r.status_code == 200 and r.json()["points"] == 20
    bad = httpx.post(f"{live_server.url}/api/v1/benchmarks", json={"cluster": "a", "points": [{**pts[0], "value": "x"}]},
                     headers=hdr)
    assert bad.status_code == 422
    (series,) = httpx.get(f"{live_server.url}/api/v1/benchmarks", params={"cluster": "a"}).json()["series"]
    assert series["unit"] == "GB/s" and len(series["points"]) == 20 and series["points"][0]["git_commit"] == "c000"
    assert httpx.get(f"{live_server.url}/api/v1/benchmarks/{series['id']}").json()["id"] == series["id"]
    live_server.state.alerts.run_once(everything=True)
    (a,) = httpx.get(f"{live_server.url}/api/v1/alerts", params={"kind": "benchmark"}).json()["alerts"]
    assert a["metric"] == "all_reduce_busbw" and a["first_bad"]["commit"] == "c014" and a["change"] < -0.15
    assert a["url"].endswith(f"/benchmarks?series={series['id']}")


def test_bench_command_records_microbenchmarks(live_server: Any) -> None:
    out = _cli("bench", "--quick", "--server", live_server.url, "--token", live_server.token, "--cluster", "ci",
               "--git-commit", "abc123", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "matmul_tflops[n=128,dtype=float32,device=cpu]:" in out.stdout and "all_reduce_busbw" in out.stdout
    series = httpx.get(f"{live_server.url}/api/v1/benchmarks", params={"cluster": "ci"}).json()["series"]
    names = {s["name"] for s in series}
    assert {"matmul_tflops", "all_reduce_busbw"} <= names
    assert all(s["points"][0]["value"] > 0 and s["points"][0]["git_commit"] == "abc123" for s in series)
