"""Memory explained per module and the checkpointing advice (``GET /api/v1/runs/{id}/memory``, the run
page's memory panel): the ranks' latest ``memory_modules`` events (``store.memory``) with the summary's
``memory`` section, analysed by ``analysis.checkpointing``."""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import Engine

from ..analysis import checkpointing as ck
from ..store import runs as run_store
from ..store.memory import rank_memory, rank_module_totals, rank_modules
from ..store.rows import RunRow
from .memory import run_memory
from .runs import steady_state

__all__ = ["run_memory_detail", "memory_report"]


def memory_report(engine: Engine, run_id: int, *, target_bytes: float | None = None) -> dict[str, Any] | None:
    """:func:`run_memory_detail` of the run; None for no such run."""
    run = run_store.get_run(engine, run_id)
    return None if run is None else run_memory_detail(engine, run, target_bytes=target_bytes)


def run_memory_detail(engine: Engine, run: RunRow, *, target_bytes: float | None = None,
                      top: int = 256) -> dict[str, Any]:
    """``GET /api/v1/runs/{id}/memory``: the summary's ``memory`` section plus memory per module (the
    rank with the largest measured footprint), the peak's parts, imbalance across ranks and the
    checkpointing advice (``analysis.checkpointing``; docs/metrics.md, "Memory per module")."""
    fig, _basis, _excess = steady_state(engine, run)
    summary = run_memory(engine, run, fig)
    peaks = {r.rank: r.peak_allocated_bytes for r in rank_memory(engine, run.id)}
    totals = rank_module_totals(engine, run.id)
    out: dict[str, Any] = {"run_id": run.id, **(summary or {}), "modules": [], "modules_rank": None,
                           "breakdown": None, "ranks": [], "module_imbalance": None, "checkpoint_advice": [],
                           "advice_note": "no per-module measurement (the agent measures it with the FLOPs, once per run)"}
    if not totals:
        return out

    def held(t: Any) -> float:
        return sum(float(t.totals.get(k) or 0.0) for k in ("activation_bytes", "param_bytes", "grad_bytes", "optim_bytes"))

    ref = max(totals, key=lambda t: (peaks.get(t.rank) or 0.0, held(t), -t.rank))
    rows = ck.decode_modules(rank_modules(engine, run.id, ref.rank))
    source = (summary or {}).get("source")
    peak = peaks.get(ref.rank)
    if peak is None and summary is not None:
        peak = summary.get("peak_allocated_max")
    acts = sum(r.activation_bytes for r in rows)
    forwards = int(ref.forwards or 1)
    flops_per_s = (fig.hw_flops_per_rank_step / fig.compute_s
                   if fig.hw_flops_per_rank_step and fig.compute_s else None)
    if target_bytes is not None:
        target, basis = float(target_bytes), "target_bytes (given)"
    elif peak is not None:
        target, basis = ck.default_target(float(peak), acts, device_total=ref.device_total_bytes,
                                          micro_batch=int(ref.micro_batch) if ref.micro_batch else None)
    else:
        target, basis = None, "no peak measured"  # type: ignore[assignment]
    advice, note = ck.checkpoint_advice(rows, peak=peak, target=target, target_basis=basis, forwards=forwards,
                                        flops_per_s=flops_per_s, step_s=fig.step_s)
    per_rank = [{"rank": t.rank, "peak_bytes": peaks.get(t.rank), **{k: t.totals.get(k) for k in (
        "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes")}, "measure_cost_s": t.cost_s}
        for t in totals]
    imb: dict[str, float | None] = {}
    for k in ("activation_bytes", "param_bytes", "grad_bytes", "optim_bytes"):
        vals = [float(t.totals[k]) for t in totals if t.totals.get(k) is not None]
        med = statistics.median(vals) if vals else 0.0
        imb[k] = max(vals) / med if vals and med > 0 else None  # 1 = balanced
    listed = sorted(rows, key=lambda r: -(r.activation_bytes + r.param_bytes + r.grad_bytes + r.optim_bytes))[:top]
    out.update({
        "modules": [r.as_dict() for r in listed],
        "modules_rank": ref.rank,
        "modules_total": len(rows),
        "forwards": forwards,
        "micro_batch": ref.micro_batch,
        "device_total_bytes": ref.device_total_bytes,
        "measure_cost_s": ref.cost_s,
        "forward_flops": ref.forward_flops,
        "achieved_flops_per_s": flops_per_s,
        "breakdown": ck.breakdown(peak, rows, source),
        "ranks": per_rank[:1024],
        "module_imbalance": imb,
        "target_bytes": target,
        "target_basis": basis,
        "checkpoint_advice": advice,
        "advice_note": note,
    })
    return out
