"""Reports about runs: the run list, one run, its figures and summary, bottlenecks, stragglers,
collectives, goodput, events and traces — each loaded from the store and computed by the analysis."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from sqlalchemy import Engine

from fleetscope.wire import COLLECTIVE_OPS

from ..analysis import parallel
from ..analysis.bottlenecks import bottleneck_report, data_share_ranks, data_stall_ranks, summary_bottlenecks
from ..analysis.collectives import collective_efficiency as _efficiency
from ..analysis.collectives import collective_rows
from ..analysis.compile import compile_health
from ..analysis.diagnosis import (
    consistent_bottlenecks,
    consistent_overlap_advice,
    consistent_parallel_findings,
    diagnose,
)
from ..analysis.figures import RunFigures, run_figures
from ..analysis.goodput import CHECKPOINT_KINDS, EVAL_KINDS, RESTART_KINDS, with_set_apart
from ..analysis.goodput import goodput as _goodput
from ..analysis.rollups import THRESHOLD
from ..analysis.steady import MARK_KINDS, RULE, set_apart_excess, steady_basis
from ..analysis.stragglers import (
    FALLBACK_STEPS,
    MIN_WINDOW_STEPS,
    from_blocks,
    from_rollups,
    per_step_view,
    straggler_report,
    summary_stragglers,
)
from ..groups import decode_ranks
from ..groups import members as group_members
from ..limits import MAX_GROUP_RANKS_LISTED
from ..store import aggregates, bounds, collectives, events, ranks, steps, traces
from ..store import basis as basis_store
from ..store import runs as run_store
from ..store.compile import load_compile, load_graph_collectives
from ..store.job_facts import job_facts
from ..store.rows import RankRollups, RunRow
from . import _cache
from .devices import with_device_causes
from .health import run_goodput
from .memory import run_memory
from .network import run_network
from .overlap import run_overlap_advice
from .tokens import run_token_balance

__all__ = [
    "get_run",
    "list_runs",
    "figures",
    "with_figures",
    "steady_state",
    "run_summary",
    "bottlenecks",
    "stragglers",
    "collective_efficiency",
    "run_collectives",
    "goodput",
    "run_events",
    "run_traces",
    "run_compile",
    "database_ok",
]


def get_run(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """One run as the API shows it (None when there is no such run)."""
    run = run_store.get_run(engine, run_id)
    return run.as_dict() if run is not None else None


def list_runs(engine: Engine, *, name: str | None = None, family: str | None = None, status: str | None = None,
              limit: int = 100) -> list[dict[str, Any]]:
    """Runs, newest first, optionally filtered by exact name, family or status."""
    return [r.as_dict() for r in run_store.list_runs(engine, name=name, family=family, status=status, limit=limit)]


def figures(engine: Engine, runs: Sequence[RunRow]) -> dict[int, RunFigures]:
    """The figures of these runs (``analysis.figures``): from this process's cache, else from the
    ``run_stats`` table when computed at the same counters, else from one aggregate query over the
    runs still missing (then stored in ``run_stats``)."""
    out: dict[int, RunFigures] = {}
    key = _cache.engine_key(engine)
    todo: list[RunRow] = []
    for r in runs:
        hit, fig = _cache.get((key, r.id, "figures"), r.version)
        if hit:
            out[r.id] = fig
        else:
            todo.append(r)
    if todo:
        stored = aggregates.load_cached_figures(engine, [r.id for r in todo])
        stale: list[RunRow] = []
        for r in todo:
            c = stored.get(r.id)
            fig = RunFigures.from_json(c[2]) if c is not None and (c[0], c[1]) == (r.rank_steps, r.status) else None
            if fig is None:
                stale.append(r)
            else:
                out[r.id] = fig
        if stale:
            fresh = _steady_figures(engine, stale)
            for r in stale:
                c = stored.get(r.id)
                old = RunFigures.from_json(c[2], any_version=True) if c is not None else None
                # per-step rows gone (retention) since figures of an older version were stored: keep those
                out[r.id] = old if not fresh[r.id].steps and old is not None and old.steps else fresh[r.id]
            aggregates.save_figures(engine, {r.id: (r.rank_steps, r.status, fresh[r.id].to_json())
                                             for r in stale if fresh[r.id].steps})
        for r in todo:
            _cache.put((key, r.id, "figures"), r.version, out[r.id])
    return out


def _steady_figures(engine: Engine, runs: Sequence[RunRow]) -> dict[int, RunFigures]:
    """The runs' figures over their steady-state steps (``analysis.steady``), in three queries whatever
    the number of runs: per-step times, marking events, aggregates without the set-apart steps."""
    ids = [r.id for r in runs]
    frames = basis_store.load_step_times(engine, ids)
    marks = basis_store.marking_events(engine, ids, tuple(MARK_KINDS))
    bases = {rid: steady_basis(f.steps, f["step_s"], ts=f["ts"], events=marks.get(rid, ()))
             for rid, f in frames.items()}
    aggs = aggregates.load_aggregates_without(engine, ids, {rid: b.excluded for rid, b in bases.items()})
    out: dict[int, RunFigures] = {}
    for r in runs:
        b, f = bases.get(r.id), frames.get(r.id)
        fig = run_figures(r, aggs.get(r.id), b, None if b is None or f is None else
                          set_apart_excess(b, f.steps, f["step_s"], f["data_s"]))
        if f is not None and fig.steps:
            fig = replace(fig, sum_step_all_s=float(np.nansum(f["step_s"])), sum_wait_all_s=float(np.nansum(f["wait_s"])))
        out[r.id] = fig
    return out


def steady_state(engine: Engine, run: RunRow) -> tuple[RunFigures, dict[str, Any], dict[str, float]]:
    """(the run's figures — over its steady-state steps, as every figure of the run —, the summary's
    ``basis``, {goodput category: seconds the set-apart steps took beyond a steady step})."""
    fig = figures(engine, [run])[run.id]
    return fig, fig.basis or _whole_basis(fig), dict(fig.set_apart_excess or {})


def _whole_basis(fig: RunFigures) -> dict[str, Any]:
    """``basis`` of figures stored before the steady-state basis (every step counted)."""
    return {"steps": fig.steps, "of": fig.steps, "set_apart": [], "rule": RULE,
            "fallback": "figures stored before the steady-state basis: every step counted" if fig.steps else None}


def with_figures(engine: Engine, runs: Sequence[RunRow]) -> list[tuple[RunRow, RunFigures]]:
    """The runs, each with its figures."""
    figs = figures(engine, runs)
    return [(r, figs[r.id]) for r in runs]


def _rank_inputs(engine: Engine, run: RunRow) -> tuple[RankRollups | None, dict[int, tuple[str | None, str | None]]]:
    """The run's per-rank rollups and hosts (what stragglers and data stalls are computed from)."""
    return _cache.cached("rank_inputs", engine, run, lambda: (
        ranks.rank_rollups(engine, run.id, min_window_steps=MIN_WINDOW_STEPS),
        _cache.cached("hosts", engine, run, lambda: ranks.hosts(engine, run.id))))


