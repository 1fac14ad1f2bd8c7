"""Agent job slowdown: the 4-rank CPU demo job with the agent on vs ``FLEETSCOPE_DISABLED=1``.

    python bench/agent_job.py [--pairs 3] [--steps 300] [--warmup 20] [--mode concurrent|alternate]
                              [--transport offline|server]

The job: ``torchrun --nproc-per-node 4 -m fleetscope.demo_train --run-name X --steps N
--timing-out F`` (gloo, DDP, ``run.instrument`` on model, optimizer and loader). The agent is on as
a user runs it: offline spool in a temp dir, or (``--transport server``) a live
``fleetscope serve --insecure-no-auth`` on a temp data dir, which then competes for the same cores.
The per-step time is measured by the script itself on rank 0 (``time.perf_counter`` around each
loop iteration; the first ``--warmup`` steps dropped: process group and DDP set-up, and the agent's
one FLOP-counting step), with rank 0's CPU time per step (``time.process_time``: all its threads,
the agent's sender included) next to it.

On a shared machine the load drifts by tens of per cent within a minute, more than the effect
measured, so two designs are offered:

* ``concurrent`` (default): each pair runs the agent-on and the agent-off job *at the same time*
  (8 ranks on the machine), so both see the same load; only the steps both jobs ran during the same
  interval (by their ``perf_counter`` stamps, one clock per host) are compared.
* ``alternate``: one job at a time, on/off then off/on, ...: the job alone on the machine, as the
  target is phrased, but the drift between runs lands in the figure.

Timing DDP's gradient buckets needs a Python comm hook (docs/agent.md, collectives), which replaces
DDP's built-in C++ all-reduce; ``--reference-hook`` separates that from the rest of the agent.

Figures: per pair the ratio of the medians (on / off) of per-step time, then the median over pairs;
the spread over pairs says how far to trust it, and ``--control`` adds, per pair, an agent-off vs
agent-off pair run the same way (an A/A test: what the method reports when there is nothing to find).
Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    tmp: str, name: str, steps: int, agent: bool, extra_env: dict[str, str], py_hook: bool = False
) -> tuple[Any, str]:
    out = os.path.join(tmp, f"{name}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("FLEETSCOPE_DISABLED", "FLEETSCOPE_OFFLINE", "FLEETSCOPE_SERVER", "FLEETSCOPE_SPOOL_DIR"):
        env.pop(k, None)
    if agent:
        env.update(extra_env)
        env["FLEETSCOPE_SPOOL_DIR"] = os.path.join(tmp, f"spool-{name}")
    else:
        env["FLEETSCOPE_DISABLED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "fleetscope.demo_train", "--run-name", name, "--steps", str(steps), "--timing-out", out]  # fmt: skip
    if py_hook:
        cmd.append("--ddp-python-hook")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    return proc, out


def _finish(proc: Any, out: str, name: str, agent: bool, timeout: float) -> dict[str, Any]:
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"job {name} timed out") from None
    if proc.returncode != 0:
        raise SystemExit(f"job {name} failed ({proc.returncode}):\n{log[-4000:]}")
    with open(out) as f:
        doc = json.load(f)
    if doc["agent"] != agent:
        raise SystemExit(f"job {name}: agent {'on' if doc['agent'] else 'off'}, expected the opposite")
    ends, t = [], doc["t0"]
    for dt in doc["step_s"]:
        t += dt
        ends.append(t)
    return {"step_s": doc["step_s"], "cpu_s": doc["cpu_s"], "end": ends}


def _window(r: dict[str, Any], lo: float, hi: float, warmup: int) -> tuple[list[float], list[float]]:
    """Steps after the warm-up whose whole iteration lies in [lo, hi]."""
    wall, cpu = [], []
    for i in range(warmup, len(r["step_s"])):
        if r["end"][i] - r["step_s"][i] >= lo and r["end"][i] <= hi:
            wall.append(r["step_s"][i])
            cpu.append(r["cpu_s"][i])
    return wall, cpu


def _serve(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fleetscope.cli", "serve", "--insecure-no-auth", "--port", str(port),
           "--data-dir", os.path.join(tmp, "data")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("fleetscope serve exited")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("fleetscope serve did not start")


def _pair(
    tmp: str, i: int, kind: str, a_agent: bool, args: Any, extra: dict[str, str]
) -> tuple[tuple[float, float], tuple[float, float], int] | None:
    """Jobs A (agent ``a_agent``) and B (agent off); returns the medians of A and B over the compared
    steps: (wall), (CPU), steps. The order of start alternates with ``i``."""
    jobs = [("a", a_agent), ("b", False)]
    if i % 2:
        jobs.reverse()
    names = {k: f"jobbench-{kind}-{i}-{k}-{os.getpid()}" for k, _ in jobs}
    hook = {"a": args.reference_hook and kind == "control", "b": args.reference_hook and kind == "agent"}
    res: dict[str, dict[str, Any]] = {}
    if args.mode == "concurrent":
        started = {k: _start(tmp, names[k], args.steps, a, extra, hook[k]) for k, a in jobs}
        for k, a in jobs:
            res[k] = _finish(*started[k], names[k], a, args.timeout)
        lo = max(r["end"][args.warmup] - r["step_s"][args.warmup] for r in res.values())
        hi = min(r["end"][-1] for r in res.values())
    else:
        for k, a in jobs:
            res[k] = _finish(*_start(tmp, names[k], args.steps, a, extra, hook[k]), names[k], a, args.timeout)
        lo, hi = float("-inf"), float("inf")
    sel = {k: _window(res[k], lo, hi, args.warmup) for k in res}
    n = min(len(sel["a"][0]), len(sel["b"][0]))
    if n < 10:
        print(
            f"pair {i} {kind}: only {n} steps of the two jobs overlap (raise --steps); left out", flush=True
        )
        return None
    wall = (statistics.median(sel["a"][0]), statistics.median(sel["b"][0]))
    cpu = (statistics.median(sel["a"][1]), statistics.median(sel["b"][1]))
    return wall, cpu, n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="on/off pairs of jobs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20, help="first steps of each job left out")
    ap.add_argument("--mode", choices=("concurrent", "alternate"), default="concurrent")
    ap.add_argument("--transport", choices=("offline", "server"), default="offline")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    ap.add_argument("--control", action="store_true", help="also run agent-off vs agent-off pairs (A/A)")
    ap.add_argument(
        "--reference-hook",
        action="store_true",
        help="the agent-off job runs with torch's default Python DDP comm hook (demo_train --ddp-python-hook):"
        " the agent's cost beyond that of a Python comm hook; with --control, the control pairs then"
        " measure the Python comm hook itself (off + hook / off)",
    )
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="fleetscope-jobbench-")
    server = None
    extra: dict[str, str] = {}
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    control: list[float] = []
    medians: dict[bool, list[float]] = {True: [], False: []}
    try:
        if args.transport == "server":
            server, url = _serve(tmp)
            extra["FLEETSCOPE_SERVER"] = url
        else:
            extra["FLEETSCOPE_OFFLINE"] = "1"
        kinds = [("agent", True)] + ([("control", False)] if args.control else [])
        for i in range(args.pairs):
            for kind, first in kinds:
                r = _pair(tmp, i, kind, first, args, extra)
                if r is None:
                    continue
                med, cpu, n = r
                ratio, cpu_ratio = med[0] / med[1], cpu[0] / cpu[1]
                if kind == "agent":
                    medians[True].append(med[0])
                    medians[False].append(med[1])
                    ratios.append(ratio)
                    cpu_ratios.append(cpu_ratio)
                else:
                    control.append(ratio)
                if kind == "agent":
                    label = "on / off+hook" if args.reference_hook else "on / off"
                else:
                    label = "off+hook / off" if args.reference_hook else "off / off (control)"
                print(
                    f"pair {i} {label} ({args.mode}, {n}+ steps compared): median step {med[0] * 1e3:.2f} / "
                    f"{med[1] * 1e3:.2f} ms ({(ratio - 1) * 100:+.2f} %); rank 0 CPU per step "
                    f"{cpu[0] * 1e3:.2f} / {cpu[1] * 1e3:.2f} ms ({(cpu_ratio - 1) * 100:+.2f} %)",
                    flush=True,
                )
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    if not ratios:
        raise SystemExit("no pair compared (raise --steps)")
    print(f"job_step_median_on: {statistics.median(medians[True]) * 1e3:.2f} ms")
    print(f"job_step_median_off: {statistics.median(medians[False]) * 1e3:.2f} ms")
    print(f"job_slowdown_pairs_min: {(min(ratios) - 1) * 100:+.2f} %")
    print(f"job_slowdown_pairs_max: {(max(ratios) - 1) * 100:+.2f} %")
    print(f"job_cpu_per_step_increase: {(statistics.median(cpu_ratios) - 1) * 100:+.2f} %")
    if control:
        print(f"job_control_pairs_min: {(min(control) - 1) * 100:+.2f} %")
        print(f"job_control_pairs_max: {(max(control) - 1) * 100:+.2f} %")
    print(f"job_step_slowdown: {(statistics.median(ratios) - 1) * 100:+.2f} %")


if __name__ == "__main__":
    main()
