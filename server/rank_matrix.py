"""Per-rank × per-step matrices of a run (step time, work time and every component of the step) for the
heatmap and straggler views, and one rank's records picked out of the step blocks (``RankPicker``).

The per-rank records live in the compressed blocks of ``steps`` (one per step). Decoding every block
of a 1,024-rank × 5,000-step run takes seconds, so the decoded matrices are cached per process
(float32, ~8 MB per 1,000 ranks × 1,000 steps and field) and brought up to date incrementally: only
blocks of steps newer than the cached ones are read; when the run's rank-step counter shows that an
older step changed (a late record merged), the matrix is reloaded. The cache is bounded in bytes
(least recently used run evicted first). Step time and exposed comm are loaded with the matrix; data,
compute and other — the heatmap's other components — are loaded together the first time one is asked
for (one more pass over the blocks), and kept up to date with the rest from then on.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import Engine

from .codec import STEP_BLOCK_FIELDS, decode_block
from .downsample import MatrixReduction, reduce_matrix
from .store import ranks as rank_store
from .store import runs as run_store
from .store import steps as step_store

if TYPE_CHECKING:
    import zstandard

__all__ = ["RankMatrices", "rank_matrices", "rank_heatmap", "rank_slowdown", "clear_cache", "HEATMAP_FIELDS",
           "RankPicker"]

log = logging.getLogger(__name__)

#: heatmap fields: name -> label (seconds, per rank and step; docs/metrics.md "Step-time decomposition")
HEATMAP_FIELDS = {
    "step_s": "step time",
    "work_s": "work time (step − exposed comm)",
    "data_s": "data",
    "compute_s": "compute",
    "comm_exposed_s": "exposed comm",
    "other_s": "other",
    "straggler_wait_s": "straggler wait (slowest rank's work − this rank's)",
}
#: block fields loaded on demand, together (the heatmap of a component other than step / exposed comm)
EXTRA_FIELDS = ("data_s", "compute_s", "other_s")
_CACHE_BYTES = 512 * 1024 * 1024
_FETCH_CHUNK = 500  # steps per query while loading blocks
#: the most step × rank cells one run's matrices may hold (two float32 matrices: 64 MiB, so a run page
#: stays well under 256 MiB with its derived arrays); a larger run is sampled (every k-th step), which
#: the heatmap states. A 1,024-rank × 5,000-step run is held whole.
MAX_CELLS = 8 * 1024 * 1024
_MAX_RUN_LOCKS = 4096


#: keys of ``RankMatrices.derived``: a name ("work_s", "slowdown") or a heatmap's
#: ("heatmap", field, how, max_ranks, max_steps)
DerivedKey = str | tuple[str, str, str, int, int]
#: a cached run: (``_ekey`` of its database, run id)
_RunKey = tuple[tuple[int, str], int]


@dataclass
class RankMatrices:
    """``step_s[step_index, rank]`` and ``exposed_s`` (float32, NaN = no record) of one run."""

    run_id: int
    steps: np.ndarray
    step_s: np.ndarray
    exposed_s: np.ndarray
    cells: int  # rank-steps held
    version: tuple[int, int]  # (runs.rank_steps, runs.steps) at load time
    stride: int = 1  # every stride-th step is held (1: all)
    load_s: float = 0.0
    derived: dict[DerivedKey, Any] = field(default_factory=dict)
    #: ``EXTRA_FIELDS`` matrices once loaded (float32 [step, rank], the same rows as ``step_s``)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.step_s.nbytes + self.exposed_s.nbytes + self.steps.nbytes + sum(a.nbytes for a in self.extra.values())

    @property
    def work_s(self) -> np.ndarray:
        w = self.derived.get("work_s")
        if w is None:
            w = self.step_s - np.nan_to_num(self.exposed_s)
            self.derived["work_s"] = w
        return w

    @property
    def straggler_wait_s(self) -> np.ndarray:
        """Per rank and step: the slowest rank's work − this rank's (≥ 0): what it waits for in the
        step's collectives (its median over ranks is the step's ``straggler_wait_s``)."""
        w = self.derived.get("straggler_wait_s")
        if w is None:
            work = self.work_s
            with np.errstate(invalid="ignore"):
                slowest = np.fmax.reduce(work, axis=1) if work.size else np.empty(0, dtype=work.dtype)
                w = np.fmax(slowest[:, None] - work, 0).astype(np.float32)
            w[np.isnan(work)] = np.nan
            self.derived["straggler_wait_s"] = w
        return w


def _ekey(engine: Engine) -> tuple[int, str]:
    """Cache key of a database: the engine object and its URL (a new database never reuses entries)."""
    return id(engine), str(engine.url)


_cache: OrderedDict[_RunKey, RankMatrices] = OrderedDict()
_lock = threading.Lock()
_run_locks: dict[_RunKey, threading.Lock] = {}


def clear_cache() -> None:
    """Forget every cached matrix (tests, benchmarks measuring the cold path)."""
    with _lock:
        _cache.clear()


_BASE = ("step_s", "comm_exposed_s")  # the fields every matrix holds
_OFFSETS: dict[str, tuple[int, str]] = {}  # field -> (bytes per row before it, dtype)
_ROW_BYTES = 0
for _name, _dt in STEP_BLOCK_FIELDS:
    _OFFSETS[_name] = (_ROW_BYTES, _dt)
    _ROW_BYTES += np.dtype(_dt).itemsize


def _decompressor() -> tuple[ModuleType, zstandard.ZstdDecompressor | None]:
    from . import codec

    try:
        import zstandard

        return codec, zstandard.ZstdDecompressor()
    except ImportError:  # pragma: no cover - zstandard is a dependency of the store
        return codec, None


def _raw_block(blob: bytes, codec: ModuleType, zstd: zstandard.ZstdDecompressor | None
               ) -> tuple[int, bytes | memoryview] | None:
    """(rows, decompressed column bytes) of a step block, following ``codec.decode_block`` (whose
    block-version constants are private); None for a version it does not know."""
    version, n = struct.unpack_from("<BI", blob)
    if version == getattr(codec, "_ZSTD", None) and zstd is not None:
        return n, zstd.decompress(blob[5:], max_output_size=n * 64 + 1024)
    if version == getattr(codec, "_RAW", None):
        return n, memoryview(blob)[5:]
    if version == getattr(codec, "_ZLIB", None):
        return n, zlib.decompress(blob[5:])
    return None


def _wanted(raws: list[bytes | memoryview], n: int, want: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``want`` columns (4-byte fields) of k blocks of n rows as (k, n) arrays: copy the fields' byte
    ranges of each block, then un-shuffle all blocks at once."""
    k = len(raws)
    buf = np.empty((k, len(want), 4, n), dtype=np.uint8)
    flat = buf.reshape(k, len(want), 4 * n)
    spans = [(_OFFSETS[f][0] * n, _OFFSETS[f][0] * n + 4 * n) for f in want]
    for i, raw in enumerate(raws):
        mv = memoryview(raw)
        for j, (lo, hi) in enumerate(spans):
            flat[i, j] = np.frombuffer(mv[lo:hi], dtype=np.uint8)
    un = np.ascontiguousarray(buf.transpose(0, 1, 3, 2))  # (k, field, n, 4)
    return {f: un[:, j].view(_OFFSETS[f][1]).reshape(k, n) for j, f in enumerate(want)}