def _stragglers(engine: Engine, run: RunRow, fig: RunFigures, *, threshold: float = THRESHOLD, per_step: bool = False,
                max_points: int = 1000) -> dict[str, Any]:
    def compute() -> dict[str, Any]:
        roll, hosts = _rank_inputs(engine, run)
        data = from_rollups(roll) if roll is not None else from_blocks(
            steps.recent_blocks(engine, run.id, FALLBACK_STEPS), run.world_size)
        view = None
        if per_step:
            view = per_step_view(steps.load_steps(engine, run.id, ("step", "slowest_rank", "skew")), max_points)
        # time lost to stragglers is accounted over every step, as the per-rank rollups it is split by
        lost = fig if fig.sum_wait_all_s is None else replace(fig, sum_wait_s=fig.sum_wait_all_s,
                                                              sum_step_s=fig.sum_step_all_s)
        return straggler_report(run.id, world_size=run.world_size, fig=lost, hosts=hosts, data=data,
                                threshold=threshold, per_step=view, stages=_stage_of(engine, run))

    rep = _cache.cached(("stragglers", threshold, per_step, max_points), engine, run, compute)
    return with_device_causes(engine, run, rep)  # each straggler's ``cause``: its GPU's telemetry (devices.py)


def _stage_of(engine: Engine, run: RunRow) -> dict[int, int]:
    """rank → its pipeline stage (the lowest it reported in ``pp_stage`` events); empty without them."""

    def compute() -> dict[int, int]:
        out: dict[int, int] = {}
        for r, k, _s, d in events.pipeline_events(engine, run.id):
            st = d.get("stage")
            if k == "pp_stage" and isinstance(st, int):
                out[r] = min(st, out.get(r, st))
        return out

    return _cache.cached("stage_of", engine, run, compute)


