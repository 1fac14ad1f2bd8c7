"""A real 2-rank DDP job (torchrun + gloo on CPU, unmodified, through ``fleetscope run``) with a small
``bucket_cap_mb``, so its gradients go in several buckets: the overlap endpoint places every bucket's
all-reduce inside backward, ends backward at the last bucket's issue, and its exposed seconds are the
rank-step's ``comm_exposed_s`` — all of it in the tail after backward, as DDP's reducer waits there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, WIDTH, DEPTH = 8, 64, 4
PARAM_BYTES = 4 * (DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1)

DDP_SCRIPT = f"""
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
layers = []
for _ in range({DEPTH}):
    layers += [torch.nn.Linear({WIDTH}, {WIDTH}), torch.nn.ReLU()]
# 10 KiB buckets: each 16 KiB weight closes one, so backward issues several all-reduces
model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear({WIDTH}, 1)), bucket_cap_mb=0.01)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    loss = model(torch.randn(8, {WIDTH})).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""


def test_ddp_buckets_are_placed_in_backward_and_match_the_step_records(live_server: Any, engine: Any,
                                                                       tmp_path: Path) -> None:
    from fleetscope.server.store.steps import rank_step_matrix

    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", "ddp-buckets", "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                          "train.py"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    url = live_server.url
    run = httpx.get(f"{url}/api/v1/runs", params={"name": "ddp-buckets"}, timeout=10).json()["runs"][0]
    rid = run["id"]
    live_server.compact()
    steps, ranks, exposed = rank_step_matrix(engine, rid, "comm_exposed_s")
    assert exposed.shape == (STEPS, 2) and not np.isnan(exposed).any()
    step_s = rank_step_matrix(engine, rid, "step_s")[2]

    default = httpx.get(f"{url}/api/v1/runs/{rid}/overlap", timeout=30).json()
    assert default["step"] in steps.tolist() and default["rank"] in (0, 1)
    # the default rank is the step's median one: of two ranks, the faster
    row = steps.tolist().index(default["step"])
    assert step_s[row, default["rank"]] == step_s[row].min()

    many = 0
    for step in range(1, STEPS):  # step 0 runs DDP's initial single bucket; they are rebuilt after it
        for rank in (0, 1):
            d = httpx.get(f"{url}/api/v1/runs/{rid}/overlap", params={"step": step, "rank": rank}, timeout=30).json()
            colls = [c for c in d["collectives"] if c["phase"] != "before_step"]
            assert colls and all(c["op"] == "all_reduce" and c["dim"] == "world" for c in colls), colls
            # every gradient byte once per step, in buckets of at most one 16 KiB weight (+ small tensors)
            assert sum(c["bytes"] for c in colls) == PARAM_BYTES
            many += len(colls) >= 3
            bwd = d["backward"]
            assert bwd is not None and bwd["end"] == "last gradient reduction issued"
            # inside backward: issued after its (estimated) start, the last issue is its end, each bucket
            # completes after its issue, and the last one before the step ends
            assert 0 <= bwd["start_s"] <= min(c["start_s"] for c in colls) + 1e-6, (bwd, colls)
            assert bwd["end_s"] == max(c["start_s"] for c in colls)
            assert all(c["phase"] == "backward" and c["gradient"] for c in colls)
            assert all(c["end_s"] >= c["start_s"] and 0 <= c["exposed_s"] <= c["end_s"] - c["start_s"] + 1e-9
                       for c in colls)
            assert max(c["end_s"] for c in colls) <= d["step_s"] + 1e-4
            # the numbers are the step records': exposed seconds sum to the rank-step's exposed comm, all
            # of it waited for after backward's end (DDP's tail)
            mine = sum(c["exposed_s"] for c in colls)
            want = float(exposed[steps.tolist().index(step), rank])
            assert abs(mine - want) <= 1e-6 + 1e-4 * want, (step, rank, mine, want)
            assert d["comm_exposed_s"] == want
            assert abs(d["tail_s"] - mine) <= 1e-6 + 1e-4 * mine, (d["tail_s"], mine)
            assert d["overlap_ratio"] is not None and 0 <= d["overlap_ratio"] <= 1
    assert many >= STEPS - 1  # several buckets per step once DDP rebuilt them
