"""Per-node microbenchmarks: ``fleetscope bench`` really measures and records node_matmul_tflops,
node_mem_bandwidth and node_all_reduce_busbw by message size under the node's name, and
``GET /api/v1/nodes`` shows each node's latest figures against the other nodes' median."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from fleetscope.bench import node_figures, node_name


def test_bench_records_per_node_series_that_the_node_history_compares(live_server: Any) -> None:
    env = {**os.environ, "FLEETSCOPE_NODE": "bench-a", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "fleetscope", "bench", "--quick", "--server", live_server.url,
                          "--token", live_server.token, "--cluster", "ci", "--git-commit", "abc"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "node_mem_bandwidth[node=bench-a,bytes=16777216,device=cpu]:" in out.stdout
    assert live_server.token not in out.stdout + out.stderr
    series = httpx.get(f"{live_server.url}/api/v1/benchmarks", params={"cluster": "ci"}).json()["series"]
    per_node = {(s["name"], s["params"].get("size_bytes")): s for s in series if s["name"].startswith("node_")}
    assert set(per_node) == {("node_matmul_tflops", None), ("node_mem_bandwidth", None),
                             ("node_all_reduce_busbw", 4096), ("node_all_reduce_busbw", 1 << 20)}
    assert all(s["params"]["node"] == "bench-a" and s["points"][0]["value"] > 0 for s in per_node.values())
    mm = per_node[("node_matmul_tflops", None)]
    assert mm["params"] == {"node": "bench-a", "n": 256, "dtype": "float32", "device": "cpu"}

    (n,) = httpx.get(f"{live_server.url}/api/v1/nodes").json()["nodes"]
    mb = n["microbench"]
    assert n["node"] == "bench-a" and n["runs"] == 0 and set(mb) == {"matmul_tflops", "mem_bandwidth", "all_reduce_busbw"}
    assert mb["matmul_tflops"]["value"] == mm["points"][0]["value"] and mb["matmul_tflops"]["vs_median"] is None
    assert set(mb["all_reduce_busbw"]["by_size"]) == {"4096", "1048576"}
    assert mb["all_reduce_busbw"]["value"] == mb["all_reduce_busbw"]["by_size"]["1048576"]

    # two more nodes measured twice as fast: bench-a is at half the median; an older, faster point of it is not the latest
    v = mm["points"][0]["value"]
    pts = [{"name": "node_matmul_tflops", "params": {**mm["params"], "node": other}, "unit": "TFLOP/s", "value": 2 * v}
           for other in ("bench-b", "bench-c")]
    pts.append({"name": "node_matmul_tflops", "params": mm["params"], "unit": "TFLOP/s", "value": 3 * v, "ts": 1.6e9})
    with live_server.client() as c:
        assert c.http.post("/api/v1/benchmarks", json={"cluster": "ci", "points": pts}).status_code == 200
    nodes = {x["node"]: x for x in httpx.get(f"{live_server.url}/api/v1/nodes").json()["nodes"]}
    assert nodes["bench-a"]["microbench"]["matmul_tflops"]["vs_median"] == pytest.approx(0.5, abs=1e-3)
    assert nodes["bench-b"]["microbench"]["matmul_tflops"]["vs_median"] == pytest.approx(1.0)
    one = httpx.get(f"{live_server.url}/api/v1/nodes/bench-a").json()
    assert one["run_history"] == [] and one["microbench"]["matmul_tflops"]["value"] == v


def test_node_figures_and_the_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    res = [{"name": "matmul_tflops", "params": {"n": n, "dtype": dt, "device": dev}, "unit": "TFLOP/s", "value": val}
           for n, dt, dev, val in ((4096, "bfloat16", "cuda", 700.0), (8192, "bfloat16", "cuda", 750.0),
                                   (8192, "float32", "cuda", 60.0), (1024, "float32", "cpu", 0.5))]
    res.append({"name": "all_reduce_busbw", "params": {"bytes": 1 << 20, "world": 2, "backend": "nccl"}, "unit": "GB/s",
                "value": 100.0})
    whole = {"name": "all_reduce_busbw", "params": {"bytes": 1 << 20, "world": 8, "backend": "nccl"}, "unit": "GB/s",
             "value": 300.0}
    mem = {"name": "node_mem_bandwidth", "params": {"bytes": 1 << 30, "device": "cuda"}, "unit": "GB/s", "value": 4000.0}
    out = {(r["name"], r["value"]): r["params"] for r in node_figures("g1", res, [whole, mem])}
    assert out == {("node_matmul_tflops", 750.0): {"node": "g1", "n": 8192, "dtype": "bfloat16", "device": "cuda"},
                   ("node_all_reduce_busbw", 300.0): {"node": "g1", "size_bytes": 1 << 20, "world": 8, "backend": "nccl"},
                   ("node_mem_bandwidth", 4000.0): {"node": "g1", "bytes": 1 << 30, "device": "cuda"}}
    # without a whole-node all_reduce, the cluster one is the node's
    assert [r["value"] for r in node_figures("g1", res) if r["name"] == "node_all_reduce_busbw"] == [100.0]
    monkeypatch.setenv("FLEETSCOPE_NODE", "mine")
    assert node_name() == "mine"
    monkeypatch.delenv("FLEETSCOPE_NODE")
    monkeypatch.setenv("SLURMD_NODENAME", "slurm-7")
    assert node_name() == "slurm-7"
