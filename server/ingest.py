"""Ingest: decode a batch, validate it, and land it in Postgres in one transaction (``store.landing``).

A batch lands as ONE row of ``ingest_fragments`` holding its records as compressed columnar
blocks (numpy already holds them column-wise after validation), so the database does one small
insert per batch instead of one row per record. Idempotency: duplicates (retries, overlaps,
concurrent senders) are removed by the compactor, which keys rank-steps on (run, step, rank) and
collectives on (run, step, rank, seq); every read of not-yet-compacted data deduplicates the same
way. A batch is all-or-nothing (one transaction).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from sqlalchemy import Engine

from fleetscope.wire import MSGPACK_CONTENT_TYPE

from .codec import FRAG_COLL_FIELDS, FRAG_STEP_FIELDS, dim_code, encode_block
from .store import landing
from .store import runs as run_store
from .store.events import Landed
from .validate import BatchError, ValidBatch, validate_batch

__all__ = ["IngestService", "Admission", "Overloaded"]

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The server cannot take this batch now; the client should retry after ``retry_after`` s."""

    def __init__(self, status: int, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class Admission:
    """Bounded concurrency with a bounded wait queue: beyond it, refuse (503) instead of queueing."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self._sem = threading.Semaphore(concurrency)
        self._lock = threading.Lock()
        self.waiting = 0
        self.active = 0
        self._queue = queue

    def __enter__(self) -> Admission:
        if not self._sem.acquire(blocking=False):
            with self._lock:
                if self.waiting >= self._queue:
                    raise Overloaded(503, "ingest queue full", 1)
                self.waiting += 1
            try:
                ok = self._sem.acquire(timeout=30)
            finally:
                with self._lock:
                    self.waiting -= 1
            if not ok:
                raise Overloaded(503, "ingest writers busy", 2)
        with self._lock:
            self.active += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self.active -= 1
        self._sem.release()


@dataclass
class IngestResult:
    run_id: int
    accepted: dict[str, int]
    #: {event kind: events dropped beyond the run's caps} (``comm_group``: group descriptions)
    dropped: dict[str, int] = field(default_factory=dict)


#: decoded bytes per compressed byte beyond which a body is a decompression bomb, not a batch (real
#: batches: msgpack 3-10×, JSON up to ~30×); the floor lets small bodies of repeated values through
MAX_GZIP_RATIO = 100
_RATIO_FLOOR_BYTES = 1 << 20


def _decompress(body: bytes, limit: int) -> bytes:
    cap = min(limit, MAX_GZIP_RATIO * len(body) + _RATIO_FLOOR_BYTES)
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, cap + 1)
    except zlib.error as e:
        raise BatchError("body", f"invalid gzip data ({e})", status=400) from None
    if len(out) > cap or d.unconsumed_tail:
        if cap < limit:
            raise BatchError("body", f"gzip body of {len(body)} bytes expands more than {MAX_GZIP_RATIO}× "
                                     f"(past {cap} bytes): refused as a decompression bomb", status=413)
        raise BatchError("body", f"decompressed batch exceeds {limit} bytes", status=413)
    if not d.eof:
        raise BatchError("body", "truncated gzip data", status=400)
    return out


INGEST_ENCODINGS = ("gzip", "zstd")
"""The ``Content-Encoding`` values ``POST /api/v1/ingest`` takes (besides none); the run registration
answer lists them, so an agent uses zstd only with a server that takes it."""


def _decompress_zstd(body: bytes, limit: int) -> bytes:
    """A zstd body, bounded like gzip: at most ``MAX_GZIP_RATIO``× its size (+1 MiB) and ``limit``."""
    import zstandard

    cap = min(limit, MAX_GZIP_RATIO * len(body) + _RATIO_FLOOR_BYTES)
    more: bool | bytes = False
    try:
        size = zstandard.frame_content_size(body)  # -1: the frame does not say (a streaming encoder)
        if size > cap:
            out = b""
            more = True
        elif size >= 0:  # one shot; a truncated or corrupt frame raises
            out = zstandard.ZstdDecompressor().decompress(body, max_output_size=cap)
        else:
            with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as r:
                out = r.read(cap + 1)
                more = len(out) <= cap and r.read(1)
    except zstandard.ZstdError as e:
        raise BatchError("body", f"invalid zstd data ({e})", status=400) from None
    if len(out) > cap or more:
        if cap < limit:
            raise BatchError("body", f"zstd body of {len(body)} bytes expands more than {MAX_GZIP_RATIO}× "
                                     f"(past {cap} bytes): refused as a decompression bomb", status=413)
        raise BatchError("body", f"decompressed batch exceeds {limit} bytes", status=413)
    if not out:
        raise BatchError("body", "empty or truncated zstd data", status=400)
    return out


def decode_body(body: bytes, content_type: str | None, content_encoding: str | None, *, max_decoded: int) -> Any:
    """Bytes on the wire → Python objects; errors are BatchError with 400/413/415."""
    enc = (content_encoding or "identity").strip().lower()
    if enc == "gzip":
        body = _decompress(body, max_decoded)
    elif enc == "zstd":
        body = _decompress_zstd(body, max_decoded)
    elif enc not in ("identity", ""):
        raise BatchError("Content-Encoding", f"unsupported encoding {enc!r} (use gzip, zstd or none)", status=415)
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in (MSGPACK_CONTENT_TYPE, "application/x-msgpack", "application/vnd.msgpack"):
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the client's
            raise BatchError("body", f"malformed msgpack ({type(e).__name__}: {e})", status=400) from None
    if ctype in ("application/json", ""):
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BatchError("body", f"malformed JSON ({str(e)[:200]})", status=400) from None
        except RecursionError:
            raise BatchError("body", "JSON nested too deeply", status=400) from None
    raise BatchError("Content-Type", f"unsupported media type {ctype!r} (use {MSGPACK_CONTENT_TYPE} or application/json)", status=415)


class IngestService:
    """Validates batches and writes them; shared by the HTTP route, tests and benchmarks."""

    def __init__(self, engine: Engine, *, concurrency: int = 4, queue: int = 32, backlog_max_rows: int = 5_000_000,
                 max_batch_records: int = 1_000_000) -> None:
        self.engine = engine
        self._dims_known: set[tuple[int, int]] = set()  # (run, dim code) already in run_dims
        self.admission = Admission(concurrency, queue)
        self.backlog_max_rows = backlog_max_rows
        self.max_batch_records = max_batch_records
        self.backlog_rows = 0  # set by the compactor after each pass
        self._world: dict[int, int] = {}
        self._world_lock = threading.Lock()

    def world_size_of(self, run_id: int) -> int | None:
        ws = self._world.get(run_id)
        if ws is not None:
            return ws
        ws = run_store.world_size(self.engine, run_id)
        if ws is None:
            return None
        with self._world_lock:
            self._world[run_id] = ws
        return ws

    def forget_run(self, run_id: int) -> None:
        self._world.pop(run_id, None)

    def ingest_body(self, body: bytes, content_type: str | None, content_encoding: str | None, *,
                    max_decoded: int, authorize: Callable[[int], None] | None = None) -> IngestResult:
        """One batch as received: admitted (backlog, then a writer slot) BEFORE it is decompressed and
        parsed, so a burst of decode-heavy bodies queues or gets 429/503 instead of costing memory."""
        if self.backlog_rows > self.backlog_max_rows:
            raise Overloaded(429, "compaction backlog", 2)
        with self.admission:
            doc = decode_body(body, content_type, content_encoding, max_decoded=max_decoded)
            del body
            try:
                return self._ingest(doc, authorize)
            except BatchError as e:
                e.records = count_records(doc)  # type: ignore[attr-defined]  # the refused records, for the metrics
                raise

    def ingest(self, doc: Any, authorize: Callable[[int], None] | None = None) -> IngestResult:
        """Validate and write one decoded batch (all or nothing)."""
        if self.backlog_rows > self.backlog_max_rows:
            raise Overloaded(429, "compaction backlog", 2)
        with self.admission:
            return self._ingest(doc, authorize)

    def _ingest(self, doc: Any, authorize: Callable[[int], None] | None = None) -> IngestResult:
        """``authorize(run_id)`` raises (a BatchError with status 403) when the caller may not write that
        run; it is called before the batch is validated, so nothing of a refused batch is looked at."""
        if authorize is not None and isinstance(doc, dict):
            rid = doc.get("run_id")
            if isinstance(rid, int) and not isinstance(rid, bool):
                authorize(rid)
        batch = validate_batch(doc, self.world_size_of)
        if batch.n_records > self.max_batch_records:
            raise BatchError("batch", f"has {batch.n_records} records; the limit is {self.max_batch_records}", status=413)
        landed = self._write(batch)
        return IngestResult(
            run_id=batch.run_id,
            accepted={
                "rank_steps": batch.count("rank_steps"),
                "collectives": batch.count("collectives"),
                "modality_tokens": batch.count("modality_tokens"),
                "phases": batch.count("phases"),
                "ranks": len(batch.ranks),
                "events": landed.events,  # stored (or already stored); beyond a run's caps: dropped, counted
            },
            dropped=landed.dropped,
        )

    def _write(self, b: ValidBatch) -> Landed:
        t0 = time.perf_counter()
        codes, dims = dim_column(b)
        new_dims = [(c, n) for c, n in dims.items() if (b.run_id, c) not in self._dims_known]
        landed = landing.land_batch(self.engine, b.run_id, fragment=encode_fragment(b, codes),
                                    modality_tokens=b.modality_tokens or None, ranks=b.ranks,
                                    phases=b.phases or None, events=b.events, groups=b.groups, dims=new_dims)
        if new_dims:
            if len(self._dims_known) > 100_000:
                self._dims_known.clear()
            self._dims_known.update((b.run_id, c) for c, _ in new_dims)
        log.debug("wrote batch run=%s records=%d in %.1f ms", b.run_id, b.n_records, (time.perf_counter() - t0) * 1e3)
        return landed


def count_records(doc: Any) -> int:
    """How many records a decoded batch carries (before validation): list sections by length, columnar
    sections by their longest column — for counting the records of a refused batch."""
    if not isinstance(doc, dict):
        return 0
    n = 0
    for k, v in doc.items():
        if k in ("v", "run_id"):
            continue
        if isinstance(v, list):
            n += len(v)
        elif isinstance(v, dict):
            n += max((len(c) for c in v.values() if isinstance(c, list)), default=0)
    return n


def dim_column(b: ValidBatch) -> tuple[np.ndarray | None, dict[int, str]]:
    """The stored codes of a batch's collectives' ``dim`` column (None → 0, unknown) and {code: name}
    of the dimensions it names — one pass over the column; (None, {}) without that column."""
    cs = b.collectives
    if not cs or "dim" not in cs:
        return None, {}
    values = cs["dim"].tolist()
    codes = {v: (dim_code(v) if v is not None else 0) for v in set(values)}
    arr = np.fromiter(map(codes.__getitem__, values), dtype=np.int32, count=len(values))
    return arr, {c: v for v, c in codes.items() if v is not None}


def encode_fragment(b: ValidBatch, dim_codes: np.ndarray | None = None) -> tuple[int, int, int, int, bytes | None, bytes | None] | None:
    """A batch's rank-steps and collectives as compressed columnar blocks (one landing row);
    ``dim_codes``: the collectives' dim column as stored (``dim_column``; None: computed here)."""
    rs, cs = b.rank_steps, b.collectives
    if not rs and not cs:
        return None
    steps_all = []
    rs_blob = cs_blob = None
    n_rs = n_cs = 0
    if rs:
        n_rs = len(rs["rank"])
        nan = np.full(n_rs, np.nan)
        cols = {name: rs.get(name, nan) for name, _ in FRAG_STEP_FIELDS}
        cols["flags"] = np.nan_to_num(rs["flags"]) if "flags" in rs else np.zeros(n_rs)
        rs_blob = encode_block(FRAG_STEP_FIELDS, cols, compress=True)
        steps_all.append(rs["step"])
    if cs:
        n_cs = len(cs["rank"])
        nan = np.full(n_cs, np.nan)
        cols = {name: cs.get(name, nan) for name, _ in FRAG_COLL_FIELDS}
        if dim_codes is None:
            dim_codes = dim_column(b)[0]
        cols["dim"] = dim_codes if dim_codes is not None else np.zeros(n_cs, dtype=np.int32)
        cs_blob = encode_block(FRAG_COLL_FIELDS, cols, compress=True)
        steps_all.append(cs["step"])
    st = np.concatenate(steps_all)
    return n_rs, n_cs, int(st.min()), int(st.max()), rs_blob, cs_blob
