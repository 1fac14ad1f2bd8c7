"""A 2-D mesh job (FSDP2 over ``dp`` × tensor parallel over ``tp``, a tiny MLP) run unmodified
through ``fleetscope run`` under torchrun (4 ranks, gloo on CPU): every rank-step once, every
collective byte attributed to its mesh dimension with the bytes the parallel plan implies, no
communication time charged to compute, and each rank's FLOPs its local (TP-sharded) work, not the
global op's."""

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
D, H, B, STEPS = 16, 32, 4, 4

MESH_SCRIPT = f"""
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear({D}, {H}, bias=False)
        self.down = torch.nn.Linear({H}, {D}, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


model = MLP()
parallelize_module(model, mesh["tp"], {{"up": ColwiseParallel(), "down": RowwiseParallel()}})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    loss = model(torch.randn({B}, {D})).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""


def test_two_d_mesh_comm_is_split_by_dimension(live_server: Any, engine: Any, tmp_path: Path) -> None:
    from fleetscope.server.store.steps import rank_step_matrix

    (tmp_path / "train.py").write_text(MESH_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"),
           "PYTHONWARNINGS": "ignore",
           "FLEETSCOPE_PEAK_FLOPS": "1000"}  # far below what the ranks did: MFU > 1, flagged
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", "mesh2d", "--", TORCHRUN, "--standalone", "--nproc-per-node", "4",
                          "train.py"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "internal error" not in res.stderr, res.stderr[-3000:]

    url = live_server.url
    run = httpx.get(f"{url}/api/v1/runs", params={"name": "mesh2d"}, timeout=10).json()["runs"][0]
    rid = run["id"]
    live_server.compact()
    summary = httpx.get(f"{url}/api/v1/runs/{rid}/summary", timeout=10).json()
    assert summary["rank_steps"] == 4 * STEPS, summary
    colls = httpx.get(f"{url}/api/v1/runs/{rid}/collectives", timeout=10).json()["collectives"]

    # every rank-step once
    steps, ranks, step_s = rank_step_matrix(engine, rid, "step_s")
    assert step_s.shape == (STEPS, 4) and not np.isnan(step_s).any()

    # FLOPs: each rank's local work. Forward: up [B, D] x [D, H/2] and down [B, H/2] x [H/2, D] (the
    # TP-local shards); backward: down's grad input and weight, up's weight (the input needs no grad).
    # A DTensor op counted at its global shapes would give twice this on every rank.
    local_mm = 2 * B * D * (H // 2)
    local_flops = 5 * local_mm
    _, _, flops = rank_step_matrix(engine, rid, "flops")
    assert flops.shape == (STEPS, 4) and (flops == local_flops).all(), flops
    assert summary["flops_per_rank_step"] == {"model": local_flops, "hardware": local_flops, "source": "measured"}
    meta = summary["run"]["meta"]
    assert meta["dtype"] == "fp32" and meta["dtype_source"] == "parameters"  # the model's, not a default
    assert summary["run"]["peak_flops"] == 1000 and meta["peak_flops_source"] == "env"
    # 10 kFLOP per step in well under 10 s against a 1 kFLOP/s peak: impossible, so flagged, not shown
    assert summary["mfu"] is None and summary["hfu"] is None
    assert summary["mfu_flag"].startswith("implausible: MFU") and summary["hfu_flag"].startswith("implausible: HFU")

    # the plan's bytes per rank and step (fp32): TP (size 2) all-reduces the row-parallel output
    # [B, D] in forward; FSDP (size 2) all-gathers the TP-local weights (up: H/2 x D, down: D x H/2)
    # before forward and reduce-scatters their gradients after backward
    tp_bytes = B * D * 4
    local_params = 2 * (H // 2) * D * 4
    want = {("tp", "all_reduce"): tp_bytes, ("dp", "all_gather"): local_params, ("dp", "reduce_scatter"): local_params}
    got: dict[tuple[str, str], float] = {}
    for c in colls:
        got[(c["dim"], c["op"])] = got.get((c["dim"], c["op"]), 0.0) + c["bytes"]
    assert {d for d, _ in got} <= {"dp", "tp", "world"}, got  # every collective byte in a named dimension
    for key, per_step in want.items():
        assert got.get(key) == per_step * STEPS * 4, (key, got)
    # the barrier after the loop (default group) is no step's: reported after the last step (agent/run.py)
    assert ("world", "barrier") not in got, got
    with engine.connect() as c:
        from sqlalchemy import text

        after = c.execute(text("SELECT data FROM run_events WHERE run_id = :id "
                               "AND kind = 'collectives_after_last_step'"), {"id": rid}).fetchall()
    assert len(after) == 4 and all(r[0]["ops"].get("barrier") == 1 for r in after), after

    by_dim = summary["comm_by_dim"]
    assert set(by_dim) == {"dp", "tp"}, by_dim
    assert by_dim["dp"]["bytes"] == 2 * local_params and by_dim["dp"]["calls"] == 2
    assert by_dim["tp"]["bytes"] == tp_bytes and by_dim["tp"]["calls"] == 1
    for v in by_dim.values():
        assert 0 < v["exposed_s"] <= v["total_s"] + 1e-9 and v["nodes"] == 1
    findings = {f["dim"]: f["finding"] for f in summary["parallel_findings"]}
    assert any(w in findings.get("dp", "") + findings.get("tp", "") for w in ("exposes",)), summary["parallel_findings"]

    # no communication charged to compute: each rank-step's exposed comm is the exposed time of its
    # own collective records (the waits moved out of compute), and the parts still sum to the step
    from fleetscope.server.store.steps import recent_comm_blocks

    for _step, sb, cb in recent_comm_blocks(engine, rid, STEPS):
        assert cb is not None
        for r, exp in zip(sb["rank"], sb["comm_exposed_s"], strict=True):
            mine = float(np.nan_to_num(cb["exposed_s"][cb["rank"] == r]).sum())
            assert mine > 0 and abs(mine - exp) <= 1e-4 + 1e-3 * exp, (r, mine, exp)
        parts = np.nan_to_num(sb["data_s"]) + sb["compute_s"] + sb["comm_exposed_s"] + sb["other_s"]
        np.testing.assert_allclose(parts, sb["step_s"], rtol=1e-4, atol=1e-5)
