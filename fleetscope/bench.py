"""Cluster microbenchmarks of ``fleetscope bench``: matmul TFLOP/s, collective busbw, H2D bandwidth.

Numbers follow the conventions others publish, so they compare: matmul FLOPs = 2·m·n·k; collective
busbw as NCCL-tests (``algbw × 2(n-1)/n`` for all_reduce); copy bandwidth from pinned host memory.
Torch is imported here, never by the CLI module. On CPU, threads are pinned to 1 per process (the
figures are per core then; ``--threads`` changes it) so a shared 2-core machine gives stable numbers.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

__all__ = ["matmul_tflops", "collective_busbw", "h2d_bandwidth", "run_all"]


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Any, dev: Any, *, warmup: int, iters: int, min_time_s: float = 0.05) -> float:
    """Median seconds per call over ``iters`` timed batches (each long enough to time reliably)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    reps = 1
    while True:  # calls per batch so one batch takes >= min_time_s
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(dev)
        dt = time.perf_counter() - t0
        if dt >= min_time_s or reps >= 1 << 16:
            break
        reps *= 2
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def matmul_tflops(sizes: list[int], dtypes: list[str], device: str = "cpu", *, iters: int = 5) -> list[dict[str, Any]]:
    """Square matmul throughput by size and dtype: 2·n³ FLOPs per call."""
    import torch

    dev = torch.device(device)
    out = []
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        for n in sizes:
            a = torch.randn(n, n, device=dev).to(dt)
            b = torch.randn(n, n, device=dev).to(dt)
            s = _time(lambda a=a, b=b: torch.mm(a, b), dev, warmup=2, iters=iters)
            out.append({"name": "matmul_tflops", "params": {"n": n, "dtype": dt_name, "device": dev.type},
                        "unit": "TFLOP/s", "value": 2.0 * n**3 / s / 1e12})
    return out


def h2d_bandwidth(sizes: list[int], *, iters: int = 5) -> list[dict[str, Any]]:
    """Host (pinned) → device copy bandwidth by size; empty without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return []
    dev = torch.device("cuda")
    out = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        s = _time(lambda src=src, dst=dst: dst.copy_(src, non_blocking=True), dev, warmup=2, iters=iters)
        out.append({"name": "h2d_bandwidth", "params": {"bytes": nbytes, "pinned": True},
                    "unit": "GB/s", "value": nbytes / s / 1e9})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _coll_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], iters: int, threads: int,
                 q: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        res = []
        for nbytes in sizes:
            t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=dev)
            for _ in range(3):
                dist.all_reduce(t)
            _sync(dev)
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            # the slowest rank's time is the collective's time
            tt = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            res.append((nbytes, float(tt.item())))
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def collective_busbw(sizes: list[int], *, world: int = 2, backend: str | None = None, iters: int = 10,
                     threads: int = 1) -> list[dict[str, Any]]:
    """all_reduce busbw by message size on a small local process group (NCCL on ≥ 2 GPUs, else gloo)."""
    import torch
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_coll_worker, args=(r, world, port, backend, sizes, iters, threads, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
    factor = 2.0 * (world - 1) / world
    return [{"name": "all_reduce_busbw", "params": {"bytes": nbytes, "world": world, "backend": backend},
             "unit": "GB/s", "value": nbytes / s / 1e9 * factor} for nbytes, s in res]


def run_all(*, quick: bool = False, threads: int = 1) -> list[dict[str, Any]]:
    """Every microbenchmark this machine supports."""
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    gpu = torch.cuda.is_available()
    out = []
    if gpu:
        out += matmul_tflops([1024, 4096] if quick else [1024, 2048, 4096, 8192], ["float16", "bfloat16", "float32"],
                             "cuda")
        out += h2d_bandwidth([1 << 20, 64 << 20] if quick else [1 << 20, 16 << 20, 256 << 20])
    out += matmul_tflops([128, 256] if quick else [256, 512, 1024], ["float32"] if quick else ["float32", "bfloat16"],
                         "cpu", iters=3 if quick else 5)
    out += collective_busbw([1 << 12, 1 << 20] if quick else [1 << 12, 1 << 16, 1 << 20, 1 << 24],
                            iters=3 if quick else 10, threads=threads)
    return out
