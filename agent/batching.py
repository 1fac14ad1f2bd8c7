"""Wire batches as the agent builds and reshapes them: columnar batches from queued records, their
record count, halves (413), the batch without one record (422), and their encoding.

Pure functions over ``fleetscope.wire`` batches (docs/api.md, "Ingest"); no I/O, no state.
"""

from __future__ import annotations

import math
from typing import Any

from fleetscope.wire import SECTIONS, WIRE_VERSION, encode_batch

__all__ = [
    "Batch",
    "Item",
    "SECTION_KEYS",
    "build_batch",
    "batch_records",
    "split_batch",
    "without_record",
    "encode",
]

Batch = dict[str, Any]
"""A wire batch: ``{"v", "run_id", <columnar sections>, "ranks", "events"}`` (fleetscope.wire)."""
Item = tuple[str, Any]
"""What the training thread queued: ``(kind, record)``, a tuple in wire field order or a dict."""

SECTION_KEYS: tuple[str, ...] = (*SECTIONS, "ranks", "events", "records")
"""The keys of a batch that hold records: columnar sections (dicts of columns), then lists."""
_ROW_KINDS = {kind: (section, fields) for section, (kind, fields) in SECTIONS.items()}
_REQUIRED = {
    section: tuple((i, f.type == "float") for i, f in enumerate(fields) if f.required)
    for section, (_, fields) in SECTIONS.items()
}


def _good_row(row: Any, width: int, required: tuple[tuple[int, bool], ...]) -> bool:
    if not isinstance(row, (tuple, list)) or len(row) != width:
        return False
    for i, is_float in required:
        v = row[i]
        if v is None or (is_float and isinstance(v, float) and not math.isfinite(v)):
            return False
    return True


def _finite_or_none(col: tuple[Any, ...]) -> list[Any]:
    """Optional float columns: NaN/inf mean "not measured" (the server rejects non-finite numbers)."""
    out = list(col)
    for i, v in enumerate(out):
        if isinstance(v, float) and not math.isfinite(v):
            out[i] = None
    return out


def build_batch(items: list[Item]) -> tuple[Batch, int, dict[str, int]]:
    """Columnar wire batch (``run_id`` None) from queued (kind, record) items, order kept.

    Returns (batch, records in it, dropped by reason). All-None columns are omitted; rows of the wrong
    width or with a missing/non-finite required value are dropped as "malformed".
    """
    rows: dict[str, list[Any]] = {kind: [] for kind in _ROW_KINDS}
    ranks: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    dropped: dict[str, int] = {}
    for kind, rec in items:
        lst = rows.get(kind)
        if lst is not None:
            lst.append(rec)
        elif kind == "rank" and isinstance(rec, dict):
            ranks.append(rec)
        elif kind == "event" and isinstance(rec, dict):
            events.append(rec)
        else:
            reason = "malformed" if kind in ("rank", "event") else "unknown_kind"
            dropped[reason] = dropped.get(reason, 0) + 1
    batch: Batch = {"v": WIRE_VERSION, "run_id": None}
    n = 0
    for kind, (section, fields) in _ROW_KINDS.items():
        rs = rows[kind]
        if not rs:
            continue
        required = _REQUIRED[section]
        width = len(fields)
        if any(isinstance(r, tuple) and len(r) < width for r in rs):
            # a row made for an older field list: the optional fields added since are not measured
            first_req = max((i for i, _ in required), default=-1)
            rs = [r + (None,) * (width - len(r)) if isinstance(r, tuple) and first_req < len(r) < width else r for r in rs]
        good = [r for r in rs if _good_row(r, width, required)]
        if len(good) < len(rs):
            dropped["malformed"] = dropped.get("malformed", 0) + len(rs) - len(good)
        if not good:
            continue
        cols: dict[str, list[Any]] = {}
        for f, col in zip(fields, zip(*good, strict=True), strict=True):
            if any(v is not None for v in col):  # an all-None column means "not measured": omit it
                cols[f.name] = _finite_or_none(col) if f.type == "float" and not f.required else list(col)
        batch[section] = cols
        n += len(good)
    if ranks:
        batch["ranks"] = ranks
        n += len(ranks)
    if events:
        batch["events"] = events
        n += len(events)
    return batch, n, dropped


def batch_records(batch: Batch) -> int:
    """Records in a wire batch (columnar sections, ranks, events, row-form records)."""
    n = 0
    for key in SECTION_KEYS:
        v = batch.get(key)
        if not v:
            continue
        if isinstance(v, dict):
            n += len(next(iter(v.values()), ()))
        else:
            n += len(v)
    return n


def split_batch(batch: Batch) -> tuple[Batch, Batch]:
    """Two batches holding the first and the second half of ``batch``'s records, order kept."""
    k = batch_records(batch) // 2
    a = {key: v for key, v in batch.items() if key not in SECTION_KEYS}
    b = dict(a)
    for key in SECTION_KEYS:
        v = batch.get(key)
        if not v:
            continue
        if isinstance(v, dict):
            m = len(next(iter(v.values()), []))
            take = min(m, k)
            if take:
                a[key] = {c: col[:take] for c, col in v.items()}
            if take < m:
                b[key] = {c: col[take:] for c, col in v.items()}
        else:
            m = len(v)
            take = min(m, k)
            if take:
                a[key] = v[:take]
            if take < m:
                b[key] = v[take:]
        k -= take
    return a, b


def without_record(batch: Batch, section: object, index: object) -> Batch | None:
    """``batch`` minus record ``index`` of ``section`` (as the server's 422 ``loc`` names it), or None
    when that record is not in the batch."""
    if section not in SECTION_KEYS or isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return None
    key = str(section)
    records = batch.get(key)
    out = dict(batch)
    if isinstance(records, dict):
        if not records or index >= len(next(iter(records.values()))):
            return None
        cols = {c: v[:index] + v[index + 1 :] for c, v in records.items()}
        if next(iter(cols.values())):
            out[key] = cols
        else:
            del out[key]
    elif isinstance(records, list) and index < len(records):
        rest = records[:index] + records[index + 1 :]
        if rest:
            out[key] = rest
        else:
            del out[key]
    else:
        return None
    return out


def encode(batch: Batch, encoding: str = "gzip") -> tuple[bytes, dict[str, str]]:
    """``wire.encode_batch``; values msgpack cannot pack (numpy scalars, ...) are made plain first."""
    try:
        return encode_batch(batch, encoding=encoding)
    except TypeError:
        import msgpack

        from .spool import to_plain

        plain = msgpack.unpackb(msgpack.packb(batch, use_bin_type=True, default=to_plain), raw=False)
        return encode_batch(plain, encoding=encoding)