class _Rows:
    """Growable (rows, world) float32 matrix filled chunk by chunk (no final vstack copy)."""

    def __init__(self, expect: int, world: int) -> None:
        self.a = np.full((max(expect, 1), world), np.nan, dtype=np.float32)
        self.n = 0

    def add(self, chunk: np.ndarray) -> None:
        k = len(chunk)
        if self.n + k > len(self.a):
            grown = np.full((max(2 * len(self.a), self.n + k), self.a.shape[1]), np.nan, dtype=np.float32)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.a[self.n : self.n + k] = chunk
        self.n += k

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` rows (NaN), to be filled in place."""
        if self.n + k > len(self.a):
            grown = np.full((max(2 * len(self.a), self.n + k), self.a.shape[1]), np.nan, dtype=np.float32)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.n += k
        return self.a[self.n - k : self.n]

    def done(self) -> np.ndarray:
        return self.a[: self.n] if self.n < len(self.a) else self.a


def _load_blocks(engine: Engine, run_id: int, world: int, after: int | None, expect: int = 0, stride: int = 1,
                 fields: tuple[str, ...] = _BASE, upto: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Steps after ``after`` (up to ``upto`` when given) as (steps, {field: matrix[step, rank]}, cells)."""
    steps_l: list[np.ndarray] = []
    mats = {f: _Rows(expect, world) for f in fields}
    want = ("rank", *fields)
    cells = 0
    full = np.arange(world)
    codec, zstd = _decompressor()
    for rows in step_store.iter_blocks(engine, run_id, after, _FETCH_CHUNK, stride):
        last = upto is not None and rows and rows[-1][0] >= upto
        if upto is not None:
            rows = [r for r in rows if r[0] <= upto]
        if rows:
            raws = [_raw_block(b, codec, zstd) for _, b in rows]
            whole = [r for r in raws if r is not None and r[0] == world]
            fast = len(whole) == len(raws)
            cols = _wanted([r[1] for r in whole], world, want) if fast else None
            if cols is not None and np.array_equal(cols["rank"], np.broadcast_to(full, cols["rank"].shape)):
                # every rank present, in rank order (the compactor sorts by rank): no scatter needed
                for f in fields:
                    mats[f].add(cols[f])
                cells += cols["rank"].size
            else:
                dst = {f: mats[f].take(len(rows)) for f in fields}  # filled in place: no second copy of the chunk
                for i, (_, block) in enumerate(rows):
                    d = decode_block(STEP_BLOCK_FIELDS, bytes(block))
                    ranks = d["rank"]
                    ok = (ranks >= 0) & (ranks < world)
                    for f in fields:
                        dst[f][i, ranks[ok]] = d[f][ok]
                    cells += int(ok.sum())
            steps_l.append(np.array([r[0] for r in rows], dtype=np.int64))
        if last:
            break
    steps = np.concatenate(steps_l) if steps_l else np.empty(0, dtype=np.int64)
    return steps, {f: mats[f].done()[: steps.size] for f in fields}, cells


def _run_lock(key: _RunKey) -> threading.Lock:
    """The per-run load lock; the table of them stays bounded (unheld locks are dropped first)."""
    with _lock:
        lk = _run_locks.get(key)
        if lk is None:
            if len(_run_locks) >= _MAX_RUN_LOCKS:
                for k in [k for k, v in _run_locks.items() if not v.locked()]:
                    del _run_locks[k]
            lk = _run_locks[key] = threading.Lock()
        return lk


def rank_matrices(engine: Engine, run_id: int) -> RankMatrices | None:
    """The run's per-rank matrices, from the cache when still current; None for an unknown run.

    Their width is the ranks really seen (not the declared world size) and their size is bounded by
    ``MAX_CELLS``: what a page costs depends on what was received, never on what was declared."""
    if run_store.get_run(engine, run_id, pending=False) is None:
        return None
    key = (_ekey(engine), run_id)
    with _run_lock(key):
        run = run_store.get_run(engine, run_id, pending=False)
        if run is None:
            return None
        n_rank_steps, n_steps = int(run.rank_steps or 0), int(run.steps or 0)
        declared = max(1, int(run.world_size or 1))
        world = min(declared, step_store.rank_span(engine, run_id) or declared)
        stride = max(1, -(-n_steps * world // MAX_CELLS))
        version = (n_rank_steps, n_steps)
        with _lock:
            cached = _cache.get(key)
            if cached is not None:
                _cache.move_to_end(key)
        if cached is not None and cached.version == version and cached.step_s.shape[1] == world:
            return cached
        t0 = time.perf_counter()
        m: RankMatrices | None = None
        if (cached is not None and cached.step_s.shape[1] == world and cached.steps.size and stride == 1
                and cached.stride == 1):
            extra = tuple(cached.extra)  # the components loaded so far are kept up to date too
            s, mats, cells = _load_blocks(engine, run_id, world, int(cached.steps[-1]), fields=(*_BASE, *extra))
            if cached.cells + cells == n_rank_steps:
                m = RankMatrices(run_id, np.concatenate([cached.steps, s]), np.vstack([cached.step_s, mats["step_s"]]),
                                 np.vstack([cached.exposed_s, mats["comm_exposed_s"]]), cached.cells + cells, version,
                                 extra={f: np.vstack([cached.extra[f], mats[f]]) for f in extra})
        if m is None:
            s, mats, cells = _load_blocks(engine, run_id, world, None, expect=-(-n_steps // stride), stride=stride)
            m = RankMatrices(run_id, s, mats["step_s"], mats["comm_exposed_s"], cells, version, stride=stride)
        m.load_s = time.perf_counter() - t0
    log.debug("rank matrices of run %s: %d steps × %d ranks in %.2f s", run_id, m.steps.size, world, m.load_s)
    with _lock:
        _cache[key] = m
        _cache.move_to_end(key)
        _evict()
    return m


def _evict() -> None:
    """Drop the least recently used runs until the cache is within its bytes (``_lock`` held)."""
    total = sum(v.nbytes for v in _cache.values())
    while total > _CACHE_BYTES and len(_cache) > 1:
        _, old = _cache.popitem(last=False)
        total -= old.nbytes


def _extra(engine: Engine, m: RankMatrices, name: str) -> np.ndarray:
    """``m``'s matrix of an ``EXTRA_FIELDS`` field, loaded with the others on first use: one more pass
    over the same blocks (the same stride), aligned with ``m.steps``."""
    got = m.extra.get(name)
    if got is not None:
        return got
    key = (_ekey(engine), m.run_id)
    with _run_lock(key):
        if name not in m.extra:
            t0 = time.perf_counter()
            world = m.step_s.shape[1]
            upto = int(m.steps[-1]) if m.steps.size else None
            s, mats, _ = _load_blocks(engine, m.run_id, world, None, expect=m.steps.size, stride=m.stride,
                                      fields=EXTRA_FIELDS, upto=upto)
            idx = np.searchsorted(s, m.steps)
            ok = idx < s.size
            ok[ok] = s[idx[ok]] == m.steps[ok]
            for f in EXTRA_FIELDS:
                a = np.full(m.step_s.shape, np.nan, dtype=np.float32)
                a[ok] = mats[f][idx[ok]]
                m.extra[f] = a
            log.debug("components of run %s: %d steps × %d ranks in %.2f s", m.run_id, m.steps.size, world,
                      time.perf_counter() - t0)
            with _lock:
                _evict()
    return m.extra[name]


def _field_matrix(engine: Engine, m: RankMatrices, name: str) -> np.ndarray:
    if name == "step_s":
        return m.step_s
    if name == "work_s":
        return m.work_s
    if name == "comm_exposed_s":
        return m.exposed_s
    if name == "straggler_wait_s":
        return m.straggler_wait_s
    return _extra(engine, m, name)


def rank_heatmap(
    engine: Engine, run_id: int, *, field: str = "step_s", how: str = "max", max_ranks: int = 256, max_steps: int = 400
) -> dict[str, Any] | None:
    """Ranks × steps of ``field`` reduced server-side to at most ``max_ranks`` × ``max_steps`` cells.

    Returns steps (first step of each column), rank ranges of each row, values (seconds) and the
    aggregation factors; None for an unknown run."""
    if field not in HEATMAP_FIELDS:
        raise ValueError(f"field must be one of {sorted(HEATMAP_FIELDS)}, got {field!r}")
    m = rank_matrices(engine, run_id)
    if m is None:
        return None
    mat = _field_matrix(engine, m, field)
    key = ("heatmap", field, how, max_ranks, max_steps)
    red: MatrixReduction | None = m.derived.get(key)
    if red is None:
        red = reduce_matrix(mat.T, max_rows=max_ranks, max_cols=max_steps, how=how)
        m.derived[key] = red
    steps = m.steps
    return {
        "sampled_every_steps": m.stride,
        "field": field,
        "label": HEATMAP_FIELDS[field],
        "how": how,
        "values": red.values,
        "rank_lo": red.row_lo,
        "rank_hi": red.row_hi,
        "step_lo": steps[red.col_lo] if steps.size else np.empty(0, dtype=np.int64),
        "step_hi": steps[red.col_hi] if steps.size else np.empty(0, dtype=np.int64),
        "rank_factor": red.row_factor,
        "step_factor": red.col_factor,
        "n_ranks": int(mat.shape[1]),
        "n_steps": int(mat.shape[0]),
        "cells": m.cells,
    }


def _nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.nanmedian`` along ``axis``; without NaN the vectorised ``np.median`` (the same values; numpy's
    nanmedian of rows longer than 600 goes row by row: both medians of 5,000 × 1,024 took 0.25 s, now 0.17 s)."""
    return np.nanmedian(a, axis=axis) if np.isnan(a).any() else np.median(a, axis=axis)


def rank_slowdown(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """Per-rank ``slowdown`` = median over steps of (rank work_s / median work_s of the step)
    (docs/metrics.md "Stragglers"), plus the per-node median of its ranks' slowdowns."""
    m = rank_matrices(engine, run_id)
    if m is None:
        return None
    cached = m.derived.get("slowdown")
    if cached is None:
        work = m.work_s  # float32 (steps, ranks)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            slow = np.full(work.shape[1], np.nan)
            if work.size:
                med = _nanmedian(work, axis=1)  # one partitioned copy of the matrix
                lost = np.nansum(np.fmax.reduce(work, axis=1) - med)
                # per rank, in column chunks: temporaries stay a few MiB whatever the width
                for lo in range(0, work.shape[1], 4096):
                    chunk = work[:, lo:lo + 4096]
                    seen = ~np.isnan(chunk).all(axis=0)
                    if seen.any():
                        idx = np.flatnonzero(seen)
                        slow[lo + idx] = _nanmedian(chunk[:, idx] / med[:, None], axis=0)
            else:
                lost = 0.0
        cached = {"slowdown": slow, "time_lost_s": float(lost)}
        m.derived["slowdown"] = cached
    hosts = rank_store.node_of_rank(engine, run_id)
    slow = cached["slowdown"]
    ranks = np.arange(slow.size)
    node_of = [hosts.get(int(r)) or "?" for r in ranks]
    by_node: dict[str, list[float]] = {}
    for r, nd in zip(ranks, node_of, strict=True):
        if not np.isnan(slow[r]):
            by_node.setdefault(nd, []).append(float(slow[r]))
    nodes = sorted(((nd, float(np.median(v)), len(v)) for nd, v in by_node.items()), key=lambda t: -t[1])
    return {
        "rank": ranks,
        "slowdown": slow,
        "node_of": node_of,
        "nodes": [{"node": nd, "slowdown": s, "ranks": k} for nd, s, k in nodes],
        "time_lost_s": cached["time_lost_s"],
        "known_hosts": bool(hosts),
    }


class RankPicker:
    """One rank's record picked out of step blocks: each block is decompressed (a zstd frame has no
    random access) and only the rank's bytes of the wanted fields are read — found by the rank column
    (rows are in rank order: row ``rank`` when every rank is present, else a binary search). The cost
    per block is one decompression, never a decode of every field of every rank. Not thread-safe (one
    per request)."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        unknown = [f for f in fields if f not in _OFFSETS]
        if unknown:
            raise ValueError(f"unknown rank-step fields {unknown}")
        self.fields = fields
        #: field -> (bytes per row before it, struct format, size)
        self._layout = {f: (_OFFSETS[f][0], "<" + np.dtype(_OFFSETS[f][1]).char, np.dtype(_OFFSETS[f][1]).itemsize)
                        for f in fields}
        self._codec, self._zstd = _decompressor()

    def pick(self, blob: bytes, rank: int) -> dict[str, float] | None:
        """{field: value (NaN = not measured)} of ``rank`` in the block, None when it has no record there."""
        got = _raw_block(blob, self._codec, self._zstd)
        if got is None:  # a block version this reader does not know: the full decode
            d = decode_block(STEP_BLOCK_FIELDS, bytes(blob))
            hit = np.flatnonzero(d["rank"] == rank)
            return None if not hit.size else {f: float(d[f][hit[0]]) for f in self.fields}
        n, raw = got
        if n <= 0:
            return None
        row = self._row(raw, n, rank)
        if row is None:
            return None
        out: dict[str, float] = {}
        for f, (off, fmt, size) in self._layout.items():
            lo = off * n + row
            if lo + (size - 1) * n >= len(raw):  # a field appended after this block was written: not measured
                out[f] = float("nan")
                continue
            out[f] = float(struct.unpack(fmt, bytes(raw[lo:lo + size * n:n]))[0])  # the row's byte of each plane
        return out

    @staticmethod
    def _row(raw: bytes | memoryview, n: int, rank: int) -> int | None:
        if rank < n and int.from_bytes(bytes(raw[rank:rank + 4 * n:n]), "little", signed=True) == rank:
            return rank  # every rank up to it present: its own row
        ranks = np.frombuffer(raw, dtype=np.uint8, count=4 * n, offset=0).reshape(4, n).T.copy().view("<i4").ravel()
        i = int(np.searchsorted(ranks, rank))
        if i < n and ranks[i] == rank:
            return i
        hit = np.flatnonzero(ranks == rank)  # not in rank order (never written so): a scan
        return int(hit[0]) if hit.size else None
