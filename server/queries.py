"""The query layer: every number the API and the dashboard show is computed here, once.

Summaries read the per-step rollup columns of ``steps`` (one row per step, written by the
compactor) and the per-run counters — never a scan of raw per-rank rows. Rows that landed but are
not compacted yet (seconds old) are counted, deduplicated, from the small raw tables.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from fleetscope.wire import COLLECTIVE_OPS, busbw_factor

from .analysis.bottlenecks import run_bottlenecks, summary_bottlenecks
from .analysis.stragglers import run_stragglers, summary_stragglers
from .codec import FRAG_COLL_FIELDS, FRAG_STEP_FIELDS, STEP_BLOCK_FIELDS, decode_block

__all__ = ["list_runs", "get_run", "run_summary", "run_steps", "run_collectives", "rank_step_matrix"]

_RUN_COLS = (
    "id, name, model_family, config, config_signature, world_size, mp_size, device_type, device_count, peak_flops, "
    "git_commit, status, meta, started_at, finished_at, last_seen_at, rank_steps, collective_records, steps, last_step"
)


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, dt.datetime) else v


def _run_dict(row: Any) -> dict[str, Any]:
    d = {k: _iso(v) for k, v in row._mapping.items()}
    return d


def _raw_counts(c: Any, run_ids: list[int]) -> dict[int, tuple[int, int]]:
    """(rank_steps, collectives) landed but not compacted yet, deduplicated, excluding copies already
    in a step block. A collective of a step whose block already holds that rank's collectives is
    taken as a copy (a retry); a genuinely late one is counted once the compactor (≤ 1 s) merges it."""
    out: dict[int, tuple[int, int]] = {}
    if not run_ids:
        return out
    frags = c.execute(
        text("SELECT run_id, rank_steps, collectives FROM ingest_fragments WHERE run_id = ANY(:ids)"), {"ids": run_ids}
    ).fetchall()
    by_run: dict[int, list[Any]] = {}
    for f in frags:
        by_run.setdefault(f[0], []).append(f)
    for run_id, fs in by_run.items():
        s_keys, c_keys = [], []
        for _, rs, cs in fs:
            if rs is not None:
                d = decode_block(FRAG_STEP_FIELDS, rs)
                s_keys.append(d["step"] * (1 << 24) + d["rank"])
            if cs is not None:
                d = decode_block(FRAG_COLL_FIELDS, cs)
                c_keys.append(np.stack([d["step"], d["rank"], d["seq"]], axis=1))
        sk = np.unique(np.concatenate(s_keys)) if s_keys else np.empty(0, dtype=np.int64)
        ck = np.unique(np.concatenate(c_keys), axis=0) if c_keys else np.empty((0, 3), dtype=np.int64)
        steps = np.union1d(sk >> 24, ck[:, 0])
        present: dict[int, tuple[str, int]] = {}
        if len(steps):
            for step, bits, n_coll in c.execute(
                text("SELECT step, ranks::text, coll_records FROM steps WHERE run_id = :r AND step = ANY(:s)"),
                {"r": run_id, "s": steps.tolist()},
            ):
                present[step] = (bits, n_coll)

        def _in_block(step: int, rank: int, need_coll: bool, present: dict[int, tuple[str, int]] = present) -> bool:
            p = present.get(step)
            if p is None or (need_coll and p[1] == 0):
                return False
            return rank < len(p[0]) and p[0][rank] == "1"

        n_s = sum(1 for k in sk.tolist() if not _in_block(k >> 24, k & 0xFFFFFF, False))
        n_c = sum(1 for st, rk, _ in ck.tolist() if not _in_block(st, rk, True))
        out[run_id] = (n_s, n_c)
    return out


def list_runs(
    engine: Engine, *, name: str | None = None, family: str | None = None, status: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Runs, newest first, optionally filtered by exact name, family or status."""
    where, params = [], {"limit": max(1, min(limit, 10_000))}
    if name:
        where.append("name = :name")
        params["name"] = name
    if family:
        where.append("model_family = :family")
        params["family"] = family
    if status:
        where.append("status = :status")
        params["status"] = status
    sql = f"SELECT {_RUN_COLS} FROM runs {'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY started_at DESC, id DESC LIMIT :limit"
    with engine.connect() as c:
        rows = [_run_dict(r) for r in c.execute(text(sql), params)]
        pending = _raw_counts(c, [r["id"] for r in rows if r["status"] == "running"])
    for r in rows:
        extra = pending.get(r["id"], (0, 0))
        r["rank_steps"] += extra[0]
        r["collective_records"] += extra[1]
    return rows


def get_run(engine: Engine, run_id: int) -> dict[str, Any] | None:
    with engine.connect() as c:
        row = c.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE id = :id"), {"id": run_id}).fetchone()
        if row is None:
            return None
        d = _run_dict(row)
        extra = _raw_counts(c, [run_id]).get(run_id, (0, 0))
    d["rank_steps"] += extra[0]
    d["collective_records"] += extra[1]
    return d


