"""Projections (``GET /api/v1/runs/{id}/projection``, the run page's what-if panel, the scaling page's
projected curves) and their track record (``GET /api/v1/projections/track_record``): the run's figures,
collective rollup and pipeline schedule (``store``) with the cluster's busbw table (the fleet's collectives
on the same device type and ``fleetscope bench`` results), moved by ``analysis.projection``.

Every projection asked through the API is recorded (``store.projections``, migration 0023) with its first
figures; the track record compares those with the runs of the same family, signature and layout that were
measured (read time: a handful of rows and the runs' cached figures)."""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Engine

from fleetscope.wire import COLLECTIVE_OPS, busbw_factor

from ..analysis import parallel
from ..analysis import projection as pj
from ..analysis.figures import RunFigures, scaling_signature
from ..analysis.scaling import set_apart_reason
from ..store import benchmarks, collectives, events
from ..store import projections as store
from ..store import runs as run_store
from ..store.rows import RunRow
from . import scope
from .fleet import _config_label, scaling
from .runs import figures

try:  # the summary's figures are over the run's steady-state steps (reports.runs.steady_state, issue 31)
    from .runs import steady_state as _steady_state
except ImportError:  # pragma: no cover - a tree without the steady-state basis: figures over every step
    _steady_state = None  # type: ignore[assignment]

__all__ = ["run_projection", "track_record", "scaling_projections", "layout_of", "projection_signature",
           "BATCH_MODES"]

_TP_KEYS = ("tp", "tp_size", "tensor_parallel", "tensor_parallel_size", "tensor_model_parallel_size")
_PP_KEYS = ("pp", "pp_size", "pipeline_parallel", "pipeline_parallel_size", "pipeline_model_parallel_size")
_MB_KEYS = ("micro_batches", "n_microbatches", "num_microbatches", "microbatches")
_LAYOUT_KEYS = frozenset(_TP_KEYS + _PP_KEYS + _MB_KEYS)
#: ``batch=``: what is held when the layout changes
BATCH_MODES = ("per_replica", "global")
#: sizes beyond the largest measured one the scaling page projects to
BEYOND = (2, 4)
_BENCH_NAMES = ("all_reduce_busbw", "node_all_reduce_busbw")


def _int_key(config: dict[str, Any], keys: Sequence[str]) -> int | None:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


def projection_signature(config: dict[str, Any] | None) -> str:
    """The scaling signature of a config without its parallel-layout keys (tp, pp, micro-batches): the
    runs a projection of one layout can be checked against."""
    return scaling_signature({k: v for k, v in (config or {}).items() if k not in _LAYOUT_KEYS})


def _fig(engine: Engine, run: RunRow) -> RunFigures:
    """The run's figures as its summary shows them (steady-state steps where that basis exists)."""
    if _steady_state is not None:
        return _steady_state(engine, run)[0]
    return figures(engine, [run])[run.id]


def _pipeline(engine: Engine, run: RunRow, step_s: float | None) -> dict[str, Any] | None:
    evs = events.pipeline_events(engine, run.id)
    stage_evs = [(r, d) for r, k, _s, d in evs if k == "pp_stage"]
    for _r, k, _s, d in evs:
        if k == "pp_schedule":
            for _, sd in stage_evs:
                sd.setdefault("n_microbatches", d.get("n_microbatches"))
    if not stage_evs:
        return None
    return parallel.pipeline_summary(stage_evs, collectives.step_comm(engine, run.id), step_s, {})


def layout_of(run: RunRow, pipeline: dict[str, Any] | None = None) -> pj.Layout:
    """The run's parallel layout: tp / pp / micro-batches from its config, else its pipeline events and
    model-parallel size; dp is the rest of the world size."""
    cfg = run.config or {}
    world = max(1, int(run.world_size or 1))
    pp = _int_key(cfg, _PP_KEYS) or (int(pipeline["stages"]) if pipeline and pipeline.get("stages") else 1)
    tp = _int_key(cfg, _TP_KEYS)
    if tp is None:
        mp = max(1, int(run.mp_size or 1))
        tp = mp // pp if mp % pp == 0 and mp >= pp else 1
    mb = _int_key(cfg, _MB_KEYS) or (pipeline.get("microbatches") if pipeline else None)
    try:
        return pj.Layout(world, tp=tp, pp=pp, micro_batches=mb if pp > 1 else None)
    except ValueError:
        return pj.Layout(world)


