"""The compactor: folds landed batch fragments into one ``steps`` row per (run, step) with rollups.

A step is ready when all ``world_size`` ranks have reported, when its newest record is older than
the grace period, when its run is no longer running, or when a block for it already exists (a late
or retried record is merged). One transaction: fragments are read and decoded (numpy), ready
steps are deduplicated against each other and the existing block, encoded, and the step, per-run
collective and counter rollups are upserted; fragments are deleted, and what was not ready is
rewritten as a new fragment keeping its arrival time — a crash leaves the fragments in place.
Rollups are vectorised over all steps of a pass (sort-based grouped medians), so the cost per
rank-step stays ~µs whatever the world size. This module decides and computes; its SQL (reading
fragments, the COPY of step rows, the upserts) is ``store.compaction``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from sqlalchemy import Engine

from .codec import (
    COLL_BLOCK_FIELDS,
    FRAG_COLL_FIELDS,
    FRAG_STEP_FIELDS,
    STEP_BLOCK_FIELDS,
    decode_block,
    decode_blocks,
    encode_block,
    encode_blocks,
)
from .grouped import grouped_argmax, grouped_median, grouped_medians, unique_rows
from .limits import MAX_COLLECTIVES_PER_RANK_STEP, MAX_PHASE_NAMES_PER_RUN
from .store import bounds
from .store import compaction as store
from .validate import OP_CODE

__all__ = ["Compactor", "CompactionResult", "grouped_median", "bits_of", "CompactionWorkers"]

log = logging.getLogger(__name__)

_MAX_FRAGMENTS = 5000
_MAX_RECORDS = 600_000  # rank-steps + collectives decoded per pass (bounds memory)

_MEDIAN_COLS = (
    "step_s",
    "data_s",
    "compute_s",
    "comm_exposed_s",
    "other_s",
    "comm_total_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
)
_SUM_COLS = ("tokens", "padded_tokens", "samples", "flops", "alloc_retries", "hw_flops")
_ROLL_FLOATS = (
    "ts", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s", "forward_s", "backward_s",
    "optimizer_s", "step_s_max", "work_s", "work_s_max",
    "tokens", "padded_tokens", "samples", "flops", "mem_peak_bytes", "mem_reserved_bytes", "alloc_retries",
    "hw_flops",  # last: written after the blocks (store.compaction.STEP_COLUMNS)
)  # fmt: skip
_MAX_COLS = ("mem_peak_bytes", "mem_reserved_bytes")


@dataclass
class CompactionResult:
    more: bool = False
    steps: int = 0
    rank_steps: int = 0
    collectives: int = 0
    duplicates: int = 0
    backlog_rows: int = 0
    seconds: float = 0.0
    runs: set[int] = field(default_factory=set)

    def merge(self, other: CompactionResult) -> None:
        """Add the counts of another partition's pass."""
        self.more = self.more or other.more
        self.steps += other.steps
        self.rank_steps += other.rank_steps
        self.collectives += other.collectives
        self.duplicates += other.duplicates
        self.runs |= other.runs


def _big(res: CompactionResult) -> bool:
    """A pass that folded a quarter of what one pass may take: more has likely landed meanwhile, so the
    loop passes again at once (a burst is folded back to back); after small passes it waits its
    interval, so a trickle of small batches is folded in few passes, not one pass per batch."""
    return res.rank_steps + res.collectives >= _MAX_RECORDS // 4


def bits_of(ranks: np.ndarray) -> str:
    """Bit string with bit r set for each rank r (Postgres ``bit varying`` text)."""
    bits = np.zeros(int(ranks.max()) + 1 if len(ranks) else 0, dtype=np.uint8)
    bits[ranks] = 1
    return (bits + 48).tobytes().decode()


