"""Sender-thread cost of the run-stop reporting (agent/health.py): one ``position`` built while the
training thread is stuck in a step, with and without its stack, and ``observe`` (what the sender
thread does per record to learn step times and collective counts).

    python bench/heartbeat.py [--n 2000] [--depth 40]

A real run (``fleetscope.agent.init``, offline transport in a temp dir, collectives wrapped on a 1-rank
gloo group): 20 steps with 2 ``all_reduce`` calls each, then a "training" thread stays inside step 20
at ``--depth`` nested Python frames (a deep model). On this thread (as the sender thread does) each
variant builds ``--n`` positions (``Watch._position``), timed one by one with ``perf_counter_ns``:

* ``position_no_stack``: phase, open step, collective from the agent's own records (no stack);
* ``position_stack``: the same plus the training thread's stack (12 innermost frames);
* ``position_flight_recorder`` (when torch has a Flight Recorder for gloo): the collective from
  ``_dump_fr_trace`` instead of the agent's records;
* ``observe_per_record``: ``Watch.observe`` over a cycle's worth of records, per record.

The training thread pays nothing for any of it (nothing is added to a step: see
``bench/agent_overhead.py`` run with ``FLEETSCOPE_HEARTBEAT_S=0`` and with the default). At the
default heartbeat (5 s) a stuck rank spends one position per 5 s on its sender thread. Prints
``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stats(ns: list[int]) -> tuple[float, float, float]:
    ns = sorted(ns)
    return statistics.median(ns) / 1e3, ns[min(len(ns) - 1, int(0.99 * len(ns)))] / 1e3, statistics.fmean(ns) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="positions built per variant")
    ap.add_argument("--depth", type=int, default=40, help="Python frames of the stuck training thread")
    args = ap.parse_args()

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # a recorder, where torch has one for gloo
    import fleetscope.agent as fs
    import torch
    import torch.distributed as dist
    from fleetscope.agent.health import Watch

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="fs-hb-")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    run: Any = fs.init("bench-heartbeat", offline=True, spool_dir=tmp, heartbeat_s=3600.0)
    t = torch.ones(1024)
    for _ in range(20):
        with run.step(tokens=128):
            with run.phase("forward"):
                pass
            with run.phase("backward"):
                dist.all_reduce(t)
                dist.all_reduce(t)
    run.flush(timeout=5)
    release = threading.Event()
    entered = threading.Event()

    def nest(k: int) -> None:
        if k:
            nest(k - 1)
        else:
            entered.set()
            release.wait()

    def train() -> None:
        with run.step(tokens=128):
            with run.phase("data"):
                nest(args.depth)

    th = threading.Thread(target=train, name="training")
    th.start()
    entered.wait()
    time.sleep(0.05)

    watch = Watch(run, heartbeat_s=5.0, stack_after_s=1e9)
    # teach it the steps and collectives the sender thread saw (as observe() does each cycle)
    items: list[tuple[str, Any]] = [("rank_step", (0, i, 0.01, 1.7e9 + i)) for i in range(20)]
    items += [("collective", (0, i, j, "all_reduce", 1, 4096, 1, 1e-5, 1e-5, 1.7e9 + i, "world"))
              for i in range(20) for j in range(2)]
    watch.observe(items)

    results: dict[str, tuple[float, float, float]] = {}
    os.environ["FLEETSCOPE_FLIGHT_RECORDER"] = "0"
    for name, after in (("position_no_stack", 1e9), ("position_stack", 0.0)):
        watch.stack_after_s = after
        watch._fr_tried = False
        ns = []
        ev = None
        for _ in range(args.n):
            t0 = time.perf_counter_ns()
            ev = watch._position(run, force=True)
            ns.append(time.perf_counter_ns() - t0)
        assert ev is not None and (ev["data"]["stack"] is not None) == (after == 0.0)
        results[name] = _stats(ns)
    os.environ["FLEETSCOPE_FLIGHT_RECORDER"] = "1"
    watch.stack_after_s = 1e9
    watch._fr_tried = False
    ev = watch._position(run, force=True)
    if ev is not None and ev["data"]["source"] == "flight_recorder":
        ns = []
        for _ in range(min(args.n, 500)):
            t0 = time.perf_counter_ns()
            watch._position(run, force=True)
            ns.append(time.perf_counter_ns() - t0)
        results["position_flight_recorder"] = _stats(ns)
    big = items * 50
    ns = []
    for _ in range(50):
        w = Watch(run, heartbeat_s=5.0, stack_after_s=30.0)
        t0 = time.perf_counter_ns()
        w.observe(big)
        ns.append((time.perf_counter_ns() - t0) // len(big))
    results["observe_per_record"] = _stats(ns)

    release.set()
    th.join()
    run.finish()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"torch {torch.__version__}, depth {args.depth}, n {args.n}")
    for name, (med, p99, mean) in results.items():
        print(f"{name}: median {med:.1f} us, p99 {p99:.1f} us, mean {mean:.1f} us")


if __name__ == "__main__":
    main()