def _baseline(engine: Engine, run: RunRow, fig: RunFigures) -> pj.Baseline:
    pipe = _pipeline(engine, run, fig.step_s)
    layout = layout_of(run, pipe)
    colls = tuple(pj.CommClass(c.op, c.group_size, c.bytes, c.calls, c.total_s, c.exposed_s, c.dim)
                  for c in collectives.run_collectives(engine, run.id))
    return pj.Baseline(
        run_id=run.id, layout=layout, steps=fig.steps, step_s=fig.step_s, data_s=fig.data_s, compute_s=fig.compute_s,
        comm_exposed_s=fig.comm_exposed_s, other_s=fig.other_s, comm_total_s=fig.comm_total_s,
        straggler_wait_s=fig.straggler_wait_s, step_s_p95=fig.step_s_p95, flops_per_rank_step=fig.flops_per_rank_step,
        flops_estimated=(run.meta or {}).get("flops_source") == "estimated", peak_flops=run.peak_flops,
        tokens_per_s=fig.tokens_per_s, bubble_s=(pipe or {}).get("bubble_s") if layout.pp > 1 else None,
        collectives=colls)


def _backend_of(device_type: str | None) -> str:
    return "gloo" if device_type in (None, "", "cpu", "CPU") else "nccl"


def _points(engine: Engine, device_type: str | None, exclude: Collection[int] = ()) -> list[pj.BusbwPoint]:
    """The cluster's busbw measurements for runs on ``device_type``: the visible runs' collectives (but
    ``exclude``) and the ``fleetscope bench`` all_reduce series of the matching backend (latest point)."""
    keys = scope.visible_keys()
    ids = [i for i, owner in store.device_runs(engine, device_type)
           if i not in exclude and (keys is None or owner in keys)]
    out = []
    for c in store.fleet_collectives(engine, ids):
        if c.op in ("barrier", "other") or c.op not in COLLECTIVE_OPS:
            continue
        out.append(pj.BusbwPoint(c.op, c.group_size, c.bytes / c.calls, c.bytes / c.total_s * busbw_factor(c.op, c.group_size),
                                 f"run:{c.run_id}"))
    backend = _backend_of(device_type)
    for name in _BENCH_NAMES:
        for s, pts in benchmarks.series(engine, name=name, limit_points=1, owners=keys):
            p = s.params or {}
            size, world = p.get("bytes", p.get("size_bytes")), p.get("world")
            if not pts or p.get("backend", backend) != backend or not isinstance(size, (int, float)) \
                    or not isinstance(world, int) or s.unit not in ("GB/s", "GBps"):
                continue
            out.append(pj.BusbwPoint("all_reduce", world, float(size), pts[-1][1] * 1e9, f"bench:{s.id}"))
    return out


def _family_error(engine: Engine, family: str | None) -> float | None:
    """Median |error| of this family's checked projections (None before any was checked)."""
    if not family:
        return None
    checked = _checked(engine, family)
    return statistics.median(abs(e["error"]) for e in checked) if checked else None


