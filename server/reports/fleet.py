"""Reports across runs: the fleet table, pickers, compare and scaling — all from the same per-run
figures (``runs.figures``) as the run summary."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Engine

from ..analysis.figures import COMPONENTS, SHARE_KEYS
from ..analysis.scaling import compare_runs as _compare_runs
from ..analysis.scaling import scaling as _scaling
from ..downsample import minmax_series
from ..store import alerts, steps
from ..store import collectives as coll_store
from ..store import runs as run_store
from . import scope
from .pages import comm_by_dim_of_runs, ranking_from_shares
from .runs import figures, with_figures

__all__ = ["fleet_rows", "families", "run_options", "compare_runs", "compare_view", "scaling", "scaling_view", "normalised",
           "NORMALISED"]


def fleet_rows(engine: Engine, *, family: str | None = None, status: str | None = None, q: str | None = None,
               limit: int = 2000) -> list[dict[str, Any]]:
    """Runs (running ones first, then newest) with their figures, top bottleneck and firing alerts."""
    runs = scope.visible_rows(run_store.fleet_runs(engine, family=family, status=status, q=q, limit=limit))
    firing = alerts.firing_counts(engine, [r.id for r in runs])
    figs = figures(engine, runs)
    out = []
    for r in runs:
        f = figs[r.id]
        ranking = ranking_from_shares(f.shares, f.step_s)
        top = ranking[0] if ranking else None
        out.append({
            "id": r.id, "name": r.name, "model_family": r.model_family, "world_size": r.world_size,
            "device_type": r.device_type, "status": r.status, "started_at": r.started_at,
            "last_seen_at": r.last_seen_at, "git_commit": r.git_commit,
            "steps": f.steps, "mfu": f.mfu, "tokens_per_s": f.tokens_per_s, "tokens_per_s_per_gpu": f.tokens_per_s_per_gpu,
            "step_s_p50": f.step_s, "step_s_p95": f.step_s_p95, "top_bottleneck": top,
            "alerts_firing": firing.get(r.id, 0), "config_signature": r.config_signature,
        })  # fmt: skip
    return out


def families(engine: Engine) -> list[str]:
    """Model families with at least one run."""
    return run_store.families(engine)


def run_options(engine: Engine, limit: int = 1000) -> list[dict[str, Any]]:
    """(id, name, model_family, world_size) of recent runs, for pickers."""
    rows = scope.visible_rows(run_store.run_options(engine, limit), key=lambda d: d.get("owner_key"))
    return [{k: v for k, v in d.items() if k != "owner_key"} for d in rows]


#: config keys a run may give its model size under (``fs.init(params=, active_params=)`` puts it in meta)
_PARAM_KEYS = ("params", "num_params", "n_params", "model_params", "parameters")
_ACTIVE_KEYS = ("active_params", "num_active_params", "activated_params")
#: the normalised figures of compare (docs/metrics.md, "Normalised comparison")
NORMALISED = ("params", "active_params", "param_tokens_per_s_per_gpu", "samples_per_s_per_gpu")


def _size(run: Any, keys: Sequence[str]) -> float | None:
    for src in (run.meta or {}, run.config or {}):
        for k in keys:
            v = src.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return float(v)
    return None


def normalised(engine: Engine, run: Any, fig: Any) -> dict[str, Any]:
    """A run's normalised throughput: ``params`` / ``active_params`` (recorded: meta, else config keys; active
    defaults to all), ``param_tokens_per_s_per_gpu`` (tokens/s/GPU × active parameters: model-FLOP-like, comparable
    across model sizes), ``samples_per_s_per_gpu`` (tokens/s/GPU × samples per token of the run) and
    ``modality_tokens_per_s`` ({modality: tokens/s}, from the per-modality token counts). None where the
    run did not record what a figure needs."""
    params = _size(run, _PARAM_KEYS)
    active = _size(run, _ACTIVE_KEYS) or params
    per_gpu = fig.tokens_per_s_per_gpu
    out: dict[str, Any] = {"params": params, "active_params": active,
                           "param_tokens_per_s_per_gpu": per_gpu * active if per_gpu is not None and active else None,
                           "samples_per_s_per_gpu": None, "modality_tokens_per_s": None}
    if per_gpu is not None:
        s = steps.load_steps(engine, run.id, ("step", "tokens", "samples"))
        if len(s):
            tok, smp = np.nansum(s["tokens"]), np.nansum(s["samples"])
            if tok > 0 and smp > 0:
                out["samples_per_s_per_gpu"] = float(per_gpu * smp / tok)
    if fig.tokens_per_s is not None:
        by: dict[str, float] = {}
        for _step, modality, tokens in coll_store.run_modalities(engine, run.id):
            by[modality] = by.get(modality, 0.0) + float(tokens or 0)
        total = sum(by.values())
        if total > 0:
            out["modality_tokens_per_s"] = {m: fig.tokens_per_s * v / total for m, v in sorted(by.items())}
    return out


def compare_runs(engine: Engine, run_ids: Sequence[int]) -> dict[str, Any]:
    """Runs side by side in normalised units with the first run as reference and the config diff
    (``analysis.scaling.compare_runs``), each run with its normalised throughput (``normalised``); the
    relative figures of runs of another family than the first are for reading, not judging (``same_family``)."""
    found = {i: r for i, r in run_store.runs_by_ids(engine, run_ids).items() if scope.visible_rows([r])}
    pairs = with_figures(engine, list(found.values()))
    out = _compare_runs(run_ids, {r.id: (r, f) for r, f in pairs})
    norm = {r.id: normalised(engine, r, f) for r, f in pairs}
    ref = out["runs"][0] if out["runs"] else None
    for i, row in enumerate(out["runs"]):
        row.update(norm[row["id"]])
        row["same_family"] = i == 0 or (ref is not None and row["model_family"] is not None
                                        and row["model_family"] == ref["model_family"])
    if out["runs"]:
        for m in ("param_tokens_per_s_per_gpu", "samples_per_s_per_gpu"):
            b = out["runs"][0][m]
            out["relative_to_first"][m] = [(r[m] / b) if r[m] is not None and b else None for r in out["runs"]]
    return out


def compare_view(engine: Engine, run_ids: list[int], *, max_points: int = 400) -> dict[str, Any]:
    """Runs side by side for the Compare page: normalised metrics, config diff, step-time series
    aligned by step (min/max reduced) and each run's communication by parallel dimension."""
    found = {i: r for i, r in run_store.runs_by_ids(engine, run_ids).items() if scope.visible_rows([r])}
    ordered = [found[i] for i in run_ids if i in found]
    figs = figures(engine, ordered)
    metrics = {}
    for r in ordered:
        f = figs[r.id]
        metrics[r.id] = {
            "tokens_per_s": f.tokens_per_s,
            "tokens_per_s_per_gpu": f.tokens_per_s_per_gpu,
            "mfu": f.mfu,
            "step_s": f.step_s,
            "step_s_p95": f.step_s_p95,
            # step time per 1k tokens processed by one GPU, in ms (analysis.figures.step_s_per_1k_tokens)
            "step_ms_per_1k_tokens": f.step_s_per_1k_tokens * 1e3 if f.step_s_per_1k_tokens is not None else None,
            "packing_efficiency": f.packing_efficiency,
            "mem_peak_bytes": f.mem_peak_bytes,
            "overlap_ratio": f.overlap_ratio,
            **{k: f.get(k) for k, _ in COMPONENTS},
            **normalised(engine, r, f),
        }
    keys = sorted({k for r in ordered for k in (r.config or {})})
    config_rows = []
    for k in keys:
        vals = [(r.config or {}).get(k) for r in ordered]
        config_rows.append({"key": k, "values": vals, "differs": len({repr(v) for v in vals}) > 1})
    series = {}
    for r in ordered:
        s = steps.load_steps(engine, r.id, ("step", "step_s"))
        if len(s):
            series[r.id] = minmax_series(s.steps, s["step_s"], max_points)
    missing = [i for i in run_ids if i not in found]
    return {"runs": [r.as_dict() for r in ordered], "metrics": metrics, "config": config_rows, "series": series,
            "comm_by_dim": comm_by_dim_of_runs(engine, [r.id for r in ordered]), "missing": missing}


