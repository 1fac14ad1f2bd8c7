"""The ingest wire format, shared by the agent (which writes it) and the server (which reads it).

Standard library only: the agent imports this inside training jobs.

A batch is one JSON or msgpack object (optionally gzip-compressed) for one run::

    {
      "v": 1,
      "run_id": 17,                       # from POST /api/v1/runs (idempotent by name)
      "rank_steps":  {"rank": [...], "step": [...], "step_s": [...], ...},   # columnar
      "collectives": {"rank": [...], "step": [...], "seq": [...], "op": [...], ...},
      "modality_tokens": {"rank": [...], "step": [...], "modality": [...], "tokens": [...]},
      "phases": {"rank": [...], "step": [...], "phase": [...], "seconds": [...]},   # custom phases
      "ranks":  [{"rank": 0, "host": "n1", "node": "n1", "local_rank": 0, "device": "H100"}],
      "events": [{"rank": 0, "seq": 3, "kind": "checkpoint", "ts": 1.7e9, "step": 100, "data": {}}]
    }

Columnar sections are objects of equal-length arrays (a missing optional column means all null;
``null`` inside an optional column means "not measured"). The agent sends every column as a plain
list (``agent/transport.py``, ``build_batch``). In msgpack, a numeric column may instead be sent as
raw little-endian bytes (msgpack ``bin``): float columns as float64 (NaN = not measured), int
columns as int64 (no null: an int column with missing values goes as a list) — no per-value objects
on either side; :func:`columns_from_rows` with ``binary=True`` builds them (the Python client's
``ingest_rows`` and ``bench/ingest.py`` send them). Instead of columns a batch may carry
``"records": [{"kind": "rank_step", ...}, {"kind": "collective", ...}, ...]`` (row form, friendlier
for scripts, slower; an event record names its own kind in ``"event"``); both forms may not be mixed.

Keys that make a batch idempotent (a retried or overlapping batch never duplicates a row):
rank_step (run_id, rank, step); collective (run_id, rank, step, seq);
modality_tokens (run_id, rank, step, modality); phase (run_id, rank, step, phase); event (run_id, rank, seq); rank (run_id, rank).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "WIRE_VERSION",
    "Field",
    "RANK_STEP_FIELDS",
    "COLLECTIVE_FIELDS",
    "MODALITY_FIELDS",
    "PHASE_FIELDS",
    "SECTIONS",
    "RECORD_KINDS",
    "COLLECTIVE_OPS",
    "BUSBW_FACTOR",
    "busbw_factor",
    "encode_batch",
    "columns_from_rows",
    "MSGPACK_CONTENT_TYPE",
]

WIRE_VERSION = 1
MSGPACK_CONTENT_TYPE = "application/msgpack"


@dataclass(frozen=True)
class Field:
    """One column of a columnar section."""

    name: str
    type: str  # "int" | "float" | "str"
    required: bool = False
    nonnegative: bool = True
    doc: str = ""


RANK_STEP_FIELDS: tuple[Field, ...] = (
    Field("rank", "int", True, doc="global rank"),
    Field("step", "int", True, doc="training step index"),
    Field("step_s", "float", True, doc="wall time of the step on this rank (docs/metrics.md)"),
    Field("ts", "float", doc="unix time (s) the step started"),
    Field("data_s", "float", doc="blocked on the input pipeline"),
    Field("compute_s", "float", doc="forward + backward + optimizer (+ custom phases)"),
    Field("forward_s", "float"),
    Field("backward_s", "float"),
    Field("optimizer_s", "float"),
    Field("comm_exposed_s", "float", doc="communication no compute overlaps"),
    Field("comm_total_s", "float", doc="summed duration of all collectives of the step"),
    Field("other_s", "float", doc="residual: step - data - compute - exposed comm (never < 0)"),
    Field("tokens", "int", doc="tokens processed this step (real, not padding)"),
    Field("padded_tokens", "int", doc="tokens including padding"),
    Field("samples", "int"),
    Field("flops", "float", doc="model FLOPs of this step on this rank: real tokens, no recomputation (MFU)"),
    Field("mem_allocated_bytes", "int"),
    Field("mem_reserved_bytes", "int"),
    Field("mem_peak_bytes", "int", doc="allocator high-water mark at the step's end, never reset by the agent: "
          "the step's peak when it rose in the step, else an upper bound (CPU: peak RSS)"),
    Field("alloc_retries", "int", doc="caching allocator num_alloc_retries delta"),
    Field("flags", "int", doc="bit 0: negative residual measured (other_s set to 0)"),
    # optional fields added later go at the end: an older client's shorter rows stay valid
    Field("hw_flops", "float", doc="hardware FLOPs of this step on this rank: padded tokens and activation "
          "recomputation included (HFU); absent unless measured"),
)

COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
    "gather",
    "scatter",
    "other",
)

COLLECTIVE_FIELDS: tuple[Field, ...] = (
    Field("rank", "int", True),
    Field("step", "int", True),
    Field("seq", "int", True, doc="index of this record within (rank, step): the idempotency key"),
    Field("op", "str", True, doc="one of COLLECTIVE_OPS"),
    Field("group_size", "int", True, doc="ranks in the process group (n)"),
    Field("bytes", "int", True, doc="per-rank message bytes summed over the calls (NCCL-tests)"),
    Field("calls", "int", True, doc="calls aggregated in this record"),
    Field("total_s", "float", True, doc="summed duration of the calls"),
    Field("exposed_s", "float", doc="part of total_s the training thread waited for"),
    Field("start_ts", "float", doc="unix time the first call was issued (lateness)"),
    Field("dim", "str", doc="the group's parallel dimension: its DeviceMesh dim name (dp, tp, pp, ...), "
          "'world' for the default group, else a stable group id (g<size>s<stride>); absent: unknown"),
)

MODALITY_FIELDS: tuple[Field, ...] = (
    Field("rank", "int", True),
    Field("step", "int", True),
    Field("modality", "str", True),
    Field("tokens", "int", True),
)

PHASE_FIELDS: tuple[Field, ...] = (
    Field("rank", "int", True),
    Field("step", "int", True),
    Field("phase", "str", True, doc="a custom phase name (run.phase(name)); forward/backward/optimizer are rank-step fields"),
    Field("seconds", "float", True, doc="time in the phase this step (part of compute_s)"),
)

#: columnar section name -> (record kind in row form, fields)
SECTIONS: dict[str, tuple[str, tuple[Field, ...]]] = {
    "rank_steps": ("rank_step", RANK_STEP_FIELDS),
    "collectives": ("collective", COLLECTIVE_FIELDS),
    "modality_tokens": ("modality_tokens", MODALITY_FIELDS),
    "phases": ("phase", PHASE_FIELDS),
}

RECORD_KINDS: tuple[str, ...] = ("rank_step", "collective", "modality_tokens", "phase", "rank", "event")

#: NCCL-tests bus-bandwidth factors (docs/metrics.md); n = group size.
BUSBW_FACTOR: dict[str, str] = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "send": "1",
    "recv": "1",
}


def busbw_factor(op: str, n: int) -> float:
    """Bus-bandwidth factor of NCCL-tests for ``op`` over ``n`` ranks (1 where undefined)."""
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def columns_from_rows(rows: list[tuple], fields: tuple[Field, ...], *, binary: bool = True) -> dict[str, Any]:
    """Rows (tuples in ``fields`` order) → a columnar section; numeric columns as packed little-endian
    bytes when ``binary``; optional columns that are entirely null are left out."""
    import sys
    from array import array

    width = len(fields)
    if rows and any(len(r) < width for r in rows):
        # rows made for an older field list: the optional fields added at the end are not measured
        if any(f.required for f in fields[min(len(r) for r in rows):]):
            raise ValueError("a row lacks a required field")
        rows = [tuple(r) + (None,) * (width - len(r)) for r in rows]
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in fields]
    out: dict[str, Any] = {}
    nan = float("nan")
    for f, col in zip(fields, cols, strict=True):
        if not f.required and all(v is None for v in col):
            continue
        if not binary or f.type == "str":
            out[f.name] = list(col)
            continue
        if f.type == "int" and None not in col:
            a = array("q", col)
        else:
            a = array("d", [nan if v is None else v for v in col])
        if sys.byteorder != "little":
            a.byteswap()
        out[f.name] = a.tobytes()
    return out


def encode_batch(batch: dict[str, Any], *, fmt: str = "msgpack", compress: bool = True,
                 encoding: str = "gzip") -> tuple[bytes, dict[str, str]]:
    """Encode a batch for ``POST /api/v1/ingest``; returns the body and its headers. ``encoding``:
    ``"gzip"`` (every server takes it) or ``"zstd"`` (servers that list it in their run registration
    answer, ``ingest_encodings``: 3-4× cheaper to decompress and to compress)."""
    if fmt == "msgpack":
        import msgpack

        body = msgpack.packb(batch, use_bin_type=True)
        headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
    elif fmt == "json":
        body = json.dumps(batch, separators=(",", ":"), allow_nan=False).encode()
        headers = {"Content-Type": "application/json"}
    else:
        raise ValueError(f"unknown wire format {fmt!r}: expected 'msgpack' or 'json'")
    if compress and encoding == "zstd":
        import zstandard

        body = zstandard.ZstdCompressor(level=1).compress(body)
        headers["Content-Encoding"] = "zstd"
    elif compress:
        if encoding != "gzip":
            raise ValueError(f"unknown content encoding {encoding!r}: expected 'gzip' or 'zstd'")
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return body, headers