def run_projection(engine: Engine, run_id: int, *, world_size: int, tp: int | None = None, pp: int | None = None,
                   micro_batches: int | None = None, bucket_bytes: int | None = None, batch: str = "per_replica",
                   record: bool = True, write_engine: Engine | None = None) -> dict[str, Any] | None:
    """The run's projected step, MFU, tokens/s and parts at the target layout (``analysis.projection``;
    tp / pp default to the run's own); None for no such run. Raises ValueError for a layout that cannot
    be (world size not a multiple of tp·pp, ...). A projection that could be made is recorded for the
    track record unless ``record`` is False (with ``write_engine`` when given: the API reads on its read pool)."""
    if batch not in BATCH_MODES:
        raise ValueError(f"batch must be one of {', '.join(BATCH_MODES)}, got {batch!r}")
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    fig = _fig(engine, run)
    base = _baseline(engine, run, fig)
    b = base.layout
    target = pj.Layout(world_size, tp=tp or b.tp, pp=pp or b.pp,
                       micro_batches=micro_batches or (b.micro_batches if (pp or b.pp) > 1 else None),
                       bucket_bytes=float(bucket_bytes) if bucket_bytes else None)
    hold = batch == "global"
    out = pj.project(base, target, pj.BusbwTable(_points(engine, run.device_type)), hold_global_batch=hold,
                     track_record=_family_error(engine, run.model_family))
    sig = projection_signature(run.config)
    if record and out["status"] == "ok":
        store.record(write_engine or engine, store.ProjectionWrite(
            run_id=run.id, world_size=target.world_size, tp=target.tp, pp=target.pp,
            micro_batches=target.micro_batches or 0, bucket_bytes=int(bucket_bytes or 0), hold_global_batch=hold,
            owner_key=run.owner_key, model_family=run.model_family, signature=sig, device_type=run.device_type,
            from_world_size=b.world_size, from_tp=b.tp, from_pp=b.pp, step_s=out["step_s"], mfu=out["mfu"],
            tokens_per_s=out["tokens_per_s"], error_rel=(out["error_band"] or {}).get("relative"),
            at=dt.datetime.now(dt.UTC)))
    return {"run_id": run.id, "model_family": run.model_family, "signature": sig, "target": target.as_dict(),
            "baseline": {"layout": b.as_dict(), "step_s": fig.step_s, "mfu": fig.mfu, "tokens_per_s": fig.tokens_per_s,
                         "steps": fig.steps},
            **out,
            "note": "estimated: the run's measured parts moved to the target layout (docs/analysis.md, Projections)"}


_Key = tuple[str, str | None, int, int, int]


def _measured(engine: Engine, family: str, wanted: Collection[_Key]) -> dict[_Key, list[tuple[RunRow, RunFigures]]]:
    """The family's usable runs by (projection signature, device type, world size, tp, pp), for the keys
    ``wanted`` only (figures are read for those runs alone)."""
    out: dict[_Key, list[tuple[RunRow, RunFigures]]] = {}
    for run in scope.visible_rows(run_store.family_runs(engine, family, limit=2000)):
        lay = layout_of(run)
        key = (projection_signature(run.config), run.device_type, lay.world_size, lay.tp, lay.pp)
        if key not in wanted:
            continue
        fig = _fig(engine, run)
        if fig.step_s is None or fig.steps < pj.MIN_STEPS or set_apart_reason(run, fig) is not None:
            continue
        out.setdefault(key, []).append((run, fig))
    return out


def _checked(engine: Engine, family: str) -> list[dict[str, Any]]:
    keys = scope.visible_keys()
    rows = store.family_projections(engine, family, owners=None if keys is None else sorted(keys))
    if not rows:
        return []
    measured = _measured(engine, family, {(p.signature, p.device_type, p.world_size, p.tp, p.pp) for p in rows})
    out = []
    for p in rows:
        if p.bucket_bytes:  # a bucket size no run of the signature used: the config says the run's own
            continue
        for run, fig in measured.get((p.signature, p.device_type, p.world_size, p.tp, p.pp), []):
            if run.id == p.run_id or fig.step_s is None:
                continue
            started = dt.datetime.fromisoformat(run.started_at) if run.started_at else None
            out.append({"from_run": p.run_id, "from_world_size": p.from_world_size, "world_size": p.world_size,
                        "tp": p.tp, "pp": p.pp, "micro_batches": p.micro_batches or None,
                        "batch": "global" if p.hold_global_batch else "per_replica",
                        "projected_step_s": p.step_s, "projected_at": p.first_at.isoformat(),
                        "measured_run": run.id, "measured_name": run.name, "measured_step_s": fig.step_s,
                        "error": pj.track_error(p.step_s, fig.step_s),
                        # the run started after the projection was made: a blind check
                        "blind": bool(started and started > p.first_at)})
    return out


