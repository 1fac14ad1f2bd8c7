"""The job's data-parallel facts as the agent recorded them (``agent/parallel_facts.py``): the lowest
reporting rank's first ``ddp`` or ``fsdp`` run event, numbers only (what the advice checks against:
DDP's bucket cap, first bucket, gradient-as-bucket-view and largest gradient tensor; FSDP's unit sizes).

Event data is free-form JSONB: each field is kept only when it is a JSON number (booleans: a JSON
boolean) within its bound, so a malformed or oversized event cannot fail the read or mislead the advice.
One indexed read with LIMIT 1 per kind; runs whose agent did not send the event get None.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text

__all__ = ["job_facts", "device_total_bytes", "DDP_FIELDS", "FSDP_FIELDS"]

_MAX_BYTES = float(1 << 50)  # 1 PiB: larger is not a gradient
_MAX_COUNT = float(1 << 31)
#: field -> ("number", upper bound) or ("boolean", None)
DDP_FIELDS: dict[str, tuple[str, float | None]] = {
    "bucket_cap_bytes": ("number", _MAX_BYTES), "first_bucket_bytes": ("number", _MAX_BYTES),
    "gradient_as_bucket_view": ("boolean", None), "params": ("number", _MAX_COUNT),
    "grad_bytes": ("number", _MAX_BYTES), "largest_grad_bytes": ("number", _MAX_BYTES),
    "buckets_estimated": ("number", _MAX_COUNT), "find_unused_parameters": ("boolean", None),
    "static_graph": ("boolean", None),
}
FSDP_FIELDS: dict[str, tuple[str, float | None]] = {
    "units": ("number", _MAX_COUNT), "params": ("number", _MAX_COUNT), "largest_unit_bytes": ("number", _MAX_BYTES),
    "smallest_unit_bytes": ("number", _MAX_BYTES), "root_bytes": ("number", _MAX_BYTES),
}


def _project(fields: dict[str, tuple[str, float | None]]) -> str:
    cols = []
    for name, (typ, hi) in fields.items():
        v = f"data -> '{name}'"
        if typ == "boolean":
            cols.append(f"CASE WHEN jsonb_typeof({v}) = 'boolean' THEN ({v})::text::boolean END")
        else:
            cols.append(f"CASE WHEN jsonb_typeof({v}) = 'number' THEN CASE WHEN ({v})::numeric BETWEEN 0 AND {hi:.0f} "
                        f"THEN ({v})::numeric::float8 END END")
    return ", ".join(cols)


def _one(engine: Engine, run_id: int, kind: str, fields: dict[str, tuple[str, float | None]]) -> dict[str, Any] | None:
    with engine.connect() as c:
        row = c.execute(
            text(f"SELECT {_project(fields)} FROM run_events WHERE run_id = :id AND kind = :kind "
                 "AND jsonb_typeof(data) = 'object' ORDER BY rank, seq LIMIT 1"),
            {"id": run_id, "kind": kind},
        ).one_or_none()
    if row is None:
        return None
    out: dict[str, Any] = {}
    for (name, (typ, _hi)), v in zip(fields.items(), row, strict=True):
        if v is None:
            continue
        out[name] = bool(v) if typ == "boolean" else (int(v) if float(v).is_integer() else float(v))
    return out


#: the device's memory as ranks report it: ``device_total_bytes`` of their ``memory`` / ``memory_modules``
#: events (the smallest over ranks binds: advice that adds memory must fit on every rank's device)
_DEVICE_TOTAL = text(
    "SELECT min(CASE WHEN jsonb_typeof(data -> 'device_total_bytes') = 'number' THEN CASE WHEN "
    "(data -> 'device_total_bytes')::numeric BETWEEN 1 AND 1e15 THEN (data -> 'device_total_bytes')::numeric::float8 "
    "END END) FROM run_events WHERE run_id = :id AND kind IN ('memory', 'memory_modules') "
    "AND jsonb_typeof(data) = 'object'"
)


def device_total_bytes(engine: Engine, run_id: int) -> float | None:
    """One device's memory (bytes) as the run's ranks reported it (the smallest); None when none did."""
    with engine.connect() as c:
        v = c.execute(_DEVICE_TOTAL, {"id": run_id}).scalar()
    return float(v) if v is not None else None


def job_facts(engine: Engine, run_id: int) -> dict[str, dict[str, Any] | None]:
    """``{"ddp": {...} | None, "fsdp": {...} | None, "memory": {"device_total_bytes"} | None}`` (fields:
    ``DDP_FIELDS`` / ``FSDP_FIELDS``, each present only when recorded and within bounds; ``memory``: the
    device's memory when a rank reported it, :func:`device_total_bytes`)."""
    total = device_total_bytes(engine, run_id)
    return {"ddp": _one(engine, run_id, "ddp", DDP_FIELDS), "fsdp": _one(engine, run_id, "fsdp", FSDP_FIELDS),
            "memory": {"device_total_bytes": total} if total is not None else None}
