"""What reading torch's Flight Recorder and measuring a compiled model's FLOPs cost (docs/benchmarks.md,
"Flight Recorder and compiled FLOPs").

1. **Reading the recorder** (the agent's sender thread, every 2 s at most): ``_dump_fr_trace`` without
   stack traces + parsing, for a ring buffer holding 100 and 2,000 entries (the agent's default size).
2. **The recorder on the training thread**: one 4 KiB gloo ``all_reduce`` (1 rank) with the buffer on
   (2,000 entries) against off, in two processes of the same run, interleaved by rounds.
3. **A compiled model's FLOPs** (once per run): ``mfu.measure_uncompiled`` — one forward and backward
   of the eager module on fake tensors — next to one real eager training step of the same model.

    python bench/flight_recorder.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
os.environ["TORCH_FR_BUFFER_SIZE"] = sys.argv[2]
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
from fleetscope.agent import flight_recorder as fr
x = torch.ones(1024)
out = {}
for _ in range(200):
    dist.all_reduce(x)
per_call = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter_ns()
    for _ in range(500):
        dist.all_reduce(x)
    per_call.append((time.perf_counter_ns() - t0) / 500 / 1e3)
out["all_reduce_us"] = per_call
if sys.argv[2] != "0":
    reads = {}
    for fill in (100, 2000):
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        # a fresh group does not clear the process's ring buffer: it holds the newest entries
        for _ in range(fill):
            dist.all_reduce(x)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            entries = fr.parse(fr.dump())
            ts.append(time.perf_counter() - t0)
        ts.sort()
        reads[str(fill)] = {"entries": len(entries), "ms": 1e3 * ts[len(ts) // 2]}
    out["read"] = reads
dist.destroy_process_group()
print(json.dumps(out))
"""

FLOPS = r"""
import json, time
import torch
from fleetscope.agent.mfu import measure_uncompiled
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(8, 128, 256)
step, meas = [], []
for _ in range(5):
    t0 = time.perf_counter(); model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad(); step.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); got = measure_uncompiled(torch.compile(model, backend="eager"), (x,), {}); meas.append(time.perf_counter() - t0)
print(json.dumps({"step_s": sorted(step)[2], "measure_s": sorted(meas)[2], "flops": got[0] if not isinstance(got, str) else got}))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as d:
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                             env=env, cwd=d)
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    on: list[float] = []
    off: list[float] = []
    reads = None
    for _ in range(args.rounds):
        a = _child(CHILD, str(_port()), "2000", "3")
        b = _child(CHILD, str(_port()), "0", "3")
        on += a["all_reduce_us"]
        off += b["all_reduce_us"]
        reads = a.get("read")
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"gloo all_reduce 4 KiB, 1 rank: recorder on {m_on:.2f} us, off {m_off:.2f} us, "
          f"added {m_on - m_off:+.2f} us per collective ({m_on / m_off:.3f}x)")
    for fill, r in (reads or {}).items():
        print(f"read + parse, buffer of {fill} collectives ({r['entries']} entries): {r['ms']:.2f} ms per read "
              f"(sender thread, at most every 2 s: {r['ms'] / 2000 * 100:.3f} % of one core)")
    f = _child(FLOPS)
    print(f"compiled model FLOPs (4 encoder layers, d=256, 8x128 tokens): measure_uncompiled {f['measure_s'] * 1e3:.0f} ms "
          f"once per run vs an eager training step {f['step_s'] * 1e3:.0f} ms ({f['measure_s'] / f['step_s']:.2f} steps); "
          f"{f['flops']:.3g} FLOPs")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"took {time.time() - t0:.0f} s")