def track_record(engine: Engine, family: str) -> dict[str, Any]:
    """How the family's projections fared: every recorded projection checked against the measured runs
    at its layout (``checked``, with ``summary``: median and worst |error|, per world-size ratio), the
    recorded ones not checked yet (``pending``), and the back-test of the scaling page (each
    configuration projected from its smallest run to its other measured sizes without their data)."""
    keys = scope.visible_keys()
    rows = store.family_projections(engine, family, owners=None if keys is None else sorted(keys))
    checked = _checked(engine, family)
    done = {(c["from_run"], c["world_size"], c["tp"], c["pp"]) for c in checked}
    pending = [{"from_run": p.run_id, "from_world_size": p.from_world_size, "world_size": p.world_size, "tp": p.tp,
                "pp": p.pp, "projected_step_s": p.step_s, "projected_at": p.first_at.isoformat(), "requests": p.requests}
               for p in rows if (p.run_id, p.world_size, p.tp, p.pp) not in done]
    back = [b for c in scaling_projections(engine, family)["configs"] for b in c["backtest"]]
    return {"family": family, "summary": pj.error_summary(checked), "checked": checked, "pending": pending,
            "backtest": back, "backtest_summary": pj.error_summary(back),
            "note": "error = projected / measured step time − 1, measured = the run's median step"}


def scaling_projections(engine: Engine, family: str, *, exclude: Sequence[int] = (),
                        include: Sequence[int] = ()) -> dict[str, Any]:
    """Per configuration of the scaling page (same labels as ``scaling_view``): the step and throughput
    projected from its smallest run to each measured size (using no measurement of the runs at that
    size: a back-test) and to ``BEYOND`` × the largest, with error bands; ``backtest``: projected vs measured."""
    res = scaling(engine, family=family, exclude=exclude, include=include)
    configs = []
    for g in res["groups"]:
        pts_m = g["points"]
        if not pts_m:
            continue
        rid = pts_m[0]["runs"][0]
        run = run_store.get_run(engine, rid, pending=False)
        if run is None:
            continue
        base = _baseline(engine, run, _fig(engine, run))
        b = base.layout
        sizes = [p["world_size"] for p in pts_m]
        top = max(sizes)
        targets = sorted({*sizes[1:], *(top * k for k in BEYOND)})
        by_n = {p["world_size"]: p for p in pts_m}
        all_points = _points(engine, run.device_type)
        curve, backtest = [], []
        for n in targets:
            if n % (b.tp * b.pp):
                continue
            at_n = set(by_n[n]["runs"]) if n in by_n else set()
            table = pj.BusbwTable([p for p in all_points if not (p.source.startswith("run:")
                                                                 and int(p.source[4:]) in at_n)])
            out = pj.project(base, pj.Layout(n, tp=b.tp, pp=b.pp, micro_batches=b.micro_batches), table,
                             hold_global_batch=g.get("mode") == "strong")
            if out["status"] != "ok":
                curve.append({"world_size": n, "status": out["status"], "missing": out["missing"]})
                continue
            band = out["error_band"]
            curve.append({"world_size": n, "status": "ok", "step_s": out["step_s"], "tokens_per_s": out["tokens_per_s"],
                          "tokens_per_s_band": band["tokens_per_s"], "step_s_band": band["step_s"], "mfu": out["mfu"],
                          "measured": n in by_n})
            if n in by_n and by_n[n].get("step_s"):
                backtest.append({"from_run": run.id, "from_world_size": b.world_size, "world_size": n,
                                 "projected_step_s": out["step_s"], "measured_step_s": by_n[n]["step_s"],
                                 "measured_runs": by_n[n]["runs"], "error": pj.track_error(out["step_s"], by_n[n]["step_s"])})
        configs.append({"config": _config_label(g.get("device_type"), g.get("config")), "signature": g["signature"],
                        "device_type": g.get("device_type"), "from_run": run.id, "from_world_size": b.world_size,
                        "points": curve, "backtest": backtest})
    return {"family": family, "configs": configs}
