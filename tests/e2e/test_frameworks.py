"""Framework training loops run unmodified under ``fleetscope run`` (torchrun, 2 gloo ranks on CPU,
tiny models, a real server): PyTorch Lightning (automatic optimization with and without gradient
accumulation, manual optimization) and the Hugging Face ``Trainer``.

What is checked, with the numbers the jobs themselves produce:

* exact step boundaries: one rank-step per optimizer step and rank, no merged first steps, no
  phantom step after the last optimizer step (``last_step + 1 == steps``);
* FLOPs per rank-step equal to the hand-counted FLOPs of every micro-batch of the step (Lightning
  runs the last micro-batch's forward and backward inside ``optimizer.step(closure)``);
* the optimizer phase times the optimizer's own update: compared with the job's own timing of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 4

LIGHTNING_SCRIPT = '''
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
import lightning as L  # noqa: E402

OUT, K, STEPS, MODE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
B, D, H, O = 8, 16, 256, 8


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, H),
                                       torch.nn.ReLU(), torch.nn.Linear(H, O))
        self.opt_s = []  # the optimizer's own update, timed by the job
        self.automatic_optimization = MODE != "manual"

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        t = time.perf_counter()
        opt.step()
        self.opt_s.append(time.perf_counter() - t)
        opt.zero_grad()
        return None

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        # Lightning's own implementation (optimizer.step(closure=...)), timing the update alone:
        # from the closure's return (forward and backward done) to the end of step()
        t = [0.0]

        def closure():
            out = optimizer_closure()
            t[0] = time.perf_counter()
            return out

        optimizer.step(closure=closure)
        self.opt_s.append(time.perf_counter() - t[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
n = 2 * STEPS * K * B  # one epoch: STEPS optimizer steps on each of the 2 ranks
data = torch.utils.data.TensorDataset(torch.randn(n, D), torch.randn(n, O))
model = Net()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, max_steps=STEPS,
                    accumulate_grad_batches=K, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=B))
rank = trainer.global_rank
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
    json.dump({"opt_s": model.opt_s, "global_step": trainer.global_step}, f)
sys.stdout.write(f"rank {rank} done\\n")
'''
L_B, L_D, L_H, L_O = 8, 16, 256, 8
# per micro-batch: forward 2·B·(D·H + H·H + H·O); backward twice that, less the first layer's input
# gradient (the batch needs none)
L_FLOPS = 6 * L_B * (L_D * L_H + L_H * L_H + L_H * L_O) - 2 * L_B * L_D * L_H

HF_SCRIPT = '''
import os
import sys

import torch

torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

OUT, K, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
B, T = 4, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 64, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=T, bos_token_id=0, eos_token_id=0)
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=B, gradient_accumulation_steps=K,
                         max_steps=STEPS, learning_rate=1e-3, save_strategy="no", report_to=[],
                         use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
                         logging_steps=1, seed=0)
trainer = Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(2 * STEPS * K * B))
trainer.train()
sys.stdout.write(f"rank {os.environ['RANK']} done\\n")
'''
H_B, H_T, H_D, H_V, H_L = 4, 16, 32, 64, 2
# per micro-batch, forward: per layer the qkv, output and MLP matmuls (2·BT·(3d² + d² + 8d²)) and
# attention (QKᵀ and AV: 4·B·T²·d); the LM head 2·BT·d·V. Backward: twice the forward.
H_FLOPS = 3 * (H_L * (24 * H_B * H_T * H_D**2 + 4 * H_B * H_T**2 * H_D) + 2 * H_B * H_T * H_D * H_V)


def _fs_run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", **env}
    full.pop("FLEETSCOPE_RUN_NAME", None)
    return subprocess.run([*FS_RUN, *args], capture_output=True, text=True, timeout=timeout, env=full, cwd=cwd)


def _job(live_server: Any, tmp_path: Path, name: str, script: str, *argv: str) -> dict[str, Any]:
    """Run ``script`` under ``fleetscope run -- torchrun`` (2 ranks); return its run once every
    rank-step it sent is compacted."""
    (tmp_path / "train.py").write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    env = {"FLEETSCOPE_SERVER": live_server.url, "FLEETSCOPE_TOKEN": live_server.token,
           "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    res = _fs_run(["--name", name, "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", "train.py",
                   str(out), *argv], env, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert {"rank 0 done", "rank 1 done"} <= set(res.stdout.split("\n")), res.stdout[-3000:]
    assert "internal error" not in res.stderr, res.stderr[-5000:]
    deadline = time.monotonic() + 30
    while True:
        live_server.compact()
        runs = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": name}, timeout=10).json()["runs"]
        if runs and runs[0]["status"] == "finished" and runs[0]["rank_steps"] >= 2 * STEPS:
            break
        assert time.monotonic() < deadline, runs
        time.sleep(0.3)
    time.sleep(1.2)  # past the compaction grace: a phantom step or a late rank-step lands now
    live_server.compact()
    runs = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": name}, timeout=10).json()["runs"]
    assert len(runs) == 1
    return dict(runs[0])


def _matrix(engine: Any, run_id: int, field: str) -> np.ndarray:
    from fleetscope.server.store.steps import rank_step_matrix

    steps, _, m = rank_step_matrix(engine, run_id, field)
    assert list(steps) == list(range(STEPS)), steps
    return m


def _check_steps(run: dict[str, Any], engine: Any) -> dict[str, np.ndarray]:
    """Exactly STEPS steps of both ranks, none after the last; the decomposition adds up."""
    assert run["rank_steps"] == 2 * STEPS, run  # one per optimizer step and rank: none merged
    assert run["steps"] == STEPS and run["last_step"] == STEPS - 1, run  # no phantom step after the last
    assert run["world_size"] == 2
    cols = {f: _matrix(engine, run["id"], f) for f in
            ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "compute_s", "comm_exposed_s",
             "other_s", "flops")}
    assert cols["step_s"].shape == (STEPS, 2) and not np.isnan(cols["step_s"]).any()
    parts = np.nan_to_num(cols["data_s"]) + cols["compute_s"] + cols["comm_exposed_s"] + cols["other_s"]
    np.testing.assert_allclose(parts, cols["step_s"], rtol=1e-5, atol=1e-6)
    with engine.connect() as c:
        from sqlalchemy import text

        n_ranks = c.execute(text("SELECT step, n_ranks FROM steps WHERE run_id = :id ORDER BY step"),
                            {"id": run["id"]}).fetchall()
    assert [tuple(r) for r in n_ranks] == [(s, 2) for s in range(STEPS)]  # no step without ranks
    return cols


def _own_optimizer_s(out: Path) -> list[float]:
    """Per rank, the median of the job's own timing of the optimizer's update."""
    meds = []
    for rank in (0, 1):
        d = json.loads((out / f"rank{rank}.json").read_text())
        assert d["global_step"] == STEPS and len(d["opt_s"]) == STEPS
        meds.append(float(np.median(d["opt_s"])))
    return meds


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_ddp_automatic_optimization(live_server: Any, engine: Any, tmp_path: Path, accumulate: int) -> None:
    """``Trainer(strategy="ddp", accumulate_grad_batches=k)``: the last micro-batch runs inside
    ``optimizer.step(closure)``: its FLOPs count, the optimizer phase is the update alone, and the
    first step (which starts the run inside that closure) is not merged with the second."""
    run = _job(live_server, tmp_path, f"lightning-k{accumulate}", LIGHTNING_SCRIPT, str(accumulate), str(STEPS), "auto")
    cols = _check_steps(run, engine)
    np.testing.assert_allclose(cols["flops"], accumulate * L_FLOPS, rtol=1e-6)  # every micro-batch
    for f in ("forward_s", "backward_s", "optimizer_s"):
        assert (cols[f] > 0).all(), f
    own = _own_optimizer_s(tmp_path / "out")
    for rank in (0, 1):
        # the update itself (AdamW) is the optimizer phase, not the ~µs of step()'s entry
        assert np.median(cols["optimizer_s"][:, rank]) >= 0.5 * own[rank], (cols["optimizer_s"], own)


def test_lightning_manual_optimization(live_server: Any, engine: Any, tmp_path: Path) -> None:
    """``automatic_optimization = False``: the user's ``opt.step()`` (Lightning passes a do-nothing
    closure) ends each step and its update is the optimizer phase; ``manual_backward``, inside the
    top-level forward, is still ``backward``."""
    run = _job(live_server, tmp_path, "lightning-manual", LIGHTNING_SCRIPT, "1", str(STEPS), "manual")
    cols = _check_steps(run, engine)
    np.testing.assert_allclose(cols["flops"], L_FLOPS, rtol=1e-6)
    for f in ("forward_s", "backward_s", "optimizer_s"):
        assert (cols[f] > 0).all(), f
    own = _own_optimizer_s(tmp_path / "out")
    for rank in (0, 1):
        assert np.median(cols["optimizer_s"][:, rank]) >= 0.5 * own[rank], (cols["optimizer_s"], own)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hf_trainer(live_server: Any, engine: Any, tmp_path: Path, accumulate: int) -> None:
    """HF ``Trainer`` (a 2-layer GPT-2 built from its config): one step per optimizer step, the
    end-of-training gathers open no step of their own, FLOPs of every micro-batch."""
    run = _job(live_server, tmp_path, f"hf-k{accumulate}", HF_SCRIPT, str(accumulate), str(STEPS))
    cols = _check_steps(run, engine)
    np.testing.assert_allclose(cols["flops"], accumulate * H_FLOPS, rtol=1e-6)
    for f in ("forward_s", "backward_s", "optimizer_s"):
        assert (cols[f] > 0).all(), f
    with engine.connect() as c:
        from sqlalchemy import text

        after = c.execute(text("SELECT rank, step, data FROM run_events WHERE run_id = :id "
                               "AND kind = 'collectives_after_last_step' ORDER BY rank"), {"id": run["id"]}).fetchall()
    # HF's end-of-training calls are reported, attached to the last step, by both ranks
    assert [(r[0], r[1]) for r in after] == [(0, STEPS - 1), (1, STEPS - 1)], after
    assert all(r[2]["calls"] >= 1 for r in after)


# A torchtitan-style loop: FSDP2 (fully_shard) over a 1-D DeviceMesh built before the training starts,
# the model made on the meta device then materialised, micro-batch accumulation inside a train_step
# function, gradient clipping (a DTensor norm: one all_reduce), an optimizer container around AdamW
# and an LR scheduler. The job times its own optimizer update.
T_D, T_LAYERS, T_B, T_MICRO = 64, 3, 8, 2
# per micro-batch: forward 2·B·D² per layer; backward the weight gradient of every layer and the
# input gradient of all but the first (its input needs none)
T_FLOPS = T_MICRO * 2 * T_B * T_D * T_D * (T_LAYERS + T_LAYERS + T_LAYERS - 1)
TITAN_SCRIPT = f"""
import json
import sys
import time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)
out, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear({T_D}, {T_D}, bias=False) for _ in range({T_LAYERS})])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)


