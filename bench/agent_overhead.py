"""Agent overhead: training-thread µs per fully instrumented step, side by side in the same run with
the floor (5 nested no-op ``with`` blocks on prebuilt objects), wandb offline ``run.log`` of 10 keys
and prometheus_client (10 ``Gauge.set`` + 1 ``Histogram.observe``).

    python bench/agent_overhead.py [--rounds 9] [--steps 1000] [--transport offline|dead-server]

(wandb: ``pip install -e '.[bench]'``; ``--no-wandb`` without it.)

The agent runs as a user runs it: ``fleetscope.agent.init(...)`` with the real Transport (offline
spool in a temp dir, or a server URL on which nothing listens), collectives wrapped by ``init`` on a
1-rank gloo process group. One step = ``run.step(tokens=, samples=)`` + 4 ``run.phase(name)`` blocks
+ 2 ``all_reduce`` calls inside backward + the memory sample + the enqueue of the step's records
(1 rank_step + 2 collectives), written in the loop as a training script writes them.

The collectives. Two 1-rank gloo ``all_reduce`` calls of 4 KiB cost 35-155 µs median here with a
p99 of 0.1-1.8 ms (the ``gloo_2_raw`` row), so the agent's µs disappear in their noise. The headline figure
therefore times the agent's own collective wrapper (built by the same ``_make_wrapper`` that ``init``
uses for ``torch.distributed.all_reduce``) around a no-op with ``all_reduce``'s signature: all of
the agent's per-call work runs (group lookup, bytes, two marks, the record, its share of the step's
resolution), only the transfer is missing. The same step with the real gloo calls is reported next to
the raw calls for reference (``agent_gloo`` vs ``gloo_2_raw``), and so is automatic mode
(``run.instrument`` on loader, model and optimizer: ``auto_agent`` vs ``auto_plain``).

Method. Every contender is timed per iteration (``perf_counter_ns`` around each); rounds interleave
the contenders; all samples of a contender are pooled into its median, p99 and mean; the timer's own
cost (an empty timed iteration, same run) is subtracted. Python's garbage collector stays on: the
agent pays for the collections its allocations trigger. Between rounds the transport's sender thread
batches and spools what the round queued, outside the timing, and its CPU time is reported apart: at
this loop's ~100k steps/s, letting it run inside the loop would time GIL hand-offs that a real job
(a few records per step, drained every 2 s) never sees. Each round starts with an empty young
generation (``gc.collect(0)``, untimed) and 20 untimed iterations, alike for every contender, so that
a round pays for its own garbage and not for the previous contender's. Microbenchmark caveat: a
tight loop keeps the agent's code and data in cache; inside a real step, between kernels that evict
them, each call costs more. Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_pc = time.perf_counter_ns
WARM = 20  # untimed iterations at the start of each round


class _NoopCM:
    __slots__ = ()

    def __enter__(self) -> _NoopCM:
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        return None


def _timer(n: int) -> list[int]:
    out: list[int] = []
    append = out.append
    for _ in range(n):
        t0 = _pc()
        append(_pc() - t0)
    return out


def _floor(n: int) -> list[int]:
    """5 nested no-op ``with`` blocks on prebuilt objects: 1 step around 4 phases
    (docs/benchmarks.md "Design measurements")."""
    step, data, fwd, bwd, opt = (_NoopCM() for _ in range(5))
    out: list[int] = []
    append = out.append
    for _ in range(n):
        t0 = _pc()
        with step:
            with data:
                pass
            with fwd:
                pass
            with bwd:
                pass
            with opt:
                pass
        append(_pc() - t0)
    return out


def _agent_loop(run: Any, all_reduce: Any, tensor: Any, ncoll: int) -> Callable[[int], list[int]]:
    """The fully instrumented step, written as a training script writes it."""

    def loop(n: int) -> list[int]:
        out: list[int] = []
        append = out.append
        for _ in range(n):
            t0 = _pc()
            with run.step(tokens=4096, samples=8):
                with run.phase("data"):
                    pass
                with run.phase("forward"):
                    pass
                with run.phase("backward"):
                    if ncoll:
                        all_reduce(tensor)
                        all_reduce(tensor)
                with run.phase("optimizer"):
                    pass
            append(_pc() - t0)
        return out

    return loop


def _auto_loop(torch: Any, run: Any | None) -> Callable[[int], list[int]]:
    """Automatic mode (``run.instrument``: loader, forward hooks, optimizer hooks) on a 1-parameter
    model; with ``run=None`` the same loop uninstrumented. Each timed iteration is one ``next()``, one
    forward and one ``optimizer.step()``: their difference is what the hooks add."""
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(1, 1)
    if run is not None:
        run.instrument(model=model, optimizer=opt)

    def loop(n: int) -> list[int]:
        batches = [x] * n
        loader: Any = run.instrument(dataloader=batches) if run is not None else batches
        out: list[int] = []
        append = out.append
        t0 = _pc()
        for b in loader:
            model(b)
            opt.step()
            t1 = _pc()
            append(t1 - t0)
            t0 = t1
        return out

    return loop


def _raw_collectives(all_reduce: Any, tensor: Any) -> Callable[[int], list[int]]:
    def loop(n: int) -> list[int]:
        out: list[int] = []
        append = out.append
        for _ in range(n):
            t0 = _pc()
            all_reduce(tensor)
            all_reduce(tensor)
            append(_pc() - t0)
        return out

    return loop


def _wandb(tmp: str) -> tuple[Callable[[int], list[int]], Callable[[], None]]:
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
    os.environ.setdefault("WANDB_CONSOLE", "off")
    import wandb

    run = wandb.init(project="fleetscope-bench", dir=tmp, settings=wandb.Settings(console="off"))
    keys = [f"train/metric_{i}" for i in range(10)]
    log = run.log

    def loop(n: int) -> list[int]:
        out: list[int] = []
        append = out.append
        for i in range(n):
            v = i * 0.001
            t0 = _pc()
            log({k: v for k in keys})
            append(_pc() - t0)
        return out

    return loop, run.finish


def _prometheus() -> Callable[[int], list[int]]:
    from prometheus_client import CollectorRegistry, Gauge, Histogram

    reg = CollectorRegistry()
    gauges = [Gauge(f"train_metric_{i}", "bench", registry=reg) for i in range(10)]
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9 = (g.set for g in gauges)
    observe = Histogram("step_seconds", "bench", registry=reg).observe

    def loop(n: int) -> list[int]:
        out: list[int] = []
        append = out.append
        for i in range(n):
            v = i * 0.001
            t0 = _pc()
            g0(v)
            g1(v)
            g2(v)
            g3(v)
            g4(v)
            g5(v)
            g6(v)
            g7(v)
            g8(v)
            g9(v)
            observe(v)
            append(_pc() - t0)
        return out

    return loop


def _noop_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    """``all_reduce``'s signature, no transfer."""
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[int], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--steps",
        type=int,
        default=1000,
        help="timed iterations per contender per round; the sender drains the queue between rounds, as it "
        "does every 2 s in a job (3 records a step: keep it well under batch_max_records, 5000)",
    )
    ap.add_argument(
        "--wandb-steps", type=int, default=300, help="wandb iterations per round (~0.1-2 ms each)"
    )
    ap.add_argument("--transport", choices=("offline", "dead-server"), default="offline")
    ap.add_argument(
        "--no-wandb", action="store_true", help="skip wandb (not installed: pip install '.[bench]')"
    )
    ap.add_argument(
        "--no-real", action="store_true", help="skip the reference rows with real gloo collectives"
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    tmp = tempfile.mkdtemp(prefix="fleetscope-bench-")
    os.environ["FLEETSCOPE_SPOOL_DIR"] = os.path.join(tmp, "spool")
    os.environ.pop("FLEETSCOPE_DISABLED", None)
    if args.transport == "offline":
        os.environ["FLEETSCOPE_OFFLINE"] = "1"
        os.environ.pop("FLEETSCOPE_SERVER", None)
    else:  # a port nothing listens on: every send is refused, records go to the spool
        os.environ.pop("FLEETSCOPE_OFFLINE", None)
        os.environ["FLEETSCOPE_SERVER"] = f"http://127.0.0.1:{_free_port()}"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)

    import fleetscope.agent as fs
    from fleetscope.agent import collectives

    contenders: dict[str, Callable[[int], list[int]]] = {"timer": _timer, "floor": _floor}
    finish_wandb = None
    if not args.no_wandb:
        try:
            contenders["wandb"], finish_wandb = _wandb(tmp)
        except ImportError:
            print("wandb not installed (pip install '.[bench]'): skipped", file=sys.stderr)
    contenders["prometheus"] = _prometheus()

    run = fs.init(
        name="bench-agent-overhead", model_family="bench", config={"bench": True}, flops_per_step=1e9
    )
    if not isinstance(run, fs.Run):
        raise SystemExit("the agent did not start (see the log above)")
    tensor = torch.ones(1024)  # 4 KiB
    noop_wrapped = collectives._make_wrapper("all_reduce", _noop_all_reduce)
    contenders["agent"] = _agent_loop(run, noop_wrapped, tensor, 2)
    contenders["agent_no_collectives"] = _agent_loop(run, None, tensor, 0)
    if dist.all_reduce.__code__.co_filename != "<fleetscope wrapper of all_reduce>":
        print("note: init installed the generic wrapper, not the generated one", file=sys.stderr)
    if not args.no_real:
        raw = dist.all_reduce.__wrapped__  # what init replaced
        contenders["gloo_2_raw"] = _raw_collectives(raw, tensor)
        contenders["agent_gloo"] = _agent_loop(run, dist.all_reduce, tensor, 2)
    contenders["auto_plain"] = _auto_loop(torch, None)
    contenders["auto_agent"] = _auto_loop(torch, run)

    for fn in contenders.values():  # warm-up (first step: clock, sampler, sender thread)
        fn(50)
    run.flush(timeout=30)
    gc.collect()  # the set-up's garbage: not a full collection inside the first timed round

    sender = getattr(getattr(run, "_tx", None), "_thread", None)
    sender_clock = time.pthread_getcpuclockid(sender.ident) if sender is not None and sender.ident else None
    sender_ns = 0
    sender_steps = 0
    samples: dict[str, list[int]] = {k: [] for k in contenders}
    round_medians: dict[str, list[float]] = {k: [] for k in contenders}
    gc_in_rounds: dict[str, int] = {k: 0 for k in contenders}
    current = [""]

    def count_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and current[0]:
            gc_in_rounds[current[0]] += 1

    gc.callbacks.append(count_gc)
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            # an empty young generation at the start of each round (outside the timing): a collection
            # inside the round is then caused by this contender's own allocations, not the previous
            # one's; the first WARM iterations re-warm the caches after the previous round and the
            # sender's drain, and are dropped, alike for every contender
            gc.collect(0)
            current[0] = name
            xs = fn((args.wandb_steps if name == "wandb" else args.steps) + WARM)[WARM:]
            current[0] = ""
            samples[name] += xs
            xs.sort()
            round_medians[name].append(_pct(xs, 0.5))
            if name.startswith("agent") or name == "auto_agent":
                # the sender thread batches and spools what the round queued, outside the timing (its
                # CPU time is reported apart): at this benchmark's ~300k records/s, running it inside
                # the loop would time GIL hand-offs that a real job (a few records per step) never sees
                c0 = time.clock_gettime_ns(sender_clock) if sender_clock is not None else 0
                run.flush(timeout=60)
                if sender_clock is not None:
                    sender_ns += time.clock_gettime_ns(sender_clock) - c0
                    sender_steps += len(xs)
    gc.callbacks.remove(count_gc)
    stats = run.stats()
    run.finish()
    if finish_wandb is not None:
        finish_wandb()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)

    timer = sorted(samples["timer"])
    t_med = _pct(timer, 0.5)
    res: dict[str, tuple[float, float, float]] = {}
    print(f"{'contender':<22} {'median µs':>10} {'p99 µs':>10} {'mean µs':>10}  round medians µs")
    for name, xs in samples.items():
        xs.sort()
        med = max(0.0, _pct(xs, 0.5) - t_med) / 1e3
        p99 = max(0.0, _pct(xs, 0.99) - t_med) / 1e3
        mean = max(0.0, sum(xs) / len(xs) - t_med) / 1e3
        res[name] = (med, p99, mean)
        rm = " ".join(f"{max(0.0, m - t_med) / 1e3:.2f}" for m in round_medians[name])
        print(f"{name:<22} {med:>10.2f} {p99:>10.2f} {mean:>10.2f}  {rm}")
    tx = stats.get("transport") or {}
    print(
        f"steps recorded {stats['steps']}, collectives {stats['collectives']}, "
        f"internal errors {stats['internal_errors']}, transport {args.transport}, drops {tx.get('dropped')}; "
        f"garbage collections inside the agent's timed rounds: {gc_in_rounds['agent']} "
        f"(1 per {len(samples['agent']) // max(1, gc_in_rounds['agent'])} steps)"
    )
    if "agent_gloo" in res:
        (raw_m, raw_p, _), (ag_m, ag_p, _) = res["gloo_2_raw"], res["agent_gloo"]
        print(
            f"with real gloo all_reduce x2: raw calls {raw_m:.2f} µs (p99 {raw_p:.2f}), agent step around "
            f"them {ag_m:.2f} µs (p99 {ag_p:.2f}); difference of medians {ag_m - raw_m:.2f} µs"
        )
    auto_added = res["auto_agent"][0] - res["auto_plain"][0]
    print(f"automatic mode (loader + forward + optimizer hooks), added per step: {auto_added:.2f} µs")
    if sender_steps:
        print(
            f"sender thread ({args.transport}: batch, encode, send or spool), CPU per step: {sender_ns / sender_steps / 1e3:.2f} µs"
        )

    a_med, a_p99, a_mean = res["agent"]
    f_med = res["floor"][0]
    print(f"agent_step_median: {a_med:.2f} us")
    print(f"agent_step_p99: {a_p99:.2f} us")
    print(f"agent_step_mean: {a_mean:.2f} us")
    print(f"agent_step_no_collectives_median: {res['agent_no_collectives'][0]:.2f} us")
    print(f"floor_5_with_median: {f_med:.2f} us")
    print(f"prometheus_10_set_1_observe_median: {res['prometheus'][0]:.2f} us")
    print(f"agent_over_floor: {a_med / f_med:.2f} x")
    if "wandb" in res:
        print(f"wandb_log_10_keys_median: {res['wandb'][0]:.2f} us")
        print(f"wandb_log_10_keys_p99: {res['wandb'][1]:.2f} us")
        print(f"wandb_over_agent: {res['wandb'][0] / a_med:.1f} x")


if __name__ == "__main__":
    main()