def ranks_of(bits: str) -> np.ndarray:
    return np.flatnonzero(np.frombuffer(bits.encode(), dtype=np.uint8) == 49)


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal values in a sorted key array."""
    if len(keys) == 0:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])


def _grouped_sum(values: np.ndarray, gid: np.ndarray, n: int) -> np.ndarray:
    ok = ~np.isnan(values)
    s = np.bincount(gid, weights=np.where(ok, values, 0.0), minlength=n)
    return np.where(np.bincount(gid, weights=ok, minlength=n) > 0, s, np.nan)


def _grouped_max(values: np.ndarray, gid: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    ok = ~np.isnan(values)
    np.maximum.at(out, gid[ok], values[ok])
    return np.where(np.isinf(out), np.nan, out)


class Fold(Protocol):
    """An extra rollup folded in the compaction transaction (see ``Compactor.folds``)."""

    def __call__(self, sink: store.RollupWriter, *, S: dict[str, np.ndarray], C: dict[str, np.ndarray],
                 gid: np.ndarray, cgid: np.ndarray, gkeys: np.ndarray) -> None: ...


class Compactor:
    """Runs compaction passes, on a background thread or on demand (``run_once``)."""

    def __init__(self, engine: Engine, *, grace_s: float = 10.0,
                 on_pass: Callable[[CompactionResult], None] | None = None) -> None:
        self.engine = engine
        self.grace_s = grace_s
        self.on_pass = on_pass
        #: extra rollups folded in the same transaction: fn(writer, *, S, C, gid, cgid, gkeys) where writer is a
        #: ``store.compaction.RollupWriter`` on the compaction's cursor, S/C are
        #: the deduplicated rank-step/collective columns of the touched steps (S["is_old"] marks rows that
        #: were already compacted), gid/cgid their group index into gkeys = run_id << 32 | step.
        self.folds: list[Fold] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._turn = 0  # where the next pass starts in the list of pending partitions
        self.errors = 0

    def start(self, interval_s: float) -> None:
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="fleetscope-compactor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                while True:
                    res = self.run_once()
                    if self.on_pass is not None:
                        self.on_pass(res)
                    if not (res.more or _big(res)) or self._stop.is_set():
                        break
            except Exception:  # noqa: BLE001 - keep compacting; the raw rows stay until a pass succeeds
                self.errors += 1
                log.exception("compaction pass failed (raw rows kept; will retry)")

    def run_once(self, *, force: bool = False) -> CompactionResult:
        """One compaction pass; ``force`` compacts every landed step now (tests, shutdown)."""
        with self._lock:
            t0 = time.perf_counter()
            res = self._pass(force)
            res.seconds = time.perf_counter() - t0
            return res

    def _pass(self, force: bool) -> CompactionResult:
        """Compact every partition with pending work that no other compactor holds (``force``: wait
        for those too). Each partition is its own transaction, bounded like a whole pass used to be.
        Partitions are tried oldest work first, from a position that moves on at each pass, so
        compactors spread over partitions. ``more``: a partition had more than one pass can take."""
        res = CompactionResult()
        with store.transaction(self.engine) as cur:
            parts = store.pending_partitions(cur)
        if parts:
            k = self._turn % len(parts)
            self._turn += 1
            for part in parts[k:] + parts[:k]:
                with store.transaction(self.engine) as cur:
                    if not store.try_lock(cur, part, wait=force):
                        continue  # another compactor holds it: try the next partition
                    one = self._pass_partition(cur, part, force)
                res.merge(one)
        with store.transaction(self.engine) as cur:
            res.backlog_rows = store.backlog_rows(cur)
        return res

    def _pass_partition(self, cur: Any, part: int, force: bool) -> CompactionResult:
        res = CompactionResult()
        frags = store.read_fragments(cur, _MAX_FRAGMENTS, part)
        taken: list[tuple[Any, ...]] = []
        total = 0
        for f in frags:
            if taken and total + f[4] > _MAX_RECORDS:
                res.more = True
                break
            taken.append(f)
            total += f[4]
        if len(frags) == _MAX_FRAGMENTS:
            res.more = True
        ready_keys = self._compact_fragments(cur, taken, force, res) if taken else np.empty(0, dtype=np.int64)
        self._compact_modalities(cur, ready_keys, force, part)
        return res

    def _compact_fragments(self, cur: Any, frags: list[tuple[Any, ...]], force: bool, res: CompactionResult) -> np.ndarray:
        """Fold the ready steps of ``frags``; rewrite the rest. Returns the folded group keys."""
        S = _decode_frags(frags, 5, FRAG_STEP_FIELDS)
        C = _decode_frags(frags, 6, FRAG_COLL_FIELDS)
        run_ids = np.unique(np.array([f[1] for f in frags]))
        info = store.run_info(cur, run_ids.tolist())
        ks = S["run_id"] * (1 << 32) + S["step"]
        kc = C["run_id"] * (1 << 32) + C["step"]
        gkeys = _union_keys(ks, kc)
        if len(gkeys) == 0:
            store.delete_fragments(cur, [f[0] for f in frags])
            return gkeys
        g_s = np.searchsorted(gkeys, ks)
        g_c = np.searchsorted(gkeys, kc)
        existing = store.existing_blocks(cur, (gkeys >> 32).tolist(), (gkeys & 0xFFFFFFFF).tolist())
        n = len(gkeys)
        ready = np.zeros(n, dtype=bool)
        if force:
            ready[:] = True
        g_run = gkeys >> 32
        for r, (_ws, status) in info.items():
            if status not in ("running", "stalled", "hung"):  # an ended run's steps need not wait for late ranks
                ready |= g_run == r
        if existing:
            ekeys = np.array([e[0] * (1 << 32) + e[1] for e in existing], dtype=np.int64)
            ready[np.searchsorted(gkeys, ekeys)] = True
        # all ranks present (distinct ranks among the new rows)
        if len(ks):
            rk = g_s * (1 << 32) + S["rank"]
            uniq = rk if (np.diff(rk) > 0).all() else np.unique(rk)
            have = np.bincount(uniq >> 32, minlength=n)
            ws_of = np.array([info.get(int(r), (1 << 30, ""))[0] for r in g_run])
            ready |= have >= ws_of
        # the newest record of the step is older than the grace period
        young = np.full(n, np.inf)
        np.minimum.at(young, g_s, S["age"])
        np.minimum.at(young, g_c, C["age"])
        ready |= young >= self.grace_s
        if ready.any():
            rs_mask, rc_mask = ready[g_s], ready[g_c]
            if ready.all():
                self._fold(cur, S, C, existing, res)
            else:
                self._fold(cur, {k: v[rs_mask] for k, v in S.items()}, {k: v[rc_mask] for k, v in C.items()}, existing, res)
        # rewrite what is not ready as new fragments (same arrival time), drop the consumed ones
        left_s, left_c = ~ready[g_s], ~ready[g_c]
        rows = []
        # rows are in fragment order (decoded one fragment after another): each fragment is a slice
        frag_ids = np.union1d(S["frag"][left_s], C["frag"][left_c]).astype(np.int64)
        s_lo, s_hi = np.searchsorted(S["frag"], frag_ids, "left"), np.searchsorted(S["frag"], frag_ids, "right")
        c_lo, c_hi = np.searchsorted(C["frag"], frag_ids, "left"), np.searchsorted(C["frag"], frag_ids, "right")
        for j, i in enumerate(frag_ids.tolist()):
            sa, sb, ca, cb = int(s_lo[j]), int(s_hi[j]), int(c_lo[j]), int(c_hi[j])
            ms, mc = left_s[sa:sb], left_c[ca:cb]
            f = frags[i]
            steps = np.concatenate([S["step"][sa:sb][ms], C["step"][ca:cb][mc]])
            rows.append((
                f[1], f[3], int(ms.sum()), int(mc.sum()), int(steps.min()), int(steps.max()),
                encode_block(FRAG_STEP_FIELDS, {k: S[k][sa:sb][ms] for k, _ in FRAG_STEP_FIELDS}, compress=True) if ms.any() else None,
                encode_block(FRAG_COLL_FIELDS, {k: C[k][ca:cb][mc] for k, _ in FRAG_COLL_FIELDS}, compress=True) if mc.any() else None,
            ))  # fmt: skip
        store.delete_fragments(cur, [f[0] for f in frags])
        store.insert_fragments(cur, rows)
        return gkeys[ready]

    def _compact_modalities(self, cur: Any, ready_keys: np.ndarray, force: bool, part: int | None = None) -> None:
        for kind in ("modality", "phase"):
            mods = store.take_modalities(cur, force=force, grace_s=self.grace_s, run_ids=(ready_keys >> 32).tolist(),
                                         steps=(ready_keys & 0xFFFFFFFF).tolist(), kind=kind, part=part)
            if mods:
                self._fold_modalities(cur, mods, kind)

    def _fold(self, cur: Any, new_s: dict[str, np.ndarray], new_c: dict[str, np.ndarray],
              existing: list[tuple[int, int, bytes, bytes | None]],
              res: CompactionResult) -> None:
        # --- existing blocks first (they win over re-sent copies), then the new rows
        names = [n for n, _ in STEP_BLOCK_FIELDS]
        cols: dict[str, list[np.ndarray]] = {n: [] for n in ("run_id", "step", "is_old", *names)}
        ccols: dict[str, list[np.ndarray]] = {n: [] for n in ("run_id", "step", "is_old", *(n for n, _ in COLL_BLOCK_FIELDS))}
        for run_id, step, block, coll_block in existing:
            d = decode_block(STEP_BLOCK_FIELDS, block)
            k = len(d["rank"])
            cols["run_id"].append(np.full(k, run_id))
            cols["step"].append(np.full(k, step))
            cols["is_old"].append(np.ones(k, dtype=bool))
            for n in names:
                cols[n].append(d[n])
            if coll_block is not None:
                cdec = decode_block(COLL_BLOCK_FIELDS, coll_block)
                k = len(cdec["rank"])
                ccols["run_id"].append(np.full(k, run_id))
                ccols["step"].append(np.full(k, step))
                ccols["is_old"].append(np.ones(k, dtype=bool))
                for n, _ in COLL_BLOCK_FIELDS:
                    ccols[n].append(cdec[n])
        for src, dst, fields in ((new_s, cols, STEP_BLOCK_FIELDS), (new_c, ccols, COLL_BLOCK_FIELDS)):
            k = len(src["run_id"])
            dst["run_id"].append(src["run_id"])
            dst["step"].append(src["step"])
            dst["is_old"].append(np.zeros(k, dtype=bool))
            for n, _ in fields:
                dst[n].append(src[n])
        S = {n: v[0] if len(v) == 1 else np.concatenate(v) for n, v in cols.items()}  # one part: no copy
        C = {n: v[0] if len(v) == 1 else np.concatenate(v) for n, v in ccols.items()}
        # hardware FLOPs came later: blocks and fragments written before decode them as 0 (not measured)
        S["hw_flops"] = np.where(S["hw_flops"] > 0, S["hw_flops"], np.nan)

        # groups = (run_id, step) present in either table, sorted
        keys_s = S["run_id"] * (1 << 32) + S["step"]
        keys_c = C["run_id"] * (1 << 32) + C["step"]
        gkeys = _union_keys(keys_s, keys_c)
        n_groups = len(gkeys)
        # sort by (group, rank[, seq]) once and keep the first row of each key: existing block rows
        # come first and the sort is stable, so a re-sent copy never replaces what is stored
        S, dup_s = _sort_dedup(S, np.searchsorted(gkeys, keys_s) * (1 << 24) + S["rank"])
        C, dup_c = _sort_dedup(C, np.searchsorted(gkeys, keys_c) * (1 << 24) + C["rank"], C["seq"])
        C, capped = cap_per_rank_step(C, MAX_COLLECTIVES_PER_RANK_STEP)
        bounds.add_folded(cur, [(int(r), "collectives", int(k)) for r, k in capped.items()])
        gid = S["_key"] >> 24
        cgid = C["_key"] >> 24
        res.duplicates = dup_s + dup_c
        res.rank_steps = int((~S["is_old"]).sum())
        res.collectives = int((~C["is_old"]).sum())

        # rollups (vectorised over all groups; rows are sorted by group)
        n_ranks = np.bincount(gid, minlength=n_groups)
        work = S["step_s"] - np.nan_to_num(S["comm_exposed_s"])
        med_cols = [S[c] for c in _MEDIAN_COLS] + [work]
        meds = grouped_medians(med_cols, gid, n_ranks)
        roll: dict[str, np.ndarray] = dict(zip((*_MEDIAN_COLS, "work_s"), meds, strict=True))
        roll["step_s_max"] = _grouped_max(S["step_s"], gid, n_groups)
        roll["work_s_max"] = _grouped_max(work, gid, n_groups)
        for c in _SUM_COLS:
            roll[c] = _grouped_sum(S[c], gid, n_groups)
        for c in _MAX_COLS:
            roll[c] = _grouped_max(S[c], gid, n_groups)
        ts_ok = ~np.isnan(S["ts"])
        ts_min = np.full(n_groups, np.inf)
        np.minimum.at(ts_min, gid[ts_ok], S["ts"][ts_ok])
        roll["ts"] = np.where(np.isinf(ts_min), np.nan, ts_min)
        slowest = grouped_argmax(np.nan_to_num(work, nan=-np.inf), gid, last=True)
        slow = np.full(n_groups, -1, dtype=np.int64)
        slow[gid[slowest]] = S["rank"][slowest]
        neg = np.bincount(gid, weights=(S["flags"] & 1) > 0, minlength=n_groups).astype(np.int64)
        n_coll = np.bincount(cgid, minlength=n_groups)

        # per-group blocks
        s_starts = np.r_[0, np.cumsum(n_ranks)]
        c_starts = np.r_[0, np.cumsum(n_coll)]
        run_ids = gkeys >> 32
        steps = gkeys & 0xFFFFFFFF
        floats = np.stack([roll[c] for c in _ROLL_FLOATS], axis=1)

        blocks = encode_blocks(STEP_BLOCK_FIELDS, S, s_starts)
        coll_blocks = encode_blocks(COLL_BLOCK_FIELDS, C, c_starts)

        def step_rows() -> Iterator[tuple[Any, ...]]:
            for g in range(n_groups):
                a, b = s_starts[g], s_starts[g + 1]
                block = blocks[g]
                rank_bits = bits_of(S["rank"][a:b]) if b > a else ""
                coll_block = coll_blocks[g] if c_starts[g + 1] > c_starts[g] else None
                fl = [None if x != x else x for x in floats[g].tolist()]
                yield (
                    int(run_ids[g]), int(steps[g]), int(n_ranks[g]), *fl[:13],
                    int(slow[g]) if slow[g] >= 0 else None, *fl[13:-1],
                    int(neg[g]), int(n_coll[g]), rank_bits, block, coll_block, fl[-1],
                )  # fmt: skip

        store.write_steps(cur, step_rows(), fresh=not existing)
        res.steps = n_groups

        # per-run collective rollup from the NEW collective rows only (additive)
        newc = ~C["is_old"]
        if newc.any():
            calls = np.maximum(C["calls"][newc], 1)
            per_call = C["bytes"][newc] / calls
            bucket = np.floor(np.log2(np.maximum(per_call, 1))).astype(np.int64)
            uniq, inv = unique_rows(C["run_id"][newc], C["op"][newc], C["group_size"][newc], bucket, C["dim"][newc])
            m = len(uniq)
            agg = [
                np.bincount(inv, minlength=m),
                np.bincount(inv, weights=C["calls"][newc], minlength=m),
                np.bincount(inv, weights=C["bytes"][newc], minlength=m),
                np.bincount(inv, weights=C["total_s"][newc], minlength=m),
                np.bincount(inv, weights=np.nan_to_num(C["exposed_s"][newc]), minlength=m),
            ]
            store.upsert_run_collectives(
                cur,
                [
                    (int(u[0]), int(u[1]), int(u[2]), int(u[3]), int(u[4]), int(agg[0][i]), int(agg[1][i]),
                     float(agg[2][i]), float(agg[3][i]), float(agg[4][i]))
                    for i, u in enumerate(uniq)
                ],
            )
        if len(C["rank"]):
            store.upsert_step_comm(cur, step_comm_rows(C, cgid, gkeys, n_ranks))
        writer = store.RollupWriter(cur)
        for fold in self.folds:
            fold(writer, S=S, C=C, gid=gid, cgid=cgid, gkeys=gkeys)
        # per-run counters
        per_run: dict[int, tuple[int, int, int, int]] = {}
        had = np.bincount(gid, weights=S["is_old"], minlength=n_groups)
        became = (n_ranks > 0) & (had == 0)  # steps that now have rank-step rows for the first time
        for r in np.unique(run_ids):
            r = int(r)
            in_run = run_ids == r
            n_new_s = int(((~S["is_old"]) & (S["run_id"] == r)).sum())
            n_new_c = int(((~C["is_old"]) & (C["run_id"] == r)).sum())
            n_new_steps = int((became & in_run).sum())
            per_run[r] = (n_new_s, n_new_c, n_new_steps, int(steps[in_run].max()))
            res.runs.add(r)
        store.bump_run_counters(cur, [(*v, k) for k, v in per_run.items()])

    def _fold_modalities(self, cur: Any, mods: list[tuple[int, int, int, str, Any]], kind: str = "modality") -> None:
        """Sum landed (run, step, rank, name, value) rows per (run, step, name), each rank once."""
        agg: dict[tuple[int, int, str], dict[int, Any]] = {}
        conv = int if kind == "modality" else float
        if kind == "phase":
            mods = bound_phase_names(cur, mods)
        for run_id, step, rank, modality, tokens in mods:
            agg.setdefault((run_id, step, modality), {}).setdefault(rank, conv(tokens))
        keys = list(agg)
        existing = {k: set(ranks_of(bits).tolist()) for k, bits in store.modality_ranks(cur, keys, kind).items()}
        rows = []
        per_rank_sums: dict[tuple[int, int, str], list[int]] = {}  # (run, rank, modality) -> [tokens, steps]
        for key, per_rank in agg.items():
            have = existing.get(key, set())
            add = {r: t for r, t in per_rank.items() if r not in have}
            if not add:
                continue
            all_ranks = np.array(sorted(have | set(add)))
            rows.append((key[0], key[1], key[2], sum(add.values()), bits_of(all_ranks)))
            if kind == "modality":  # the same ranks, once each, per rank (token balance)
                for r, t in add.items():
                    s = per_rank_sums.setdefault((key[0], r, key[2]), [0, 0])
                    s[0] += t
                    s[1] += 1
        store.upsert_modalities(cur, rows, kind)
        if per_rank_sums:
            store.upsert_rank_modalities(cur, [(*k, v[0], v[1]) for k, v in per_rank_sums.items()])


def bound_phase_names(cur: Any, mods: list[tuple[int, int, int, str, Any]]) -> list[tuple[int, int, int, str, Any]]:
    """Landed (run, step, rank, phase, seconds) rows with each run's custom phase names bounded: a run
    keeps its first ``MAX_PHASE_NAMES_PER_RUN`` names (``run_names``; first seen by step, then name),
    later names fold into ``bounds.OVERFLOW_PHASE`` (the agent's own overflow name, not counted in the
    bound) and the folded records are counted (``run_folded`` "phase_names"). Retried copies are dropped
    first (first copy wins, as for every landed row), then the folded seconds of a (run, step, rank) are
    summed. Runs the compactor folds are under its partition lock: one admission at a time per run."""
    first: dict[int, dict[str, int]] = {}  # run -> {name: first step seen}
    for run_id, step, _rank, name, _v in mods:
        if name != bounds.OVERFLOW_PHASE:
            seen_at = first.setdefault(int(run_id), {})
            seen_at[name] = min(int(step), seen_at.get(name, int(step)))
    if not first:
        return mods
    run_ids = sorted(first)
    kept = bounds.kept_names(cur, "phase", run_ids)
    admit: list[tuple[int, str]] = []
    for r in run_ids:
        have = kept.setdefault(r, set())
        new = sorted((st, name) for name, st in first[r].items() if name not in have)
        room = max(MAX_PHASE_NAMES_PER_RUN - len(have - {bounds.OVERFLOW_PHASE}), 0)
        for _, name in new[:room]:
            have.add(name)
            admit.append((r, name))
    bounds.admit_names(cur, "phase", admit)
    seen: set[tuple[int, int, int, str]] = set()
    out: dict[tuple[int, int, int, str], float] = {}
    n_folded: dict[int, int] = {}
    for run_id, step, rank, name, v in mods:
        k = (int(run_id), int(step), int(rank), name)
        if k in seen:
            continue
        seen.add(k)
        if name != bounds.OVERFLOW_PHASE and name not in kept[k[0]]:
            n_folded[k[0]] = n_folded.get(k[0], 0) + 1
            k = (k[0], k[1], k[2], bounds.OVERFLOW_PHASE)
        out[k] = out.get(k, 0.0) + float(v)
    bounds.add_folded(cur, [(r, "phase_names", n) for r, n in n_folded.items()])
    return [(*k, v) for k, v in out.items()]


_P2P_OPS = np.array([OP_CODE["send"], OP_CODE["recv"]])
P2P_DIM = -1
"""``step_comm.dim`` of the row that sums every point-to-point call (send/recv) of a step: the
pipeline bubble (time a stage waits on its neighbours)."""


def step_comm_rows(C: dict[str, np.ndarray], cgid: np.ndarray, gkeys: np.ndarray,
                   n_ranks: np.ndarray) -> list[tuple[int, int, int, float, float, float, float]]:
    """Per (step, dimension): the cross-rank medians of each rank's summed calls, bytes, total and
    exposed seconds (a rank of the step without a call in that dimension counts 0); plus the same
    for the step's send/recv calls under ``P2P_DIM``. ``C`` holds every row of the steps (stored and
    new), ``cgid`` their step group, ``n_ranks`` the ranks with a rank-step in each group."""
    dims = C["dim"].astype(np.int64)
    p2p = np.isin(C["op"], _P2P_OPS)
    gid = np.concatenate([cgid, cgid[p2p]])
    dim = np.concatenate([dims, np.full(int(p2p.sum()), P2P_DIM)])
    rank = np.concatenate([C["rank"], C["rank"][p2p]])
    vals = [np.concatenate([C[c], C[c][p2p]]) for c in ("calls", "bytes", "total_s")]
    vals.append(np.nan_to_num(np.concatenate([C["exposed_s"], C["exposed_s"][p2p]])))
    # per (group, dim, rank) sums, in (group, dim, rank) order
    cells, inv = unique_rows(gid, dim, rank)
    sums = [np.bincount(inv, weights=v, minlength=len(cells)) for v in vals]
    g1, d1 = cells[:, 0], cells[:, 1]
    # per (group, dim): median over the step's ranks, a rank without a call counting 0 — vectorised: the
    # pairs that share a rank count n go in one zero-filled (pairs, n) matrix, one np.median per count
    new2 = np.r_[True, (np.diff(g1) != 0) | (np.diff(d1) != 0)]
    s2 = np.flatnonzero(new2)
    k = np.diff(np.r_[s2, len(g1)])
    g2, d2 = g1[s2], d1[s2]
    n = np.maximum(n_ranks[g2].astype(np.int64), k)
    meds = np.empty((len(s2), len(sums)))
    for width in np.unique(n):
        sel = np.flatnonzero(n == width)
        ks = k[sel]
        out_at = np.repeat(np.cumsum(ks) - ks, ks)
        pos = np.arange(int(ks.sum())) - out_at  # each row's place among its pair's ranks
        rows = np.repeat(s2[sel], ks) + pos
        prow = np.repeat(np.arange(len(sel)), ks)
        for j, v in enumerate(sums):
            m = np.zeros((len(sel), int(width)))
            m[prow, pos] = v[rows]
            meds[sel, j] = np.median(m, axis=1)
    keys = gkeys[g2].astype(np.int64)
    return list(zip((keys >> 32).tolist(), (keys & 0xFFFFFFFF).tolist(), d2.astype(np.int64).tolist(),
                    *(meds[:, j].tolist() for j in range(meds.shape[1])), strict=True))


def _decode_frags(frags: list[tuple[Any, ...]], col: int, fields: tuple[tuple[str, str], ...]) -> dict[str, np.ndarray]:
    """Concatenate one block column of many fragments, with run_id, fragment index and age."""
    idx = [i for i, f in enumerate(frags) if f[col] is not None]
    out, counts = decode_blocks(fields, [frags[i][col] for i in idx])
    out["run_id"] = np.repeat(np.array([frags[i][1] for i in idx], dtype=np.int64), counts)
    out["frag"] = np.repeat(np.array(idx, dtype=np.int64), counts)
    out["age"] = np.repeat(np.array([frags[i][2] for i in idx], dtype=np.float64), counts)
    return out


def _f(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def _union_keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted unique union of two key arrays that are mostly runs of equal values."""
    def runs(x: np.ndarray) -> np.ndarray:
        return x[np.r_[True, x[1:] != x[:-1]]] if len(x) else x

    return np.union1d(runs(a), runs(b))


