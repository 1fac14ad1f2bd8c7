"""Memory explained per module, end to end: an unmodified 2-rank DDP training script under
``fleetscope run -- torchrun`` (gloo, CPU) whose model has hand-countable saved activations (fp32
Linear/ReLU blocks of known shapes, two of four blocks under non-reentrant ``torch.utils.checkpoint``).
``GET /api/v1/runs/{id}/memory`` lists the modules by their names in the model with the bytes counted by
hand, and advises checkpointing the un-checkpointed blocks to reach a target below the peak, and
un-checkpointing the checkpointed ones when the target leaves room."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
B, DIN, H, DOUT, STEPS = 32, 64, 128, 8, 5
F = 4  # fp32

SCRIPT = f"""
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear({H}, {H}), torch.nn.ReLU(), torch.nn.Linear({H}, {H})

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear({DIN}, {H})
        self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
        self.out = torch.nn.Linear({H}, {DOUT})

    def forward(self, x):
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i < 2 else b(x)
        return self.out(x)


model = DDP(Net())
opt = torch.optim.Adam(model.parameters())
for step in range({STEPS}):
    loss = model(torch.randn({B}, {DIN})).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


def _memory(c: Any, rid: int, **kw: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        m: dict[str, Any] = c.memory(rid, **kw)
        if len(m["ranks"]) == 2 or time.monotonic() > deadline:
            return m
        time.sleep(0.3)


def test_memory_per_module_and_checkpoint_advice_of_a_zero_code_job(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", "mem-job", "--family", "mem", "--", TORCHRUN, "--standalone",
                          "--nproc-per-node", "2", "train.py"], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    live_server.compact()
    with live_server.client() as c:
        (run,) = c.run_list(name="mem-job")
        m = _memory(c, run["id"])
        assert len(m["ranks"]) == 2, m["ranks"]
        mods = {x["name"]: x for x in m["modules"]}
        bhf = B * H * F
        # names as the model gives them (DDP's "module." stripped), bytes as counted by hand
        assert mods["inp"]["activation_bytes"] == B * DIN * F  # the batch, saved by the first matmul
        for k in (0, 1):  # checkpointed: their input is all they keep; the ReLU output is what they drop
            assert mods[f"blocks.{k}"]["checkpointed"] is True
            assert mods[f"blocks.{k}"]["activation_bytes"] == bhf
            assert mods[f"blocks.{k}.act"]["ckpt_saved_bytes"] == bhf
        for k in (2, 3):  # fc1's input and the ReLU's output (fc2's input: the same storage, counted once)
            assert mods[f"blocks.{k}"]["checkpointed"] is False
            assert mods[f"blocks.{k}.fc1"]["activation_bytes"] == bhf and mods[f"blocks.{k}.act"]["activation_bytes"] == bhf
            assert mods[f"blocks.{k}.fc2"]["activation_bytes"] == 0
            assert mods[f"blocks.{k}"]["flops"] == 2 * (2 * B * H * H)
        assert mods["out"]["activation_bytes"] == bhf
        lin_h = (H * H + H) * F
        assert mods["blocks.2.fc1"]["param_bytes"] == lin_h == mods["blocks.2.fc1"]["grad_bytes"]
        assert mods["blocks.2.fc1"]["optim_bytes"] == 2 * lin_h + 2 * F  # Adam's two moments and steps
        n_params = DIN * H + H + 8 * (H * H + H) + H * DOUT + DOUT
        for r in m["ranks"]:  # DDP: every rank holds everything; totals within 1 % of the hand count
            assert r["activation_bytes"] == pytest.approx(B * F * (DIN + 7 * H), rel=0.01)
            assert r["param_bytes"] == pytest.approx(n_params * F, rel=0.01)
            assert r["optim_bytes"] == pytest.approx(2 * n_params * F, rel=0.01)
        assert m["module_imbalance"]["activation_bytes"] == pytest.approx(1.0)
        bd = m["breakdown"]
        assert bd["temporaries_estimated"] is True and bd["peak_bytes"] > 0
        assert bd["activations_bytes"] == pytest.approx(B * F * (DIN + 7 * H), rel=0.01)
        peak = bd["peak_bytes"]

        # a target 1.5 blocks' activations under the peak: checkpoint blocks 2 and 3 (each frees one
        # B×H activation: the block keeps its input), priced at their forward FLOPs
        adv = c.memory(run["id"], target_bytes=int(peak - 1.5 * bhf))
        (a,) = adv["checkpoint_advice"]
        assert a["action"] == "checkpoint" and a["modules"] == ["blocks.2", "blocks.3"]
        assert a["saves_bytes"] == 2 * bhf and a["recompute_flops"] == 2 * 2 * (2 * B * H * H)
        assert a["step_s_cost"] is not None and a["step_s_cost"] > 0
        assert a["step_s_cost"] == pytest.approx(a["recompute_flops"] / adv["achieved_flops_per_s"])
        # room under the target: un-checkpoint the checkpointed blocks, adding what they drop
        rev = c.memory(run["id"], target_bytes=int(peak + 10 * bhf))
        (u,) = rev["checkpoint_advice"]
        assert u["action"] == "uncheckpoint" and u["modules"] == ["blocks.0", "blocks.1"]
        assert u["saves_bytes"] == -2 * bhf and u["step_s_cost"] < 0
        assert u["label"].startswith("un-checkpoint blocks.0–1: +")