class OptimizersContainer:
    def __init__(self, params):
        self.opts = [torch.optim.AdamW(params, lr=1e-3)]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


opts = OptimizersContainer(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opts.opts[0], lambda s: 1.0)
opt_s = []


def train_step(batches):
    for x in batches:
        loss = model(x).pow(2).mean() / len(batches)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t0 = time.perf_counter()
    opts.step()
    opt_s.append(time.perf_counter() - t0)
    sched.step()
    opts.zero_grad()


g = torch.Generator().manual_seed(rank)
for step in range(steps):
    train_step([torch.randn({T_B}, {T_D}, generator=g) for _ in range({T_MICRO})])
with open(f"{{out}}/rank{{rank}}.json", "w") as f:
    json.dump({{"global_step": steps, "opt_s": opt_s}}, f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""


def test_torchtitan_style_loop(live_server: Any, engine: Any, tmp_path: Path) -> None:
    """A torchtitan-style FSDP2 loop, unmodified under ``fleetscope run``: one step per optimizer step
    (none merged, lost or phantom), every micro-batch's FLOPs counted exactly on each rank, AdamW's
    update in the optimizer phase, and FSDP2's traffic per rank-step: an all-gather per layer in each
    forward and again in each backward, a reduce-scatter per layer and micro-batch."""
    run = _job(live_server, tmp_path, "titan-style", TITAN_SCRIPT, str(STEPS))
    cols = _check_steps(run, engine)
    np.testing.assert_allclose(cols["flops"], T_FLOPS, rtol=1e-6)
    for f in ("forward_s", "backward_s", "optimizer_s"):
        assert (cols[f] > 0).all(), f
    own = _own_optimizer_s(tmp_path / "out")
    for rank in (0, 1):
        assert np.median(cols["optimizer_s"][:, rank]) >= 0.5 * own[rank], (cols["optimizer_s"], own)
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/collectives", timeout=10).json()["collectives"]
    by_op: dict[str, list[float]] = {}
    for c in colls:
        acc = by_op.setdefault(c["op"], [0, 0.0])
        acc[0] += c["calls"]
        acc[1] += c["bytes"]
    rank_steps = 2 * STEPS
    layer_bytes = T_D * T_D * 4  # a layer's whole weight, gathered (all_gather: the output) or reduced
    assert by_op["all_gather"] == [rank_steps * 2 * T_MICRO * T_LAYERS, rank_steps * 2 * T_MICRO * T_LAYERS * layer_bytes]
    assert by_op["reduce_scatter"] == [rank_steps * T_MICRO * T_LAYERS, rank_steps * T_MICRO * T_LAYERS * layer_bytes]
