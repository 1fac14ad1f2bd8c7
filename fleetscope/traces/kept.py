"""Which events HTA keeps (TRACE_FORMULAS.md §2.1), as numpy columns: float-timestamp rounding, the
last-step filter with its correlation join, each GPU event's launching CPU event and iteration."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .classify import ITER_NAME_RE, kernel_type, kernel_type_corrected
from .parse import F_CPU_CLASS, F_CPU_OP, RankTrace

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Kept", "merge", "as_number"]


def as_number(x: float) -> float | int:
    """A figure for JSON: integral floats as int (µs figures are integral for rounded traces)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    return x


def merge(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HTA's ``merge_kernel_intervals``: sort by ts; a new group starts where ts > max(previous ends)."""
    import numpy as np

    if len(ts) == 0:
        return ts[:0], end[:0]
    o = np.argsort(ts, kind="stable")
    s = ts[o]
    e = end[o]
    cm = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    np.greater(s[1:], cm[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def _rounded(ts_raw: np.ndarray, dur_raw: np.ndarray, round_ts: bool) -> tuple[np.ndarray, np.ndarray]:
    """§2.1.2: float timestamps → ``ts = ceil(ts)``, ``end = floor(ts + dur)``."""
    import numpy as np

    if round_ts:
        return np.ceil(ts_raw), np.floor(ts_raw + dur_raw)
    return ts_raw.copy(), ts_raw + dur_raw


def _round1(t: float, d: float, round_ts: bool) -> tuple[float, float]:
    if round_ts:
        return float(math.ceil(t)), float(math.floor(t + d))
    return t, t + d


class Kept:
    """The kept rows of one rank (after §2.1 filtering) as numpy columns, relative to ``base``."""

    def __init__(
        self, rt: RankTrace, *, filter_on: bool, include_last_step: bool, with_iterations: bool
    ) -> None:
        import numpy as np

        self.rt = rt
        r = rt.round_ts
        ts_raw = np.frombuffer(rt.g_ts, dtype=np.float64)
        dur_raw = np.frombuffer(rt.g_dur, dtype=np.float64)
        ts, end = _rounded(ts_raw, dur_raw, r)
        stream = np.frombuffer(rt.g_stream, dtype=np.int64)
        corr = np.frombuffer(rt.g_corr, dtype=np.int64)
        name = np.frombuffer(rt.g_name, dtype=np.int32)
        flags = np.frombuffer(rt.g_flags, dtype=np.uint8)
        c_corr = np.frombuffer(rt.c_corr, dtype=np.int64)
        c_ts = np.frombuffer(rt.c_ts, dtype=np.float64)
        c_ts = np.ceil(c_ts) if r else c_ts
        cpu_class = (flags & F_CPU_CLASS) != 0

        # ProfilerStep events (name, ts, end) in file order, as HTA's add_iteration sees them
        self.steps = [(n, *_round1(t, d, r)) for n, t, d, cpu in rt.steps if cpu]
        self.filter_note = "skipped: fewer than 2 ProfilerStep names in the traces (HTA keeps every event)"
        self.filtered = filter_on and rt.cpu_count > 0
        if self.filtered:
            if self.steps:
                last_start = max(s[1] for s in self.steps)
                last_end = max(s[2] for s in self.steps)
            else:
                last_start, last_end = rt.cpu_min_ts, rt.cpu_max_end
            if include_last_step:
                self.filter_note = "applied: CPU events up to the end of the last ProfilerStep"

                def cpu_keep(t: Any) -> Any:
                    return t <= last_end
            else:
                self.filter_note = "applied: CPU events before the start of the last ProfilerStep"

                def cpu_keep(t: Any) -> Any:
                    return t < last_start

            c_kept = cpu_keep(c_ts)
            self.kept_steps = [s for s in self.steps if cpu_keep(s[1])]
        else:
            if filter_on:
                self.filter_note = "skipped: no CPU events in this trace"
            c_kept = np.ones(len(c_ts), dtype=bool)
            self.kept_steps = list(self.steps)

        # One stable sort of the CPU correlation ids answers both joins: how many kept CPU events share
        # a GPU event's id (HTA's inner merge, usually 0 or 1) and which CPU event launched it (HTA's
        # index_correlation: the last one in file order, kept or not).
        order = np.argsort(c_corr, kind="stable").astype(np.int32 if len(c_corr) < 2**31 else np.int64)
        sc = c_corr[order]
        kept_cum = np.zeros(len(sc) + 1, dtype=np.int32 if len(sc) < 2**31 else np.int64)
        np.cumsum(c_kept[order], out=kept_cum[1:])
        lo = np.searchsorted(sc, corr, side="left")
        hi = np.searchsorted(sc, corr, side="right")
        del sc
        matched_all = (hi > lo) & ~cpu_class
        launcher_all = order[np.maximum(hi - 1, 0)] if len(order) else np.zeros(len(corr), dtype=np.int32)
        del order
        if self.filtered:
            mult = np.subtract(kept_cum[hi], kept_cum[lo]).astype(np.int64)
            # sync events without a correlation match every kept CPU event without one (HTA's merge)
            mult[corr == -1] = 1 if bool(cpu_keep(rt.cpu_nocorr_min_ts)) else 0
            mult[cpu_class] = 0
            gi = np.flatnonzero(mult)
            ci = np.flatnonzero(cpu_class)
            ci = ci[cpu_keep(ts[ci])]
            rows = np.concatenate([np.repeat(gi, mult[gi]), ci])
            del mult, gi, ci
        else:
            rows = np.arange(len(ts))
        del kept_cum, lo, hi
        self.rows = rows
        # figures are sums of up to millions of timestamps: work relative to the rank's first event so
        # that every sum stays exact in float64 (HTA does the same by aligning all ranks to t = 0)
        base = rt.cpu_min_ts if math.isfinite(rt.cpu_min_ts) else 0.0
        if len(ts):
            base = min(base, float(ts.min())) if math.isfinite(rt.cpu_min_ts) else float(ts.min())
        self.base = base
        self.ts = ts[rows] - base
        self.end = end[rows] - base
        del ts, end
        self.stream = (
            stream[rows].astype(np.int32)
            if len(rows) and -(2**31) <= stream.min() and stream.max() < 2**31
            else stream[rows]
        )
        self.name = name[rows]
        self.flags = flags[rows]
        kept_cpu_class = cpu_class[rows]
        kept_corr = corr[rows]
        matched = matched_all[rows]
        launcher = launcher_all[rows]
        del matched_all, launcher_all

        ts_run = np.full(len(rows), np.nan)
        if len(c_corr):
            ok = matched & c_kept[launcher]
            ts_run[ok] = c_ts[launcher[ok]] - base
        if not self.filtered and rt.first_event_ts is not None:
            t0 = _round1(rt.first_event_ts, 0.0, r)[0] - base
            ts_run[~matched & ~kept_cpu_class & (kept_corr >= 0)] = t0
        del kept_cpu_class, kept_corr
        self.ts_runtime = ts_run

        # iteration of each kept row (HTA's add_iteration), used by the straggler analysis
        it = np.full(len(rows), -1, dtype=np.int64)
        by_ts = (self.stream < 0) | ((self.stream == 0) & ((self.flags & F_CPU_OP) != 0))
        self.steps = [(n, t0 - base, t1 - base) for n, t0, t1 in self.steps]
        self.kept_steps = [(n, t0 - base, t1 - base) for n, t0, t1 in self.kept_steps]
        if self.steps and with_iterations:
            c_it_ok = np.frombuffer(rt.c_iter_ok, dtype=np.uint8)
            via_cpu = (self.stream > 0) & matched
            if len(c_corr):
                via_cpu &= c_it_ok[launcher] == 1
            run_ts = c_ts[launcher] - base if len(c_corr) else np.zeros(len(rows))
            for sname, s0, s1 in self.steps:
                m = ITER_NAME_RE.match(sname)
                if not m:
                    continue
                k = int(m.group(1))
                d = s1 - s0
                it[by_ts & (self.ts >= s0) & (self.ts < s0 + d)] = k
                it[via_cpu & (run_ts >= s0) & (run_ts < s0 + d)] = k
        self.iteration = it

        names = rt.names
        self.types = (
            np.array([kernel_type(n) for n in names], dtype=np.int8)[self.name] if names else self.name
        )
        self._types_corr_of_name = np.array([kernel_type_corrected(n) for n in names], dtype=np.int8)
        self.gpu = self.stream != -1
        self.all_gpu = bool(self.gpu.all())

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.ts

    def types_corr(self) -> np.ndarray:
        return self._types_corr_of_name[self.name] if len(self._types_corr_of_name) else self.types

    def on_gpu(self, a: np.ndarray) -> np.ndarray:
        """The rows of ``a`` that carry a stream (no copy in the usual case where all do)."""
        return a if self.all_gpu else a[self.gpu]