def scaling(engine: Engine, *, family: str, device_type: str | None = None, signature: str | None = None,
            status: tuple[str, ...] | None = None, exclude: Sequence[int] = (),
            include: Sequence[int] = ()) -> dict[str, Any]:
    """Scaling curves of a family (``analysis.scaling.scaling``)."""
    return _scaling(family, with_figures(engine, scope.visible_rows(run_store.family_runs(engine, family))),
                    device_type=device_type, signature=signature, status=status, exclude=exclude, include=include)


_SCALING_VOLATILE = ("batch", "world", "seed", "nodes", "gpus", "name", "dp")


def _config_label(device: str | None, config: dict[str, Any] | None) -> str:
    cfg = {k: v for k, v in (config or {}).items() if not any(t in k.lower() for t in _SCALING_VOLATILE)}
    items = ", ".join(f"{k}={cfg[k]}" for k in sorted(cfg))
    label = f"{device or '?'}" + (f" · {items}" if items else "")
    return label if len(label) <= 90 else label[:87] + "…"


def _median_comm_by_dim(by_run: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """{dim: {exposed_s, total_s}}: the median over runs (that recorded collectives; a run without
    the dimension counts 0) of each run's per-step figure."""
    runs = [b for b in by_run if b]
    dims = list(dict.fromkeys(d for b in runs for d in b))
    return {d: {k: float(statistics.median((b.get(d) or {}).get(k) or 0.0 for b in runs)) for k in ("exposed_s", "total_s")}
            for d in dims}


def scaling_view(engine: Engine, family: str, *, exclude: Sequence[int] = (),
                 include: Sequence[int] = ()) -> dict[str, Any]:
    """The Scaling page: per configuration of a family, throughput (measured and ideal), efficiency,
    the seconds of each component of the median step, and exposed/total communication per parallel
    dimension (``comm_by_dim``, median over the runs of a size), against world size."""
    configs = []
    res = scaling(engine, family=family, exclude=exclude, include=include)
    groups = res["groups"]
    by_dim = comm_by_dim_of_runs(engine, sorted({r for g in groups for p in g["points"] for r in p["runs"]}))
    for g in groups:
        pts = []
        for p in g["points"]:
            step = p.get("step_s")
            shares = p.get("shares") or {}
            comp = {key: (shares[k] * step if shares.get(k) is not None and step else None) for k, key in SHARE_KEYS.items()}
            pts.append({"world_size": p["world_size"], "runs": p["runs"], "run_names": p["run_names"],
                        "tokens_per_s": p.get("throughput_tokens_per_s"),
                        "ideal_tokens_per_s": p.get("ideal_throughput_tokens_per_s"),
                        "efficiency": p.get("efficiency"), "step_s": step, "mfu": p.get("mfu"), **comp,
                        "comm_by_dim": _median_comm_by_dim([by_dim.get(r) or {} for r in p["runs"]])})
        growth = g.get("growing_component")
        if pts:
            configs.append({"config": _config_label(g.get("device_type"), g.get("config")), "mode": g.get("mode") or "unknown",
                            "points": pts, "growth": growth.get("explanation") if isinstance(growth, dict) else None})
    return {"family": family, "configs": configs, "source": "analysis", "excluded": res["excluded"]}