def _job_facts(engine: Engine, run: RunRow) -> dict[str, Any]:
    """The job's DDP / FSDP facts as its agent recorded them (``store.job_facts``)."""
    return _cache.cached("job_facts", engine, run, lambda: job_facts(engine, run.id))


def _efficiency_of(engine: Engine, run: RunRow) -> dict[str, Any]:
    return _cache.cached("collective_efficiency", engine, run, lambda: _efficiency(
        run, collectives.run_collectives(engine, run.id), ranks.gpus_per_node(engine, run.id)))


def _bottlenecks(engine: Engine, run: RunRow, fig: RunFigures) -> dict[str, Any]:
    def compute() -> dict[str, Any]:
        roll, hosts = _rank_inputs(engine, run)
        return bottleneck_report(run.id, fig,
                                 efficiency_large_messages=_efficiency_of(engine, run)["efficiency_large_messages"],
                                 stall_ranks=data_stall_ranks(roll, hosts), stragglers=_stragglers(engine, run, fig),
                                 data_ranks=data_share_ranks(roll) if roll is not None else None)

    return _cache.cached("bottlenecks", engine, run, compute)


def run_summary(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The run summary of docs/api.md: counts, decomposition (median over steps of the cross-rank
    median), MFU, throughput, step-time percentiles, stragglers and bottlenecks; None for no such run."""
    run = run_store.get_run(engine, run_id)
    if run is None:
        return None
    fig = figures(engine, [run])[run.id]  # every figure below is on the run's steady-state basis
    meta = run.meta or {}
    d = run.as_dict()
    par = dict(parallel_summary(engine, run, fig))
    comps = summary_bottlenecks(_bottlenecks(engine, run, fig))
    balance = run_token_balance(engine, run)
    network = run_network(engine, run, _stragglers(engine, run, fig))
    raw_advice = run_overlap_advice(engine, run, fig, comps, _job_facts(engine, run))
    diag = _diagnosis(engine, run, fig, comps, raw_advice, balance, network, par.get("pipeline"))
    par["parallel_findings"] = consistent_parallel_findings(
        par["parallel_findings"], collectives.run_collectives(engine, run.id), diag)
    return {
        "run": d,
        "rank_steps": d["rank_steps"],
        "collective_records": d["collective_records"],
        "steps": fig.steps,  # every compacted step; ``basis`` says which the figures are over
        # the steps the figures are computed on and those set apart (warm-up, compile, checkpoint, eval, outliers)
        "basis": fig.basis or _whole_basis(fig),
        "decomposition": fig.decomposition,
        "phases": {**(fig.phases or {}), **par.pop("custom_phases")},
        "comm_total_s": fig.comm_total_s,
        "overlap_ratio": fig.overlap_ratio,
        "step_s_p50": fig.step_s,
        "step_s_p95": fig.step_s_p95,
        "mfu": fig.mfu,
        "hfu": fig.hfu,
        "recompute_overhead": fig.recompute_overhead,
        "mfu_flag": fig.mfu_flag,
        "hfu_flag": fig.hfu_flag,
        "mfu_estimated": meta.get("flops_source") == "estimated",
        "flops_source": meta.get("flops_source"),
        "flops_per_rank_step": flops_per_rank_step(engine, run, fig),
        "tokens_per_s": fig.tokens_per_s,
        "tokens_per_s_per_gpu": fig.tokens_per_s_per_gpu,
        "packing_efficiency": fig.packing_efficiency,
        "mem_peak_bytes": fig.mem_peak_bytes,
        "alloc_retries": fig.alloc_retries,
        "memory": run_memory(engine, run, fig),  # per-rank peaks, imbalance, fragmentation, OOMs (read fresh)
        "negative_residual_steps": fig.negative_residual_steps,
        "stragglers": summary_stragglers(_stragglers(engine, run, fig)),
        # bottlenecks, overlap_advice and parallel_findings say nothing the diagnosis contradicts
        "bottlenecks": consistent_bottlenecks(comps, diag),
        "diagnosis": diag,
        "compile": run_compile(engine, run.id),  # read fresh: events land after the steps
        # collectives only torch's Flight Recorder saw (compiled graphs, C++): counted, not timed
        "graph_collectives": run_graph_collectives(engine, run.id),
        "token_balance": balance,
        "network": network,
        "overlap_advice": consistent_overlap_advice(raw_advice, diag),
        # records folded or dropped to keep server/limits.py's bounds: {bound: n} and, per event kind,
        # "events_dropped" / "events_folded" {kind: n}
        "folded": run_folded(engine, run.id),
        # wall time split into productive steps and what was lost (init, checkpoints, eval, data stalls, hangs,
        # failures, redone steps), per run and per job (reports.health; read fresh)
        # set-apart steps' time beyond a steady step is lost time ("compile_steps", "warmup_outlier_steps")
        "goodput": with_set_apart(run_goodput(engine, run.id), fig.set_apart_excess or {}),
        **par,
    }


def _diagnosis(engine: Engine, run: RunRow, fig: RunFigures, comps: list[dict[str, Any]],
               raw_advice: list[dict[str, Any]], balance: dict[str, Any] | None,
               network: dict[str, Any] | None, pipeline: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The summary's ``diagnosis`` (``analysis.diagnosis``), cached until the run changes."""
    return _cache.cached("diagnosis", engine, run, lambda: diagnose(
        step_s=fig.step_s, shares=fig.shares, colls=collectives.run_collectives(engine, run.id),
        world_size=run.world_size, stragglers=_stragglers(engine, run, fig), token_balance=balance,
        bottlenecks=comps, overlap_items=raw_advice, network=network,
        efficiency_large_messages=_efficiency_of(engine, run)["efficiency_large_messages"],
        facts=_job_facts(engine, run), pipeline=pipeline))


def flops_per_rank_step(engine: Engine, run: RunRow, fig: RunFigures) -> dict[str, Any]:
    """The FLOPs one rank executes in one optimizer step, median over steps (docs/metrics.md): model and
    hardware, and where they came from — "given", "formula" (the PaLM formula, divided by the
    model-parallel degree), "measured" (FlopCounterMode, DTensor ops at their local shards),
    "measured_uncompiled" (a compiled model's eager module on fake tensors) — or None."""
    meta_source = (run.meta or {}).get("flops_source")
    source = "formula" if meta_source == "estimated" else meta_source
    if source == "measured":
        ev_source, method = events.flops_method(engine, run.id)
        if method == "uncompiled_fake":
            source = "measured_uncompiled"
        elif ev_source is None and fig.flops_per_rank_step is None:
            source = None  # nothing was measured (e.g. a compiled model whose inputs were never seen)
    return {"model": fig.flops_per_rank_step, "hardware": fig.hw_flops_per_rank_step, "source": source}


_PIPELINE_STEPS = 200  # recent steps the per-stage figures are taken over


def parallel_summary(engine: Engine, run: RunRow, fig: RunFigures) -> dict[str, Any]:
    """``comm_by_dim``, ``pipeline`` and ``parallel_findings`` of the summary (``analysis.parallel``), over
    the steady-state steps of the run's figures (``fig.set_apart_steps`` left out)."""

    def compute() -> dict[str, Any]:
        skip = set(fig.set_apart_steps or ())
        rows = [r for r in collectives.step_comm(engine, run.id) if r.step not in skip]
        by_dim = parallel.comm_by_dim(rows)
        evs = events.pipeline_events(engine, run.id)  # bounded: ≤ MAX_EVENTS_PER_KIND of each, fields projected
        stage_evs = [(r, d) for r, k, _s, d in evs if k == "pp_stage"]
        for _r, k, _s, d in evs:
            if k == "pp_schedule":  # the schedule's micro-batches and name apply to every stage
                for _, sd in stage_evs:
                    sd.setdefault("n_microbatches", d.get("n_microbatches"))
                    sd.setdefault("schedule", d.get("schedule"))
        pipeline = None
        if stage_evs:
            stage_of: dict[int, int] = {}
            for r, d in stage_evs:
                st = d.get("stage")
                if isinstance(st, int):
                    stage_of[r] = min(st, stage_of.get(r, st))
            blocks = [b for b in steps.recent_comm_blocks(engine, run.id, _PIPELINE_STEPS) if b[0] not in skip]
            per_stage = parallel.stage_figures(stage_of, blocks, [COLLECTIVE_OPS.index("send"), COLLECTIVE_OPS.index("recv")])
            pipeline = parallel.pipeline_summary(stage_evs, rows, fig.step_s, per_stage)
        spans = _group_spans(engine, run.id)
        top_ops: dict[str, str] = {}
        best: dict[str, float] = {}
        for c in collectives.run_collectives(engine, run.id):
            dim = parallel.dim_label(c.dim, c.group_size, run.world_size)
            if c.exposed_s > best.get(dim, -1.0):
                best[dim] = c.exposed_s
                top_ops[dim] = c.op
        findings = parallel.dim_findings(by_dim, fig.step_s, spans, top_ops, pipeline)
        for dim, v in by_dim.items():
            if dim in spans:
                v["nodes"] = spans[dim]
        return {"comm_by_dim": by_dim, "pipeline": pipeline, "parallel_findings": findings,
                "custom_phases": collectives.custom_phases(engine, run.id),
                "seq_len_hist": parallel.seq_len_histogram(events.seq_len_bins(engine, run.id))}

    return _cache.cached("parallel", engine, run, compute)


def _hosts(engine: Engine, run_id: int) -> dict[int, tuple[str | None, str | None]]:
    # one read of the run's ranks per run version, shared by the stragglers, network and group spans
    return _cache.cached_by_id("hosts", engine, run_id, lambda: ranks.hosts(engine, run_id))


#: ranks looked up to find the nodes the run's groups span, all dimensions together (a real job's
#: groups of one dimension partition its ranks: ≤ 262,144 per dimension); beyond it, a lower bound
_SPAN_RANKS = 1 << 24


def _group_spans(engine: Engine, run_id: int) -> dict[str, int]:
    """{dim: the most nodes one of its groups spans} from ``run_groups`` (bounded by MAX_GROUPS_PER_RUN rows
    and ``_SPAN_RANKS`` ranks, rank lists read a chunk at a time); for a run stored before run_groups,
    from the first ``comm_group`` events an older server kept in ``run_events`` (hard LIMIT)."""
    node_of = parallel.node_index(_hosts(engine, run_id))
    rows = events.group_rows(engine, run_id)
    if not rows:
        legacy = events.legacy_groups(engine, run_id)
        return parallel.group_spans(((d, np.asarray(r, dtype=np.int64)) for d, r in legacy), node_of)
    return parallel.group_spans(_stored_groups(engine, run_id, rows), node_of)


def _stored_groups(engine: Engine, run_id: int, rows: list[events.GroupRow]) -> Iterator[tuple[str, np.ndarray]]:
    """(dim, ranks) of the stored groups, each dimension's share of ``_SPAN_RANKS`` at most."""
    by_dim: dict[str, list[events.GroupRow]] = {}
    for row in rows:
        by_dim.setdefault(row[0], []).append(row)
    budget = _SPAN_RANKS // max(len(by_dim), 1)
    for dim, grs in by_dim.items():
        left = budget
        listed: list[bytes] = []
        for _dim, key, size, start, stride, n_listed, has_list in grs:
            n = n_listed if has_list else size
            if n > left:
                continue
            left -= n
            if has_list:
                listed.append(key)
            else:
                yield dim, group_members(start, stride, size, None, size)
        for _key, blob in events.group_ranks(engine, run_id, dim, listed):
            yield dim, decode_ranks(blob, MAX_GROUP_RANKS_LISTED)


def run_limits(engine: Engine, run_id: int) -> dict[str, dict[str, int]]:
    """Events dropped beyond the run's caps and events stored folded, per kind (read fresh: events land
    after the steps that version the cached parts)."""
    return events.event_limits(engine, run_id)


def run_folded(engine: Engine, run_id: int) -> dict[str, Any]:
    """The summary's ``folded``: {bound: records folded or dropped} of server/limits.py's bounds, and
    ``events_dropped`` / ``events_folded`` {kind: n} (two small indexed reads, never cached)."""
    return {**bounds.folded(engine, run_id), **run_limits(engine, run_id)}


def bottlenecks(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The bottleneck report (components ranked by Amdahl ceiling, findings); None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)  # landed-but-uncompacted counts unused
    if run is None:
        return None
    return _bottlenecks(engine, run, figures(engine, [run])[run.id])


def stragglers(engine: Engine, run_id: int, *, threshold: float = THRESHOLD, per_step: bool = False,
               max_points: int = 1000) -> dict[str, Any] | None:
    """The straggler report (``analysis.stragglers``); ``per_step`` adds the slowest rank and skew of each
    step (the worst step of each bucket beyond ``max_points``). None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)  # landed-but-uncompacted counts unused
    if run is None:
        return None
    return _stragglers(engine, run, figures(engine, [run])[run.id], threshold=threshold, per_step=per_step,
                       max_points=max_points)


def collective_efficiency(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """busbw and efficiency against the declared link peaks (``analysis.collectives``); None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)  # landed-but-uncompacted counts unused
    return _efficiency_of(engine, run) if run is not None else None