def cap_per_rank_step(C: dict[str, np.ndarray], cap: int) -> tuple[dict[str, np.ndarray], dict[int, int]]:
    """At most ``cap`` collective records per (step, rank): ``C`` sorted by ``_key`` (group << 24 | rank)
    as ``_sort_dedup`` leaves it; stored rows (``is_old``) are always kept, then new ones in ``seq``
    order up to the cap. Returns the kept rows (order unchanged) and {run: new records dropped}."""
    n = len(C["_key"])
    if n <= cap:
        return C, {}
    key = C["_key"]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    if (np.diff(np.r_[starts, n]) <= cap).all():
        return C, {}
    # position of each row in its (step, rank): stored rows first, then new rows by seq
    order = np.lexsort((C["seq"], ~C["is_old"], key))
    group_start = np.repeat(starts, np.diff(np.r_[starts, n]))  # rows stay grouped by key in any order
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n) - group_start
    keep = C["is_old"] | (pos < cap)
    dropped = ~keep
    runs, counts = np.unique(C["run_id"][dropped], return_counts=True)
    return {k: v[keep] for k, v in C.items()}, {int(r): int(c) for r, c in zip(runs, counts, strict=True)}


def _sort_dedup(cols: dict[str, np.ndarray], key: np.ndarray, key2: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Rows sorted by (key, key2), keeping the first of equal keys (stable: earlier rows win)."""
    n = len(key)
    if n == 0:
        return {**cols, "_key": key}, 0
    if key2 is None:
        diff = np.diff(key)
        if (diff > 0).all():  # already sorted and unique (the common case)
            return {**cols, "_key": key}, 0
        order = np.argsort(key, kind="stable")
        sk = key[order]
        first = np.r_[True, sk[1:] != sk[:-1]]
    else:
        d1, d2 = np.diff(key), np.diff(key2)
        if ((d1 > 0) | ((d1 == 0) & (d2 > 0))).all():
            return {**cols, "_key": key}, 0
        order = np.lexsort((key2, key))
        sk, sk2 = key[order], key2[order]
        first = np.r_[True, (sk[1:] != sk[:-1]) | (sk2[1:] != sk2[:-1])]
    keep = order[first]
    out = {k: v[keep] for k, v in cols.items()}
    out["_key"] = key[keep]
    return out, n - len(keep)


def _worker_main(url: str, grace_s: float, interval_s: float, stop: Any, index: int, passes: Any = None) -> None:
    """A compaction worker process: its own engine and compactor loop until ``stop`` is set. Each pass
    that folded steps is reported on ``passes`` (seconds, rank-steps, collectives, duplicates) for the
    server process's metrics; a full queue drops the report, never blocks compaction."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through ``stop``
    from .analysis.rollups import fold_rank_rollups
    from .db import make_engine

    engine = make_engine(url, pool_size=2)

    def report(res: CompactionResult) -> None:
        if passes is not None and res.steps:
            try:
                passes.put_nowait((res.seconds, res.rank_steps, res.collectives, res.duplicates))
            except Exception:  # noqa: BLE001 - queue full (the server stopped draining): drop the report
                pass

    comp = Compactor(engine, grace_s=grace_s)
    comp.folds.append(fold_rank_rollups)
    comp._turn = index  # start each worker at a different partition
    try:
        while not stop.wait(interval_s):
            try:
                while True:
                    res = comp.run_once()
                    report(res)
                    if not (res.more or _big(res)) or stop.is_set():
                        break
            except Exception:  # noqa: BLE001 - keep compacting; raw rows stay until a pass succeeds
                log.exception("compaction worker %d: pass failed (raw rows kept; will retry)", index)
    finally:
        engine.dispose()


class CompactionWorkers:
    """N compaction processes (``fleetscope serve --compaction-workers N``): compaction off the
    request-serving process, on as many cores as asked. Work is partitioned by run (``store.compaction.
    PARTITIONS``), so the workers — and the workers of other server instances on the same database —
    never fold the same run at once."""

    def __init__(self, url: str, n: int, *, grace_s: float, interval_s: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # no inherited threads, sockets or connection pools
        self._stop = ctx.Event()
        self._passes = ctx.Queue(maxsize=10_000)
        self._procs = [ctx.Process(target=_worker_main, args=(url, grace_s, interval_s, self._stop, i, self._passes),
                                   name=f"fleetscope-compactor-{i}", daemon=True) for i in range(n)]

    def start(self) -> None:
        for p in self._procs:
            p.start()

    def alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)

    def drain_passes(self, limit: int = 10_000) -> list[tuple[float, int, int, int]]:
        """The passes the workers reported since the last call: (seconds, rank-steps, collectives,
        duplicates) each."""
        import queue

        out: list[tuple[float, int, int, int]] = []
        while len(out) < limit:
            try:
                out.append(self._passes.get_nowait())
            except queue.Empty:
                break
        return out

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for p in self._procs:
            # a process exits only once its queued reports are read: keep draining while waiting
            while p.is_alive() and time.monotonic() < deadline:
                self.drain_passes()
                p.join(0.2)
            if p.is_alive():
                p.terminate()
                p.join(5)
