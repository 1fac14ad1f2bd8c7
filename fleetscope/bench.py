"""Cluster microbenchmarks of ``fleetscope bench``: matmul TFLOP/s, collective busbw, H2D bandwidth,
and the same figures per node (plus memory bandwidth) so that a slow node shows over time.

Numbers follow the conventions others publish, so they compare: matmul FLOPs = 2·m·n·k; collective
busbw as NCCL-tests (``algbw × 2(n-1)/n`` for all_reduce); copy bandwidth from pinned host memory;
memory bandwidth as STREAM's copy (bytes read + bytes written per second).
Torch is imported here, never by the CLI module. On CPU, threads are pinned to 1 per process (the
figures are per core then; ``--threads`` changes it) so a shared 2-core machine gives stable numbers.

Per-node series (``NODE_BENCHMARKS``) carry ``"node"`` in their params — the node name the agent
reports for a rank (``FLEETSCOPE_NODE``, else ``SLURMD_NODENAME``, else the host name) — so
``GET /api/v1/nodes`` shows each node's latest figures next to its run history, compared with the
other nodes' median, and the Benchmarks page draws a line per node:

* ``node_matmul_tflops`` {node, n, dtype, device}: the largest square matmul of the preferred dtype
  (bf16 on GPU, fp32 on CPU) — the same measurement as the cluster series, not a second run;
* ``node_mem_bandwidth`` {node, bytes, device}: a device-to-device (GPU) or RAM (CPU) tensor copy;
* ``node_all_reduce_busbw`` {node, size_bytes, world, backend}: all_reduce busbw by message size over
  every GPU of the node with NCCL (≥ 2 GPUs), else the 2-process gloo group of the cluster series.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["matmul_tflops", "collective_busbw", "h2d_bandwidth", "mem_bandwidth", "node_name", "node_figures", "run_all",
           "NODE_BENCHMARKS"]

#: the per-node benchmark names (params carry "node"); ``GET /api/v1/nodes`` reads these
NODE_BENCHMARKS = ("node_matmul_tflops", "node_mem_bandwidth", "node_all_reduce_busbw")


def node_name() -> str:
    """This machine's node name as the agent reports it: ``FLEETSCOPE_NODE``, ``SLURMD_NODENAME``, the host name."""
    for var in ("FLEETSCOPE_NODE", "SLURMD_NODENAME"):
        v = os.environ.get(var, "").strip()
        if v:
            return v
    return socket.gethostname()


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


def mem_bandwidth(nbytes: int, device: str = "cpu", *, iters: int = 5) -> dict[str, Any]:
    """Memory bandwidth of a tensor copy of ``nbytes`` on ``device``: (read + written bytes) / s."""
    import torch

    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    s = _time(lambda: dst.copy_(src), dev, warmup=2, iters=iters)
    return {"name": "node_mem_bandwidth", "params": {"bytes": src.numel() * 4, "device": dev.type},
            "unit": "GB/s", "value": 2.0 * src.numel() * 4 / s / 1e9}


def node_figures(node: str, results: Sequence[dict[str, Any]], extra: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The per-node points of ``results`` (the cluster series just measured) and ``extra`` (per-node
    measurements): the headline matmul, every per-node figure, and the all_reduce busbw per size
    (from ``extra`` when it holds a whole-node all_reduce, else from the cluster one), each with the node in params."""
    out: list[dict[str, Any]] = []
    mm = [r for r in results if r["name"] == "matmul_tflops"]
    if mm:
        gpu = [r for r in mm if r["params"].get("device") == "cuda"]
        pool = gpu or mm
        pref = [r for r in pool if r["params"].get("dtype") == ("bfloat16" if gpu else "float32")] or pool
        top = max(pref, key=lambda r: (r["params"].get("n", 0), r["value"]))
        out.append({**top, "name": "node_matmul_tflops", "params": {"node": node, **top["params"]}})
    ar = [r for r in extra if r["name"] == "all_reduce_busbw"] or [r for r in results if r["name"] == "all_reduce_busbw"]
    for r in ar:
        p = dict(r["params"])
        out.append({**r, "name": "node_all_reduce_busbw",
                    "params": {"node": node, "size_bytes": p.pop("bytes"), **p}})
    for r in extra:
        if r["name"] in NODE_BENCHMARKS:
            out.append({**r, "params": {"node": node, **r["params"]}})
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


def run_all(*, quick: bool = False, threads: int = 1, node: str | None = None) -> list[dict[str, Any]]:
    """Every microbenchmark this machine supports: the cluster series, then the per-node ones
    (``node_figures``) under ``node`` (default: :func:`node_name`)."""
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
    sizes = [1 << 12, 1 << 20] if quick else [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    out += collective_busbw(sizes, iters=3 if quick else 10, threads=threads)
    extra = [mem_bandwidth((256 << 20) if quick else (1 << 30), "cuda")] if gpu else []
    extra.append(mem_bandwidth((16 << 20) if quick else (256 << 20), "cpu", iters=3 if quick else 5))
    n_gpu = torch.cuda.device_count() if gpu else 0
    if n_gpu > 2:  # the whole node's GPUs (the cluster series uses 2)
        extra += collective_busbw(sizes + ([] if quick else [1 << 28]), world=n_gpu, iters=3 if quick else 10)
    return out + node_figures(node or node_name(), out, extra)