def run_collectives(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """The run's collectives by op × group × message size × dimension with algbw/busbw, most time first."""
    run = run_store.get_run(engine, run_id, pending=False)
    ws = run.world_size if run is not None else None
    rows = collectives.run_collectives(engine, run_id)
    return [{**row, "dim": parallel.dim_label(c.dim, c.group_size, ws)}
            for c, row in zip(rows, collective_rows(rows), strict=True)]


def goodput(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """Goodput and badput by cause (``analysis.goodput``); None for no such run."""
    times = run_store.run_times(engine, run_id)
    if times is None:
        return None
    frame = steps.load_steps(engine, run_id, ("step", "ts", "step_s", "data_s"))
    run = run_store.get_run(engine, run_id, pending=False)
    return _goodput(run_id, times[0], times[1], frame,
                    events.job_events(engine, run_id, (*CHECKPOINT_KINDS, *EVAL_KINDS, *RESTART_KINDS)),
                    set_apart_s=figures(engine, [run])[run.id].set_apart_excess if run is not None else None)


def run_events(engine: Engine, run_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """Run events (checkpoints, evals, restarts, ...) in time order."""
    return events.run_events(engine, run_id, limit)


def run_traces(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """The run's trace summaries (imported and sampled), ranks ascending."""
    return traces.run_traces(engine, run_id)


def run_compile(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """torch.compile health (``analysis.compile``): compiles, recompiles, graph breaks, compile time,
    top reasons, steps that recompiled; None when the run has no compile events. Not cached (one
    query): its events are not part of ``RunRow.version``."""
    rows = load_compile(engine, run_id)
    return compile_health(rows.totals, rows.reasons, rows.recompile_steps, rows.replays, has_events=rows.has_events)


def run_graph_collectives(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """Collectives only torch's Flight Recorder saw (inside compiled graphs, or from C++), summed over
    ranks and steps (``store.compile.load_graph_collectives``); counted, not timed. Not cached."""
    return load_graph_collectives(engine, run_id)


def database_ok(engine: Engine) -> None:
    """One round trip to the database; raises when it is unreachable."""
    run_store.ping(engine)
