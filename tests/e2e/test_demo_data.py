"""The demo's history is data an expert believes: each family trained as such a model is (70B on FSDP with
sharded memory), memory per family below the device's, gradient reductions issued in backward, dates
ending now; and its nightly regression persists, so `fleetscope check` fails on the last night. The small
history loaded through the real API into a real server (real Postgres), checked over HTTP and the CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import httpx

from fleetscope.demo import fleet_history, load_history
from fleetscope.synthetic import DEVICE_MEMORY


def test_demo_history_is_plausible_and_its_last_night_fails_check(live_server: Any) -> None:
    t_load = time.time()
    specs = fleet_history(small=True)
    with live_server.client() as c:
        load_history(c, specs)
    live_server.compact()
    base = live_server.url
    runs = {r["name"]: r for r in httpx.get(f"{base}/api/v1/runs", params={"limit": 1000}, timeout=60).json()["runs"]}
    assert set(runs) == {s.name for s in specs}

    # 70B: FSDP (sharded states), its collectives all-gathers and reduce-scatters, no 140 GB all-reduce
    big = runs["llm-70b-scale-32"]
    assert big["config"]["parallelism"]["strategy"] == "fsdp"
    assert big["meta"]["params"] == 70e9 and big["meta"]["active_params"] == 70e9
    colls = httpx.get(f"{base}/api/v1/runs/{big['id']}/collectives", timeout=60).json()["collectives"]
    assert {c["op"] for c in colls} == {"all_gather", "reduce_scatter"}
    assert runs["vit-h-scale-32"]["config"]["parallelism"]["strategy"] == "ddp"

    # per-rank peak memory below the device's, and not one number for every family
    peaks = {}
    for name in ("llm-70b-scale-32", "vla-7b-scale-32", "vit-h-scale-32", "video-dit-3b-scale-32"):
        s = httpx.get(f"{base}/api/v1/runs/{runs[name]['id']}/summary", timeout=60).json()
        peaks[name] = s["mem_peak_bytes"]
        assert 0 < peaks[name] < DEVICE_MEMORY["H100"], (name, peaks[name])
    ordered = sorted(peaks.values())
    assert all(b - a > 0.5e9 for a, b in zip(ordered, ordered[1:], strict=False)), peaks
    assert peaks["llm-70b-scale-32"] > peaks["vla-7b-scale-32"]

    # the gradient reductions are issued in backward, not before it
    ov = httpx.get(f"{base}/api/v1/runs/{big['id']}/overlap", timeout=60).json()
    grads = [c for c in ov["collectives"] if c["gradient"]]
    assert grads and all(c["phase"] == "backward" for c in grads), ov["collectives"]
    assert any(c["op"] == "all_gather" and c["phase"] == "before_backward" for c in ov["collectives"])

    # dated relative to now: the newest run started within the last day and none lies in the future
    started = [s.start_ts for s in specs]
    assert t_load - 86400 < max(started) <= t_load and min(started) > t_load - 30 * 86400

    # the nightly regression is never fixed: check fails on the last night (the baseline does not drift)
    last = max(n for n in runs if n.startswith("vla-7b-nightly-"))
    out = subprocess.run([sys.executable, "-m", "fleetscope", "check", "--server", base, "--token", live_server.token,
                          "--run", last], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "REGRESSION" in out.stdout, out.stdout + out.stderr


def test_simulate_realistic_sends_the_familys_own_parallelism(live_server: Any) -> None:
    out = subprocess.run([sys.executable, "-m", "fleetscope", "simulate", "--server", live_server.url, "--token",
                          live_server.token, "--run", "sim-70b", "--family", "llm-70b", "--ranks", "32", "--steps", "3",
                          "--realistic"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    live_server.compact()
    (run,) = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "eq:sim-70b"}, timeout=30).json()["runs"]
    assert run["config"]["parallelism"]["strategy"] == "fsdp" and run["meta"]["params"] == 70e9
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/collectives", timeout=60).json()["collectives"]
    assert {c["op"] for c in colls} == {"all_gather", "reduce_scatter"}
