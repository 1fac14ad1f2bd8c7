"""Memory per module: the one-time measurement's cost against a step, and the advice's computation time.

    python bench/memory_modules.py [--blocks 24] [--width 512] [--batch 64] [--reps 7] [--modules 1000]

1. A CPU model of ``--blocks`` residual MLP blocks (Linear → GELU → Linear, ``--width`` wide, fp32, one
   thread). Three kinds of training step are timed in the same process, interleaved, median of
   ``--reps`` each: a plain step, a step under the FLOP meter alone (what the agent already paid once
   per run), and a step under the FLOP meter with the per-module memory measurement. Ratios are same-run
   ratios. The measurement's own hook time (``cost_s`` in the event) is reported too.
2. ``checkpoint_advice`` on a synthetic ``--modules``-module transformer-like tree (the greedy path:
   more candidates than EXACT_MAX) and on a 20-candidate one (the exact path), median of 5.

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _model(torch: Any, blocks: int, width: int) -> Any:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(self.act(self.up(x)))

    return torch.nn.Sequential(*[Block() for _ in range(blocks)])


def _step(torch: Any, model: Any, opt: Any, x: Any, kind: str) -> tuple[float, float | None]:
    from fleetscope.agent.mfu import FlopMeter

    got: list[dict[str, Any]] = []
    meter = FlopMeter(memory_emit=got.append) if kind == "memory" else FlopMeter()
    t0 = time.perf_counter()
    if kind != "plain":
        meter.start()
    model(x).square().mean().backward()
    if kind != "plain":
        meter.stop()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return dt, (got[0]["cost_s"] if got else None)


def bench_measurement(blocks: int, width: int, batch: int, reps: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(torch, blocks, width)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, width)
    for _ in range(2):
        _step(torch, model, opt, x, "plain")
    times: dict[str, list[float]] = {"plain": [], "flops": [], "memory": []}
    costs: list[float] = []
    for _ in range(reps):
        for kind in ("plain", "flops", "memory"):
            dt, cost = _step(torch, model, opt, x, kind)
            times[kind].append(dt)
            if cost is not None:
                costs.append(cost)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"step_plain_ms": med["plain"] * 1e3, "step_flops_ms": med["flops"] * 1e3,
            "step_flops_memory_ms": med["memory"] * 1e3,
            "memory_over_flops_step": med["memory"] / med["flops"], "memory_over_plain_step": med["memory"] / med["plain"],
            "memory_hooks_ms": statistics.median(costs) * 1e3, "modules": float(1 + 4 * blocks)}


def _rows(n_layers: int) -> list[Any]:
    from fleetscope.server.analysis import checkpointing as ck

    mb = 1 << 20
    rows = [ck.ModuleRow(ck.ROOT, "M", 0, 0, 0, 0, 0, 0, None, None, False)]
    for b in range(n_layers):
        rows.append(ck.ModuleRow(f"layers.{b}", "Block", 2 * mb, 0, 0, 0, 0, 0, 1 * mb, 30e9 + b, False))
        for part, (a, f) in {"attn": (6 * mb, 10e9), "mlp": (8 * mb, 16e9), "norm": (1 * mb, 0.1e9)}.items():
            rows.append(ck.ModuleRow(f"layers.{b}.{part}", "M", a, 0, 0, 0, 0, 0, 1 * mb, f, False))
    return rows


def bench_advice(modules: int) -> dict[str, float]:
    from fleetscope.server.analysis import checkpointing as ck

    out: dict[str, float] = {}
    for label, n_layers in (("advice_greedy", max(1, modules // 4)), ("advice_exact", 5)):
        rows = _rows(n_layers)
        peak = 100e9
        need = sum(r.activation_bytes for r in rows) * 0.4
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            advice, _note = ck.checkpoint_advice(rows, peak=peak, target=peak - need, target_basis="bench",
                                                 forwards=1, flops_per_s=1e14, step_s=1.0)
            ts.append(time.perf_counter() - t0)
        out[f"{label}_ms"] = statistics.median(ts) * 1e3
        out[f"{label}_modules"] = float(len(rows))
        out[f"{label}_method_exact"] = float(bool(advice) and advice[0]["method"] == "exact")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--modules", type=int, default=1000)
    a = ap.parse_args()
    res = {**bench_measurement(a.blocks, a.width, a.batch, a.reps), **bench_advice(a.modules)}
    for k, v in res.items():
        print(f"{k}: {v:.4g}")


if __name__ == "__main__":
    main()
