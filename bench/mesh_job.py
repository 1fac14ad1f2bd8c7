"""Job slowdown of the zero-code launcher on the 2-D mesh job (issue #11): the same unmodified
4-rank FSDP2 (``dp``) × tensor-parallel (``tp``) script, plain ``torchrun`` vs
``fleetscope run -- torchrun`` (agent offline, spooling to a temp dir).

    python bench/mesh_job.py [--pairs 4] [--steps 200] [--warmup 20] [--dim 256]

Pairs alternate the order (plain/launcher, launcher/plain, ...) so the machine's drift falls on
both. Rank 0 times each loop iteration itself (``perf_counter``), first ``--warmup`` steps dropped
(process groups, FSDP's lazy init, the agent's start). Figure: per pair the ratio of medians
(launcher / plain) of per-step time, then the median over pairs, with the spread. Also checks the
launcher really instrumented the job (its spool holds the run's batches).
Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
import json, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

steps, dim, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


model = torch.nn.Sequential(Block(), Block())
for b in model:
    parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(b, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
times = []
for step in range(steps):
    t0 = time.perf_counter()
    loss = model(torch.randn(16, dim)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(times, f)
dist.barrier()
dist.destroy_process_group()
"""


def _run(tmp: Path, launcher: bool, steps: int, dim: int, tag: str) -> list[float]:
    out = tmp / f"{tag}.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", str(tmp / "train.py"), str(steps), str(dim), str(out)]
    if launcher:
        cmd = [sys.executable, "-m", "fleetscope.cli", "run", "--name", f"bench-mesh-{tag}", "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "FLEETSCOPE_SPOOL_DIR": str(tmp / f"spool-{tag}")}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=tmp)
    if p.returncode != 0:
        raise SystemExit(f"{tag} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    if launcher and not any((tmp / f"spool-{tag}").glob("*")):
        raise SystemExit(f"{tag}: the launcher spooled nothing: the job was not instrumented")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fs-mesh-"))
    try:
        (tmp / "train.py").write_text(SCRIPT)
        ratios, plain_ms, fs_ms = [], [], []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            med = {}
            for launcher in order:
                t = _run(tmp, launcher, args.steps, args.dim, f"{i}-{'fs' if launcher else 'plain'}")[args.warmup:]
                med[launcher] = statistics.median(t)
            ratios.append(med[True] / med[False])
            plain_ms.append(med[False] * 1e3)
            fs_ms.append(med[True] * 1e3)
            print(f"pair {i}: plain {med[False] * 1e3:.2f} ms  launcher {med[True] * 1e3:.2f} ms  ratio {ratios[-1]:.3f}",
                  flush=True)
        print(f"load: {os.getloadavg()}")
        print(f"mesh_job_step_plain_ms: {statistics.median(plain_ms):.2f} ms")
        print(f"mesh_job_step_launcher_ms: {statistics.median(fs_ms):.2f} ms")
        print(f"mesh_job_slowdown_ratio: {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
