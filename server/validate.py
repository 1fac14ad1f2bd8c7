"""Validation of ingest batches into numpy columns; every error names the record and field.

Vectorised: a batch of 100k records is checked with a handful of numpy passes; Python loops run
only over the offending positions (to find the first bad index and its value).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.wire import COLLECTIVE_OPS, SECTIONS, WIRE_VERSION, Field

from . import device_wire, health_wire, scalars_wire
from .groups import Group, from_progression, from_ranks
from .jsonsafe import MAX_ITEMS, UnsafeValue, check_json, check_text
from .limits import (
    MAX_COLLECTIVES_PER_RANK_STEP,
    MAX_EVENT_VALUES,
    MAX_GROUP_RANKS_LISTED,
    MAX_HIST_BINS,
    MAX_HIST_COUNT,
    MAX_MEMORY_MODULES_VALUES,
    MAX_MICROBATCHES,
    MAX_PIPELINE_STAGES,
    MAX_REASON_CHARS,
    MAX_TRACE_SUMMARY_VALUES,
)

__all__ = ["BatchError", "ValidBatch", "validate_batch", "location", "OP_CODE"]

OP_CODE = {op: i for i, op in enumerate(COLLECTIVE_OPS)}
_MAX_INT32 = 2**31 - 1
_MAX_FLOAT = 1e30  # durations/counts beyond this are garbage, not measurements
_TOP_KEYS = {"v", "run_id", "sent_at", "records", "ranks", "events", *SECTIONS}
_RANK_KEYS = {"rank", "host", "node", "local_rank", "device"}
_EVENT_KEYS = {"rank", "seq", "kind", "ts", "step", "data"}


class BatchError(ValueError):
    """A batch that cannot be accepted; ``status`` is the HTTP status, ``where`` locates the value."""

    def __init__(self, where: str, message: str, *, status: int = 422, got: Any = None) -> None:
        self.where = where
        self.message = message
        self.status = status
        self.got = got
        super().__init__(f"{where}: {message}")

    def detail(self) -> dict[str, Any]:
        d: dict[str, Any] = {"error": f"{self.where}: {self.message}", "where": self.where, "loc": location(self.where)}
        if self.got is not None:
            d["got"] = _short(self.got)
        return d


_RECORD_SECTIONS = frozenset({*SECTIONS, "records", "ranks", "events"})


def location(where: str) -> dict[str, Any]:
    """``where`` as this module writes it ("rank_steps.step_s[7]", "records[3].step_s", "ranks[2]",
    "events[0].data.x", "run_id") taken apart, so that clients need not parse it: ``{"section",
    "index", "field"}`` = the batch key holding the bad record (None: a top-level field), the record's
    index in it (None: no single record is at fault) and the field (None: the whole record/section)."""
    head, _, rest = where.partition(".")
    name, bracket, idx = head.partition("[")
    if name not in _RECORD_SECTIONS:  # a top-level field ("run_id", "v", ...) or the whole batch
        return {"section": None, "index": None, "field": None if where in ("batch", "") else where}
    field_name: str | None
    if bracket:  # records[3].step_s, ranks[0].host, events[0].data.x: the index follows the section
        field_name = rest.partition(".")[0].partition("[")[0] or None
    else:  # rank_steps.step_s[7]: the index follows the column
        field_name, _, idx = rest.partition("[")
        field_name = field_name or None
    idx = idx.partition("]")[0]
    return {"section": name, "index": int(idx) if idx.isascii() and idx.isdigit() else None, "field": field_name}


def _short(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


@dataclass
class ValidBatch:
    run_id: int
    rank_steps: dict[str, np.ndarray] = field(default_factory=dict)
    collectives: dict[str, np.ndarray] = field(default_factory=dict)
    modality_tokens: dict[str, np.ndarray] = field(default_factory=dict)
    phases: dict[str, np.ndarray] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: events for ``run_events`` (rank, seq, kind, ts, step, data, folded: data was cut to a bound)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: ``comm_group`` descriptions: each distinct group once, with how many descriptions of it came
    groups: list[tuple[Group, int]] = field(default_factory=list)

    def count(self, section: str) -> int:
        cols = getattr(self, section)
        return 0 if not cols else len(cols["rank"])

    @property
    def n_group_descriptions(self) -> int:
        return sum(n for _, n in self.groups)

    @property
    def n_records(self) -> int:
        return sum(self.count(s) for s in SECTIONS) + len(self.ranks) + len(self.events) + self.n_group_descriptions


_INT32_FIELDS = {"rank", "step", "seq", "group_size", "calls", "flags"}
_NUMBER_TYPES = frozenset({int, float, type(None)})
_MAX_UNIX_TS = 1e11  # unix seconds (year ~5100): larger is not a time


def _max_of(f: Field) -> float:
    if f.name in _INT32_FIELDS:
        return float(_MAX_INT32)
    if f.name in ("ts", "start_ts"):
        return _MAX_UNIX_TS
    if f.type == "int":
        return 2.0**62
    return _MAX_FLOAT


def _loc(section: str, idx: int, name: str, index_map: list[int] | None) -> str:
    if index_map is not None:
        return f"records[{index_map[idx]}].{name}"
    return f"{section}.{name}[{idx}]"


def _column(section: str, f: Field, values: Any, n: int, index_map: list[int] | None) -> np.ndarray:
    where = f"{section}.{f.name}" if index_map is None else f"records[*].{f.name}"
    if isinstance(values, (bytes, bytearray)) and index_map is None:
        return _binary_column(section, f, values, n)
    if not isinstance(values, list):
        raise BatchError(where, f"must be an array, got {type(values).__name__}")
    if len(values) != n:
        raise BatchError(where, f"has {len(values)} values but the section has {n} records")
    if f.type == "str":
        if f.name == "op":
            get = OP_CODE.get
            try:
                codes = np.fromiter(map(OP_CODE.__getitem__, values), dtype=np.int16, count=len(values))
            except (KeyError, TypeError):  # an unknown op or an unhashable value (list, dict): find which
                codes = None
            if codes is not None:
                return codes
            try:
                codes = np.array([get(v, -1) for v in values], dtype=np.int16)
            except TypeError:  # an unhashable value (list, dict)
                codes = np.array([get(v, -1) if isinstance(v, str) else -1 for v in values], dtype=np.int16)
            if n and codes.min() < 0:
                i = int(np.argmax(codes < 0))
                raise BatchError(
                    _loc(section, i, f.name, index_map),
                    f"unknown collective op (expected one of {', '.join(COLLECTIVE_OPS)})",
                    got=values[i],
                )
            return codes
        optional_null = not f.required and f.name == "dim"  # null: the dimension is not known
        if not set(map(type, values)) <= ({str, type(None)} if optional_null else {str}):
            bad = next(i for i, v in enumerate(values) if not isinstance(v, str) and not (optional_null and v is None))
            raise BatchError(_loc(section, bad, f.name, index_map), "must be a string", got=values[bad])
        failed: dict[str, str] = {}
        for v in set(values):  # a column repeats a few names: each distinct one is checked once
            if v is None:
                continue
            try:
                check_text(v, f.name, max_len=64)
            except UnsafeValue as e:
                failed[v] = e.message
        if failed:
            i = min(values.index(v) for v in failed)  # the first bad record, as a scan would find it
            raise BatchError(_loc(section, i, f.name, index_map), failed[values[i]], got=values[i])
        return np.array(values, dtype=object)
    kinds = set(map(type, values))
    if not kinds <= _NUMBER_TYPES:  # strict: no "1.0", true or [1.0] taken for numbers
        bad = next(i for i, v in enumerate(values) if type(v) not in _NUMBER_TYPES)
        raise BatchError(_loc(section, bad, f.name, index_map),
                         f"must be a number ({f.type}), got {type(values[bad]).__name__}", got=values[bad])
    try:
        arr = np.array(values, dtype=np.float64)
    except OverflowError:  # an integer beyond float range (hundreds of digits)
        bad = next(i for i, v in enumerate(values) if isinstance(v, int) and abs(v) > 2**1000)
        raise BatchError(_loc(section, bad, f.name, index_map), "is out of range", got=values[bad]) from None
    nan = np.isnan(arr)
    if nan.any():
        for j in np.flatnonzero(nan):
            v = values[j]
            if v is not None:
                raise BatchError(_loc(section, int(j), f.name, index_map), "must be finite (NaN is not allowed)", got=v)
            if f.required:
                raise BatchError(_loc(section, int(j), f.name, index_map), "is required (null given)")
    fin = arr[~nan]
    if fin.size:
        bad_mask = ~np.isfinite(arr) & ~nan
        if bad_mask.any():
            i = int(np.argmax(bad_mask))
            raise BatchError(_loc(section, i, f.name, index_map), "must be finite (inf is not allowed)", got=values[i])
        if f.nonnegative:
            neg = arr < 0
            if neg.any():
                i = int(np.argmax(neg))
                raise BatchError(_loc(section, i, f.name, index_map), "must be >= 0", got=values[i])
        big = np.abs(np.where(nan, 0.0, arr)) > _max_of(f)
        if big.any():
            i = int(np.argmax(big))
            raise BatchError(_loc(section, i, f.name, index_map), "is out of range", got=values[i])
        if f.type == "int":
            frac = (arr != np.floor(arr)) & ~nan
            if frac.any():
                i = int(np.argmax(frac))
                raise BatchError(_loc(section, i, f.name, index_map), "must be an integer", got=values[i])
    elif f.required and n:
        raise BatchError(_loc(section, 0, f.name, index_map), "is required (null given)")
    return arr


def _binary_column(section: str, f: Field, values: bytes | bytearray, n: int) -> np.ndarray:
    """A packed little-endian column: float64 (NaN = not measured) or int64."""
    if f.type == "str":
        raise BatchError(f"{section}.{f.name}", "must be an array of strings (bytes given)")
    if len(values) != 8 * n:
        raise BatchError(
            f"{section}.{f.name}", f"has {len(values)} bytes but the section has {n} records (8 bytes each expected)"
        )
    arr = np.frombuffer(values, dtype="<f8" if f.type == "float" else "<i8").astype(np.float64)
    with np.errstate(invalid="ignore"):
        ok = np.abs(arr) <= _max_of(f)  # False for NaN, inf and out-of-range values
        fine = bool(ok.all()) or (not f.required and not (~ok & ~np.isnan(arr)).any())  # NaN: not measured
        if fine and not (f.nonnegative and (arr < 0).any()):
            return arr  # the common case: decided in a pass or two; what fails is named below
    nan = np.isnan(arr)
    if f.required and nan.any():
        i = int(np.argmax(nan))
        raise BatchError(f"{section}.{f.name}[{i}]", "is required (NaN given)")
    finite = np.isfinite(arr) | nan
    if not finite.all():
        i = int(np.argmax(~finite))
        raise BatchError(f"{section}.{f.name}[{i}]", "must be finite (inf is not allowed)", got=float(arr[i]))
    if f.nonnegative and (arr < 0).any():
        i = int(np.argmax(arr < 0))
        raise BatchError(f"{section}.{f.name}[{i}]", "must be >= 0", got=float(arr[i]))
    big = np.abs(np.where(nan, 0.0, arr)) > _max_of(f)
    if big.any():
        i = int(np.argmax(big))
        raise BatchError(f"{section}.{f.name}[{i}]", "is out of range", got=float(arr[i]))
    if f.type == "float" and f.name == "op":  # pragma: no cover - op is a string column
        raise BatchError(f"{section}.{f.name}", "must be strings")
    return arr


def _section(
    section: str, data: Any, fields: tuple[Field, ...], world_size: int, index_map: list[int] | None = None
) -> dict[str, np.ndarray]:
    if not isinstance(data, dict):
        raise BatchError(section, f"must be an object of columns, got {type(data).__name__}")
    known = {f.name for f in fields}
    for k in data:
        if k not in known:
            raise BatchError(f"{section}.{k}", f"unknown field (expected some of {', '.join(sorted(known))})")
    if not data:
        return {}
    ref = data.get("rank", next(iter(data.values())))
    if isinstance(ref, list):
        n = len(ref)
    elif isinstance(ref, (bytes, bytearray)):
        n = len(ref) // 8
    else:
        n = -1
    cols: dict[str, np.ndarray] = {}
    for f in fields:
        if f.name in data:
            cols[f.name] = _column(section, f, data[f.name], n, index_map)
        elif f.required:
            raise BatchError(f"{section}.{f.name}" if index_map is None else f"records[*].{f.name}", "is required")
    if n <= 0:
        return {}
    rank = cols["rank"]
    over = rank >= world_size
    if over.any():
        i = int(np.argmax(over))
        raise BatchError(
            _loc(section, i, "rank", index_map), f"must be < the run's world_size {world_size}", got=int(rank[i])
        )
    if section == "rank_steps":
        step_s = cols["step_s"]
        parts = sum(np.nan_to_num(cols[c]) for c in ("data_s", "compute_s", "comm_exposed_s") if c in cols)
        if not isinstance(parts, int):
            bad = parts > step_s * (1 + 1e-6) + 1e-6
            if bad.any():
                i = int(np.argmax(bad))
                raise BatchError(
                    _loc(section, i, "step_s", index_map),
                    "is smaller than data_s + compute_s + comm_exposed_s (components exceed the step)",
                    got=float(step_s[i]),
                )
    if section == "collectives" and "exposed_s" in cols:
        bad = np.nan_to_num(cols["exposed_s"]) > cols["total_s"] * (1 + 1e-6) + 1e-6
        if bad.any():
            i = int(np.argmax(bad))
            raise BatchError(_loc(section, i, "exposed_s", index_map), "exceeds total_s", got=float(cols["exposed_s"][i]))
    if section == "collectives":
        _collectives_per_rank_step(cols, index_map)
    return cols


def _collectives_per_rank_step(cols: dict[str, np.ndarray], index_map: list[int] | None) -> None:
    """At most ``MAX_COLLECTIVES_PER_RANK_STEP`` collective records of one (step, rank) in a batch: 422
    naming the limit, the step and the rank, located at the first record beyond it (batch order)."""
    n = len(cols["rank"])
    if n <= MAX_COLLECTIVES_PER_RANK_STEP:
        return
    key = cols["step"].astype(np.int64) * (1 << 32) + cols["rank"].astype(np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    counts = np.diff(np.r_[starts, n])
    over = np.flatnonzero(counts > MAX_COLLECTIVES_PER_RANK_STEP)
    if not len(over):
        return
    g = int(over[0])
    i = int(order[starts[g] + MAX_COLLECTIVES_PER_RANK_STEP])
    step, rank = int(sk[starts[g]] >> 32), int(sk[starts[g]] & 0xFFFFFFFF)
    raise BatchError(
        _loc("collectives", i, "seq", index_map),
        f"step {step}, rank {rank} has {int(counts[g])} collective records in this batch; the limit is "
        f"MAX_COLLECTIVES_PER_RANK_STEP = {MAX_COLLECTIVES_PER_RANK_STEP} per rank-step (aggregate calls into "
        "fewer records: the 'calls' field)",
        got=int(counts[g]),
    )


def _rows_to_columns(records: Any) -> tuple[dict[str, dict[str, list]], dict[str, list[int]], list, list]:
    if not isinstance(records, list):
        raise BatchError("records", f"must be an array, got {type(records).__name__}")
    kind_to_section = {kind: sec for sec, (kind, _) in SECTIONS.items()}
    cols: dict[str, dict[str, list]] = {}
    maps: dict[str, list[int]] = {}
    ranks: list = []
    events: list = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise BatchError(f"records[{i}]", f"must be an object, got {type(rec).__name__}")
        kind = rec.get("kind")
        if not isinstance(kind, str):  # a list or an object is unhashable: say so, do not fail the lookup
            raise BatchError(f"records[{i}].kind", "is required" if kind is None else "must be a string (the record "
                             "kind: rank_step, collective, modality_tokens, phase, rank or event)", got=kind)
        if kind == "rank":
            ranks.append((i, {k: v for k, v in rec.items() if k != "kind"}))
            continue
        if kind == "event":
            # the record's own kind travels as "event" (the key "kind" says what record this is)
            ev = {k: v for k, v in rec.items() if k not in ("kind", "event")}
            ev["kind"] = rec.get("event")
            events.append((i, ev))
            continue
        sec = kind_to_section.get(kind)
        if sec is None:
            raise BatchError(f"records[{i}].kind", "unknown record kind (expected one of rank_step, collective, modality_tokens, phase, rank, event)", got=kind)
        fields = SECTIONS[sec][1]
        names = {f.name for f in fields}
        for k in rec:
            if k != "kind" and k not in names:
                raise BatchError(f"records[{i}].{k}", f"unknown field for kind {kind!r}")
        c = cols.setdefault(sec, {f.name: [] for f in fields})
        for f in fields:
            c[f.name].append(rec.get(f.name))
        maps.setdefault(sec, []).append(i)
    # drop optional columns that are entirely absent
    for sec, c in cols.items():
        req = {f.name for f in SECTIONS[sec][1] if f.required}
        for name in [k for k, v in c.items() if k not in req and all(x is None for x in v)]:
            del c[name]
    return cols, maps, ranks, events


def _int(v: Any, where: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not (0 <= v <= _MAX_INT32):
        raise BatchError(where, "must be a non-negative integer", got=v)
    return v


def _object_with_rank(obj: Any, where: str, keys: set[str], world_size: int) -> int:
    """An object with only ``keys`` and a valid ``rank`` (< the run's world size); returns the rank."""
    if not isinstance(obj, dict):
        raise BatchError(where, "must be an object")
    for k in obj:
        if k not in keys:
            raise BatchError(f"{where}.{k}", f"unknown field (expected some of {', '.join(sorted(keys))})")
    rank = _int(obj.get("rank"), f"{where}.rank")
    assert rank is not None
    if rank >= world_size:
        raise BatchError(f"{where}.rank", f"must be < the run's world_size {world_size}", got=rank)
    return rank


def _ranks(items: list[tuple[str, Any]], world_size: int) -> list[dict[str, Any]]:
    out = []
    for where, r in items:
        rank = _object_with_rank(r, where, _RANK_KEYS, world_size)
        d: dict[str, Any] = {"rank": rank, "local_rank": _int(r.get("local_rank"), f"{where}.local_rank", optional=True)}
        for k in ("host", "node", "device"):
            v = r.get(k)
            if v is not None:
                try:
                    check_text(v, k, max_len=256)
                except UnsafeValue as e:
                    raise BatchError(f"{where}.{k}", e.message, got=v) from None
            d[k] = v
        out.append(d)
    return out


def _events(items: list[tuple[str, Any]], world_size: int) -> tuple[list[dict[str, Any]], list[tuple[Group, int]]]:
    """Events for ``run_events``, and the ``comm_group`` descriptions (each distinct group once, with its
    count): every event's data is bounded here (``_event_data``), never read back unbounded."""
    out = []
    groups: dict[tuple[str, bytes], list[Any]] = {}
    for where, e in items:
        rank = _object_with_rank(e, where, _EVENT_KEYS, world_size)
        kind = e.get("kind")
        kind_where = f"{where}.event" if where.startswith("records[") else f"{where}.kind"  # row form: "event"
        try:
            check_text(kind, "kind", max_len=64)
        except UnsafeValue as err:
            raise BatchError(kind_where, err.message, got=kind) from None
        ts = e.get("ts")
        if ts is not None and (type(ts) not in (int, float) or not 0 <= ts <= _MAX_UNIX_TS):
            raise BatchError(f"{where}.ts", f"must be a unix time in seconds (0..{_MAX_UNIX_TS:.0e})", got=ts)
        seq = _int(e.get("seq"), f"{where}.seq")
        step = _int(e.get("step"), f"{where}.step", optional=True)
        data = e.get("data") or {}
        if not isinstance(data, dict):
            raise BatchError(f"{where}.data", "must be an object", got=data)
        if kind == "comm_group":  # stored once per group in run_groups, not per rank in run_events
            g = _comm_group(data, f"{where}.data", world_size)
            if g is not None:
                groups.setdefault((g.dim, g.key), [g, 0])[1] += 1
            continue
        if kind == scalars_wire.SCALARS_KIND and step is None:
            raise BatchError(f"{where}.step", "is required in a scalars event (the step its values belong to)")
        data, folded = _event_data(kind, data, f"{where}.data")
        if kind == "failure" and type(data.get("rank")) is int and data["rank"] >= world_size:  # run health
            raise BatchError(f"{where}.data.rank", f"must be a rank of the run (< world size {world_size})",
                             got=data["rank"])
        out.append({"rank": rank, "seq": seq, "kind": kind, "ts": ts, "step": step, "data": data, "folded": folded})
    return out, [(g, n) for g, n in groups.values()]


# --------------------------------------------------------------------------- event data bounds


def _json(data: Any, where: str, limit: int, name: str = "MAX_EVENT_VALUES") -> None:
    """JSON-safe (``check_json``) with at most ``limit`` values; the error names the limit (``name``)."""
    try:
        check_json(data, where, max_items=limit)
    except UnsafeValue as err:
        if err.where == where and err.message.startswith("has more than"):
            raise BatchError(where, f"has more than {limit} values (the limit {name} per event)") from None
        raise BatchError(err.where, err.message) from None


def _values(x: Any) -> int:
    """JSON values in ``x`` as ``check_json`` counts them (each scalar, list and object is one)."""
    if isinstance(x, dict):
        return 1 + sum(_values(v) for v in x.values())
    if isinstance(x, list):
        return 1 + sum(_values(v) for v in x)
    return 1


def _bounded_int(data: dict[str, Any], name: str, lo: int, hi: int, where: str, *, limit: str = "",
                 required: bool = False) -> int | None:
    """``data[name]``: an integer in lo..hi (None when absent or null, unless ``required``)."""
    v = data.get(name)
    if v is None:
        if required:
            raise BatchError(f"{where}.{name}", "is required")
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise BatchError(f"{where}.{name}", f"must be an integer in {lo}..{hi}" + (f" ({limit})" if limit else ""), got=v)
    return v


def _count(data: dict[str, Any], name: str, where: str) -> None:
    """``data[name]`` when present: a count, a finite number in 0..MAX_HIST_COUNT."""
    v = data.get(name)
    if v is not None and (type(v) not in (int, float) or not 0 <= v <= MAX_HIST_COUNT):
        raise BatchError(f"{where}.{name}", f"must be a count in 0..{MAX_HIST_COUNT:.0e} (MAX_HIST_COUNT)", got=v)


def cut_reason(s: str) -> str:
    """A reason as kept: at most MAX_REASON_CHARS characters, a longer one cut and marked with "…"."""
    return s if len(s) <= MAX_REASON_CHARS else s[: MAX_REASON_CHARS - 1] + "…"


def _reason(d: dict[str, Any], key: str) -> bool:
    """Cut ``d[key]`` to MAX_REASON_CHARS when it is a longer string; True when it was cut."""
    v = d.get(key)
    if isinstance(v, str) and len(v) > MAX_REASON_CHARS:
        d[key] = cut_reason(v)
        return True
    return False


def _seq_lens(data: dict[str, Any], where: str) -> bool:
    bins = data.get("bins")
    if bins is not None:
        if not isinstance(bins, dict):
            raise BatchError(f"{where}.bins", "must be an object {log2 bin: count}", got=bins)
        if len(bins) > MAX_HIST_BINS:
            raise BatchError(f"{where}.bins", f"has {len(bins)} bins; at most {MAX_HIST_BINS} (MAX_HIST_BINS)")
        norm: dict[str, Any] = {}
        for k, v in bins.items():
            if not (k.isascii() and k.isdigit() and int(k) < MAX_HIST_BINS):
                raise BatchError(f"{where}.bins.{k[:16]}", f"must be a bin number 0..{MAX_HIST_BINS - 1} (MAX_HIST_BINS)",
                                 got=k)
            _count(bins, k, f"{where}.bins")
            norm[str(int(k))] = v
        data["bins"] = norm
    _bounded_int(data, "steps", 0, _MAX_INT32, where)
    return False


def _pp_stage(data: dict[str, Any], where: str) -> bool:
    for name in ("stage", "group_rank"):
        _bounded_int(data, name, 0, MAX_PIPELINE_STAGES - 1, where, limit="MAX_PIPELINE_STAGES")
    for name in ("num_stages", "group_size"):
        _bounded_int(data, name, 0, MAX_PIPELINE_STAGES, where, limit="MAX_PIPELINE_STAGES")
    return False


def _pp_schedule(data: dict[str, Any], where: str) -> bool:
    _bounded_int(data, "n_microbatches", 0, MAX_MICROBATCHES, where, limit="MAX_MICROBATCHES")
    stages = data.get("stages")
    if stages is not None:
        if not isinstance(stages, list) or len(stages) > MAX_PIPELINE_STAGES:
            raise BatchError(f"{where}.stages", f"must be a list of at most {MAX_PIPELINE_STAGES} stage indices "
                             "(MAX_PIPELINE_STAGES)", got=stages)
        for i, v in enumerate(stages):
            if type(v) is not int or not 0 <= v < MAX_PIPELINE_STAGES:
                raise BatchError(f"{where}.stages[{i}]", f"must be a stage index in 0..{MAX_PIPELINE_STAGES - 1} "
                                 "(MAX_PIPELINE_STAGES)", got=v)
    return False


def _compile(data: dict[str, Any], where: str) -> bool:
    return _reason(data, "reason")


def _graph_break(data: dict[str, Any], where: str) -> bool:
    return _reason(data, "reason")


_REASON_LISTS = ("graph_breaks", "recompile_reasons")


def _num_or_0(v: Any) -> float:
    return float(v) if type(v) in (int, float) else 0.0


def _compile_summary(data: dict[str, Any], where: str) -> bool:
    """Reasons cut; when its reason lists make the event larger than MAX_EVENT_VALUES, the least frequent
    reasons are folded into ``reasons_dropped`` (the agent keeps up to 200 of each). Malformed fields
    are kept as sent: the read side ignores them (``store/compile.py``)."""
    folded = False
    items: list[tuple[str, dict[str, Any]]] = []
    for key in _REASON_LISTS:
        lst = data.get(key)
        if not isinstance(lst, list):
            continue
        for it in lst:
            if isinstance(it, dict):
                folded |= _reason(it, "reason")
                items.append((key, it))
    over = _values(data) - MAX_EVENT_VALUES
    if over > 0 and items:
        # drop the least frequent reasons until the event fits (each costs its values)
        order = sorted(range(len(items)), key=lambda j: (-_num_or_0(items[j][1].get("count")), j))
        keep = set(order)
        dropped = 0
        for j in reversed(order):
            if over <= 0:
                break
            keep.discard(j)
            over -= _values(items[j][1])
            dropped += 1
        gone = {id(it) for j, (_k, it) in enumerate(items) if j not in keep}
        for key in _REASON_LISTS:
            if isinstance(data.get(key), list):
                data[key] = [it for it in data[key] if id(it) not in gone]
        prev = data.get("reasons_dropped")
        data["reasons_dropped"] = (prev if isinstance(prev, (int, float)) and not isinstance(prev, bool) else 0) + dropped
        folded = True
    return folded


#: per-kind checks of the kinds the server reads (``store/events.py``, ``store/compile.py``):
#: histogram and pipeline sizes refused beyond their bound (422 naming it), reasons cut (folded; the
#: compile kinds' numbers are not refused: their reader ignores what is not a count in range);
#: True = something was folded
_KIND_CHECKS: dict[str, Callable[[dict[str, Any], str], bool]] = {
    "seq_lens": _seq_lens,
    "pp_stage": _pp_stage,
    "pp_schedule": _pp_schedule,
    "compile": _compile,
    "graph_break": _graph_break,
    "compile_summary": _compile_summary,
}
# run health (issue 21): where each rank is, failures, declared pauses (store/health.py keeps them)
_KIND_CHECKS.update(health_wire.kind_checks(BatchError))
# training scalars (run.log): {name: finite number}, stored in run_scalars (store/scalars.py)
_KIND_CHECKS.update(scalars_wire.kind_checks(BatchError))
# device telemetry (NVML per rank and window), stored in run_devices (store/devices.py)
_KIND_CHECKS.update(device_wire.kind_checks(BatchError))


def _event_data(kind: str, data: dict[str, Any], where: str) -> tuple[dict[str, Any], bool]:
    """The event's data as stored, and whether it was folded: at most MAX_EVENT_VALUES JSON values
    (compile_summary: folded to fit), the kind's own bounds (``_KIND_CHECKS``)."""
    check = _KIND_CHECKS.get(kind)
    if kind == "trace_summary":  # the agent's trace reduction: bounded more loosely (MAX_TRACE_SUMMARY_VALUES)
        _json(data, where, MAX_TRACE_SUMMARY_VALUES, "MAX_TRACE_SUMMARY_VALUES")
        return data, False
    if kind == "memory_modules":  # memory per module (columns of ≤ 256 modules): MAX_MEMORY_MODULES_VALUES
        _json(data, where, MAX_MEMORY_MODULES_VALUES, "MAX_MEMORY_MODULES_VALUES")
        return data, False
    if kind != "compile_summary":
        _json(data, where, MAX_EVENT_VALUES)
        return data, check(data, where) if check is not None else False
    _json(data, where, MAX_ITEMS)  # its reason lists are folded to MAX_EVENT_VALUES first
    folded = _compile_summary(data, where)
    if _values(data) > MAX_EVENT_VALUES:
        raise BatchError(where, f"has more than {MAX_EVENT_VALUES} values (the limit MAX_EVENT_VALUES per event)")
    return data, folded


def _comm_group(data: dict[str, Any], where: str, world_size: int) -> Group | None:
    """A ``comm_group`` description → its group: ``{"dim", "size", "start", "stride", "group"}`` for a
    progression (any size), else ``{"dim", "size", "ranks": [...], "group"}`` with at most
    MAX_GROUP_RANKS_LISTED ranks (older agents listed the first 256). None: no membership given."""
    _json({k: v for k, v in data.items() if k != "ranks"}, where, MAX_EVENT_VALUES)
    try:
        dim = check_text(data.get("dim"), "dim", max_len=64)
    except UnsafeValue as err:
        raise BatchError(f"{where}.dim", err.message, got=data.get("dim")) from None
    name = data.get("group")
    if name is not None:
        try:
            check_text(name, "group", max_len=64, allow_empty=True)
        except UnsafeValue as err:
            raise BatchError(f"{where}.group", err.message, got=name) from None
    size = _bounded_int(data, "size", 1, world_size, where, limit="the run's world size")
    if data.get("start") is not None or data.get("stride") is not None:
        start = _bounded_int(data, "start", 0, world_size - 1, where, required=True)
        stride = _bounded_int(data, "stride", 1, world_size, where, required=True)
        if size is None:
            raise BatchError(f"{where}.size", "is required with start and stride")
        assert start is not None and stride is not None
        if start + stride * (size - 1) >= world_size:
            raise BatchError(f"{where}.size", f"start + stride × (size − 1) must be < the run's world_size {world_size}",
                             got=size)
        return from_progression(dim, start, stride, size, name)
    ranks = data.get("ranks")
    if ranks is None:
        return None
    if not isinstance(ranks, list):
        raise BatchError(f"{where}.ranks", "must be a list of global ranks", got=ranks)
    if len(ranks) > MAX_GROUP_RANKS_LISTED:
        raise BatchError(f"{where}.ranks", f"lists {len(ranks)} ranks; at most {MAX_GROUP_RANKS_LISTED} "
                         "(MAX_GROUP_RANKS_LISTED: send a larger group as start/stride/size)")
    bad = next((i for i, r in enumerate(ranks) if type(r) is not int or not 0 <= r < world_size), None)
    if bad is not None:
        raise BatchError(f"{where}.ranks[{bad}]", f"must be a rank in 0..{world_size - 1}", got=ranks[bad])
    arr = np.unique(np.array(ranks, dtype=np.int64))
    if size is None:
        size = len(arr)
    if len(arr) > size:
        raise BatchError(f"{where}.size", f"is smaller than the {len(arr)} ranks listed", got=size)
    return from_ranks(dim, arr, size, name)


def validate_batch(doc: Any, world_size_of: Callable[[int], int | None]) -> ValidBatch:
    """Check a decoded batch; ``world_size_of(run_id)`` gives the run's world size or None if unknown."""
    if not isinstance(doc, dict):
        raise BatchError("batch", f"must be an object, got {type(doc).__name__}")
    for k in doc:
        if k not in _TOP_KEYS:
            raise BatchError(str(k), f"unknown top-level field (expected some of {', '.join(sorted(_TOP_KEYS))})")
    v = doc.get("v", WIRE_VERSION)
    if v != WIRE_VERSION:
        raise BatchError("v", f"unsupported wire version (this server speaks {WIRE_VERSION})", got=v)
    run_id = doc.get("run_id")
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        raise BatchError("run_id", "is required and must be an integer (register the run: POST /api/v1/runs)", got=run_id)
    world_size = world_size_of(run_id)
    if world_size is None:
        raise BatchError("run_id", "unknown run (register it first: POST /api/v1/runs)", got=run_id)
    out = ValidBatch(run_id=run_id)
    rank_items: list[tuple[str, Any]] = []
    event_items: list[tuple[str, Any]] = []
    if "records" in doc:
        for sec in SECTIONS:
            if sec in doc:
                raise BatchError(sec, "a batch carries either 'records' or columnar sections, not both")
        cols, maps, ranks, events = _rows_to_columns(doc["records"])
        for sec, c in cols.items():
            setattr(out, sec, _section(sec, c, SECTIONS[sec][1], world_size, maps[sec]))
        rank_items = [(f"records[{i}]", r) for i, r in ranks]
        event_items = [(f"records[{i}]", e) for i, e in events]
    else:
        for sec, (_, fields) in SECTIONS.items():
            if sec in doc and doc[sec] is not None:
                setattr(out, sec, _section(sec, doc[sec], fields, world_size))
    for key, items in (("ranks", rank_items), ("events", event_items)):
        val = doc.get(key)
        if val is None:
            continue
        if not isinstance(val, list):
            raise BatchError(key, f"must be an array, got {type(val).__name__}")
        items.extend((f"{key}[{i}]", x) for i, x in enumerate(val))
    out.ranks = _ranks(rank_items, world_size)
    out.events, out.groups = _events(event_items, world_size)
    return out
