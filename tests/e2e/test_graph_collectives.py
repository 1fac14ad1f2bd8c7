"""Collectives inside a torch.compile'd region are invisible to the agent's Python wrappers; torch's
Flight Recorder sees them. A real 2-rank gloo job, unmodified under ``fleetscope run``, all-reduces its
gradients through a compiled function (functional collectives, dynamic shapes: the weight and the bias)
and issues one eager all_reduce per step: the summary's ``graph_collectives`` counts exactly the
compiled ones (2 per rank-step, their bytes), the eager one stays the agent's own record and is not
counted twice, and the job is not broken by the agent (it was: the functional-collective wrapper
was traced into the graph and read ``nbytes`` of a symbolic tensor)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, WIDTH = 5, 32

SCRIPT = f"""
import sys
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear({WIDTH}, {WIDTH})
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def sync(x):
    return funcol.all_reduce(x * 1.0, "sum", dist.group.WORLD) / dist.get_world_size()

csync = torch.compile(sync, backend="eager")
for step in range({STEPS}):
    loss = model(torch.randn(8, {WIDTH})).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        p.grad = csync(p.grad)
    dist.all_reduce(torch.ones(16))
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write("done\\n")
"""


def test_compiled_collectives_are_counted_once_by_the_flight_recorder(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    for var in ("FLEETSCOPE_RUN_NAME", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env.pop(var, None)
    res = subprocess.run([*FS_RUN, "--name", "graph-colls", "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                          "train.py"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("done") == 2
    url = live_server.url
    rid = httpx.get(f"{url}/api/v1/runs", params={"name": "graph-colls"}, timeout=10).json()["runs"][0]["id"]
    live_server.compact()
    s = httpx.get(f"{url}/api/v1/runs/{rid}/summary", timeout=30).json()
    assert s["steps"] == STEPS and s["rank_steps"] == 2 * STEPS
    g = s["graph_collectives"]
    # per rank-step: the weight (WIDTH×WIDTH fp32) and the bias (WIDTH fp32), all-reduced in the graph
    per_step_bytes = 4 * (WIDTH * WIDTH + WIDTH)
    assert g["source"] == "flight_recorder" and g["timed"] is False and g["ranks"] == 2
    assert g["by"] == [{"op": "all_reduce", "dim": "world", "calls": 2 * 2 * STEPS, "bytes": 2 * STEPS * per_step_bytes,
                        "ranks": 2}]
    assert (g["calls"], g["bytes"]) == (2 * 2 * STEPS, 2 * STEPS * per_step_bytes)
    # the eager all_reduce is the agent's own record (64 bytes), once per rank-step, and only there
    colls = httpx.get(f"{url}/api/v1/runs/{rid}/collectives", timeout=30).json()["collectives"]
    eager = [c for c in colls if c["op"] == "all_reduce" and c["bytes"] == 64 * c["calls"]]
    assert sum(c["calls"] for c in eager) == 2 * STEPS, colls
