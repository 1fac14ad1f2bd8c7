"""Training-thread cost per step of the zero-code mode (``fleetscope run``) vs manual mode (issue #11).

    python bench/zerocode_overhead.py [--rounds 5] [--steps 3000]

Each mode runs the same tiny CPU training step (Linear(1,1), SGD, ``torch.set_num_threads(1)``) in its
own process, rounds alternating between modes, the agent's transport offline (spooling to a temp dir):

* ``plain``: no agent;
* ``manual``: ``with run.step(): with run.phase("forward") ...; with run.phase("optimizer") ...``;
* ``zerocode``: unmodified loop; ``FLEETSCOPE_AUTO=1`` and ``fleetscope.agent.auto.activate()`` as the
  launcher's sitecustomize does (global optimizer hooks, forward hooks on the top-level module).

Cost = median step time minus plain's median in the same round. Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
mode, steps = sys.argv[1], int(sys.argv[2])
if mode == "zerocode":
    os.environ["FLEETSCOPE_AUTO"] = "1"
    from fleetscope.agent import auto
    auto.activate()
import torch
torch.set_num_threads(1)
model = torch.nn.Linear(1, 1, bias=False)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
x = torch.ones(1, 1)
run = None
if mode == "manual":
    import fleetscope.agent as fs
    run = fs.init(name="bench-manual", collectives=False)
pc = time.perf_counter_ns
out = []
for i in range(steps + 200):
    t0 = pc()
    if run is not None:
        with run.step():
            with run.phase("forward"):
                y = model(x)
            with run.phase("optimizer"):
                opt.step()
    else:
        y = model(x)
        opt.step()
    if i >= 200:  # warm-up (the zero-code start, first allocations)
        out.append(pc() - t0)
out.sort()
import fleetscope.agent as fsa
r = fsa.get_run()
if mode != "plain":  # the mode really instrumented this loop: a run, with its steps counted
    assert r is not None and type(r).__name__ == "Run", f"{mode}: no active run"
print(json.dumps({"median_ns": out[len(out) // 2], "p99_ns": out[int(0.99 * len(out))],
                  "run": getattr(r, "name", None) if r is not None else None}))
os._exit(0)  # skip the agent's exit flush: it is not training-thread cost
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fs-zc-")
    atexit.register(shutil.rmtree, tmp, True)  # the spool goes with the run
    env = {**os.environ, "FLEETSCOPE_OFFLINE": "1", "FLEETSCOPE_SPOOL_DIR": os.path.join(tmp, "spool"),
           "FLEETSCOPE_RUN_NAME": "bench-zerocode", "OMP_NUM_THREADS": "1"}
    res: dict[str, list[tuple[float, float]]] = {"plain": [], "manual": [], "zerocode": []}
    for _ in range(args.rounds):
        for mode in res:
            r = subprocess.run([sys.executable, "-c", _CHILD, mode, str(args.steps)], capture_output=True, text=True,
                               env=env, timeout=600)
            if r.returncode != 0:
                raise SystemExit(f"{mode} failed: {r.stderr[-2000:]}")
            d = json.loads(r.stdout.strip().splitlines()[-1])
            res[mode].append((d["median_ns"] / 1e3, d["p99_ns"] / 1e3))
    plain = [m for m, _ in res["plain"]]
    manual = [m - p for (m, _), p in zip(res["manual"], plain, strict=True)]
    zero = [z - p for (z, _), p in zip(res["zerocode"], plain, strict=True)]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"plain_step_median: {statistics.median(plain):.2f} µs")
    print(f"manual_added_per_step: {statistics.median(manual):.2f} µs (median over {args.rounds} rounds)")
    print(f"zerocode_added_per_step: {statistics.median(zero):.2f} µs")
    ratio = statistics.median(zero) / statistics.median(manual) if statistics.median(manual) > 0 else float("nan")
    print(f"zerocode_vs_manual: {ratio:.2f} x (target ≤ 1.5)")


if __name__ == "__main__":
    main()
