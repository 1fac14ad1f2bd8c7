"""A real 2-rank DDP job (torchrun + gloo on CPU, unmodified, through ``fleetscope run``) whose steady steps
wait for a slow data loader and whose first two steps spend 0.6 s more each in the model (warm-up): the
summary's basis sets those two steps apart, and its diagnosis, shares and goodput describe the steady
state — data first — where sums over every step would have put compute first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, WARM_S, LOADER_S = 10, 0.6, 0.06

SCRIPT = f"""
import sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 2:
            time.sleep({WARM_S})  # warm-up inside the model: allocations, autotuning, a lazy init
        return self.body(x)


model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    time.sleep({LOADER_S})  # the data loader: the steady bottleneck
    x = torch.randn(8, 32)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""


def _shares(rows: list[dict[str, Any]]) -> dict[str, float]:
    sums = {k: sum(r[f"{k}_s"] or 0.0 for r in rows) for k in ("data", "compute", "comm_exposed", "other")}
    total = sum(sums.values())
    return {k: v / total for k, v in sums.items()}


def test_warm_up_steps_are_set_apart_and_the_diagnosis_is_the_steady_state(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", "steady-e2e", "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                          "train.py"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    h = httpx.Client(base_url=live_server.url, timeout=30, headers={"Authorization": f"Bearer {live_server.token}"})
    rid = h.get("/api/v1/runs", params={"name": "steady-e2e"}).json()["runs"][0]["id"]
    live_server.compact()
    rows = h.get(f"/api/v1/runs/{rid}/steps", params={"limit": 1000}).json()["steps"]
    s = h.get(f"/api/v1/runs/{rid}/summary").json()
    h.close()
    assert len(rows) >= STEPS - 1, len(rows)

    # the basis names the two warm-up steps (the first ones recorded) and their time
    b = s["basis"]
    first_two = [r["step"] for r in rows[:2]]
    warm = {x["reason"]: x for x in b["set_apart"]}
    assert set(warm) == {"warm-up"}, b
    assert warm["warm-up"]["steps"][:2] == first_two and warm["warm-up"]["n"] <= 3, b
    assert warm["warm-up"]["seconds"] >= 2 * WARM_S
    assert b["of"] == len(rows) and b["steps"] == len(rows) - warm["warm-up"]["n"]

    # over every step, the two warm-up seconds make compute look like the bottleneck ...
    everything = _shares(rows)
    assert everything["compute"] > everything["data"], everything
    # ... on the steady steps the loader is: the diagnosis' first cause and its shares are those steps'
    kept = [r for r in rows if r["step"] not in set(warm["warm-up"]["steps"])]
    steady = _shares(kept)
    d = s["diagnosis"]
    assert d is not None and d["ranked_causes"][0] == "data", d["ranked_causes"]
    parts = {p["cause"]: p["share"] for p in d["parts"]}
    assert abs(parts["data"] - steady["data"]) < 0.05, (parts, steady)
    assert abs(parts.get("compute", 0.0) - steady["compute"]) < 0.05, (parts, steady)
    assert s["bottlenecks"][0]["component"] == "data"
    # KPIs on the same steps: the median step is a loader-bound step, not a warm-up one
    assert LOADER_S <= s["step_s_p50"] < 0.5 and s["decomposition"]["data_s"] >= 0.8 * LOADER_S
    # and the set-apart time is lost time in goodput, not dropped
    assert s["goodput"]["lost"]["warmup_outlier_steps"] >= 1.5 * WARM_S