def _median(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(np.median(x)) if x.size else None


def _pct(x: np.ndarray, q: float) -> float | None:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else None


def run_steps(engine: Engine, run_id: int, columns: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Per-step rollup columns of a run, as numpy arrays ordered by step (NaN = not measured)."""
    cols = columns or (
        "step", "n_ranks", "ts", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s",
        "forward_s", "backward_s", "optimizer_s", "step_s_max", "work_s", "work_s_max", "slowest_rank", "tokens",
        "padded_tokens", "samples", "flops", "mem_peak_bytes", "mem_reserved_bytes", "alloc_retries", "neg_residual",
    )  # fmt: skip
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT {', '.join(cols)} FROM steps WHERE run_id = :id AND n_ranks > 0 ORDER BY step"), {"id": run_id}
        ).fetchall()
    if not rows:
        return {k: np.empty(0) for k in cols}
    arr = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64)
    return {k: arr[:, i] for i, k in enumerate(cols)}


def run_summary(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The run summary of docs/api.md: counts, decomposition (median over steps of the cross-rank
    median), MFU, throughput, step-time percentiles; analysis lists filled by the analysis layer."""
    run = get_run(engine, run_id)
    if run is None:
        return None
    s = run_steps(engine, run_id)
    decomposition = {k: _median(s[k]) for k in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s")}
    comm_total = _median(s["comm_total_s"])
    exposed = decomposition["comm_exposed_s"]
    overlap = None
    if comm_total and exposed is not None and comm_total > 0:
        overlap = 1.0 - exposed / comm_total
    mfu = None
    peak = run.get("peak_flops")
    with np.errstate(invalid="ignore", divide="ignore"):
        if peak and s["flops"].size:
            per_step = s["flops"] / (s["n_ranks"] * s["step_s"] * peak)
            mfu = _median(per_step)
        tokens_per_s = _median(s["tokens"] / max(1, run.get("mp_size") or 1) / s["step_s"]) if s["tokens"].size else None
        packing = None
        if s["padded_tokens"].size and np.nansum(s["padded_tokens"]) > 0:
            packing = float(np.nansum(s["tokens"]) / np.nansum(s["padded_tokens"]))
    meta = run.get("meta") or {}
    n_dev = run.get("world_size") or 1
    return {
        "run": run,
        "rank_steps": run["rank_steps"],
        "collective_records": run["collective_records"],
        "steps": int(s["step"].size),
        "decomposition": decomposition,
        "comm_total_s": comm_total,
        "overlap_ratio": overlap,
        "step_s_p50": _pct(s["step_s"], 50),
        "step_s_p95": _pct(s["step_s_max"], 95),
        "mfu": mfu,
        "mfu_estimated": meta.get("flops_source") == "estimated",
        "flops_source": meta.get("flops_source"),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": (tokens_per_s / n_dev) if tokens_per_s is not None else None,
        "packing_efficiency": packing,
        "mem_peak_bytes": float(np.nanmax(s["mem_peak_bytes"])) if np.any(~np.isnan(s["mem_peak_bytes"])) else None,
        "alloc_retries": float(np.nansum(s["alloc_retries"])) if s["alloc_retries"].size else None,
        "negative_residual_steps": int(np.nansum(s["neg_residual"])),
        "stragglers": summary_stragglers(st_report := run_stragglers(engine, run_id)),
        "bottlenecks": summary_bottlenecks(
            run_bottlenecks(engine, run_id, steps=s, stragglers=st_report, summary={"run": run, "mfu": mfu})
        ),
    }


def run_collectives(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Collectives of a run by (op, group size, message-size bucket) with algbw/busbw (docs/metrics.md)."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT op, group_size, size_bucket, records, calls, bytes, total_s, exposed_s FROM run_collectives "
                "WHERE run_id = :id ORDER BY total_s DESC"
            ),
            {"id": run_id},
        ).fetchall()
    out = []
    for op_code, n, bucket, records, calls, nbytes, total_s, exposed_s in rows:
        op = COLLECTIVE_OPS[op_code] if 0 <= op_code < len(COLLECTIVE_OPS) else "other"
        algbw = nbytes / total_s if total_s > 0 else None
        out.append(
            {
                "op": op,
                "group_size": n,
                "size_bucket_bytes": 2**bucket,
                "records": records,
                "calls": calls,
                "bytes": nbytes,
                "total_s": total_s,
                "exposed_s": exposed_s,
                "algbw_bytes_per_s": algbw,
                "busbw_bytes_per_s": algbw * busbw_factor(op, n) if algbw is not None else None,
            }
        )
    return out


def rank_step_matrix(
    engine: Engine, run_id: int, field: str = "step_s", *, step_lo: int = 0, step_hi: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, ranks, values[step, rank]) of one per-rank field from the compacted blocks."""
    names = {n for n, _ in STEP_BLOCK_FIELDS}
    if field not in names and field != "work_s":
        raise ValueError(f"unknown rank-step field {field!r}")
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT step, block FROM steps WHERE run_id = :id AND step >= :lo AND (CAST(:hi AS integer) IS NULL OR step < :hi) "
                "AND n_ranks > 0 ORDER BY step"
            ),
            {"id": run_id, "lo": step_lo, "hi": step_hi},
        ).fetchall()
        ws = c.execute(text("SELECT world_size FROM runs WHERE id = :id"), {"id": run_id}).scalar() or 1
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    mat = np.full((len(rows), int(ws)), np.nan)
    for i, (_, block) in enumerate(rows):
        d = decode_block(STEP_BLOCK_FIELDS, block)
        v = d["step_s"] - np.nan_to_num(d["comm_exposed_s"]) if field == "work_s" else d[field]
        ok = d["rank"] < ws
        mat[i, d["rank"][ok]] = v[ok]
    return steps, np.arange(int(ws)), mat
