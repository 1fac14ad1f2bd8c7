"""Collective accounting: from a step's call records to its ``collective`` wire records and the
step's communication totals.

The collective wrappers (collectives.py) and the step machine's collective transitions
(``StepMachine._coll_begin`` ...) append one *call record* per call to the open step; this module
defines its layout (``C_*``, ``K_*``). When the step is resolved, ``CollectiveStats.emit`` turns the
step's calls into records — one per call, or aggregated per (op, group size, size bucket) above
``collective_aggregate_threshold`` calls — and returns the step's summed duration, its DDP tail
(the part of DDP's bucket completions the training thread waited for at the end of backward) and
the state that tail was charged to. A blocking call timed by the wrappers' fast path (``K_FAST``)
is still charged to the state it was issued in; its time moves to exposed comm here, in ``durs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .clock import CpuClock
from .protocols import Clock, Mark
from .step_state import BACKWARD, COMM, StepData

__all__ = [
    "C_OP", "C_N", "C_BYTES", "C_ISSUE", "C_DONE", "C_EXPOSED", "C_KIND", "C_STATE", "C_TS",
    "K_TRAINING", "K_DDP", "K_HOST", "K_PUSHED", "K_FAST", "K_SYNC_FAST", "HOST_CLOCK",
    "Call", "CollectiveStats",
]  # fmt: skip

# collective call record: a list, mutated by completion callbacks on other threads
C_OP, C_N, C_BYTES, C_ISSUE, C_DONE, C_EXPOSED, C_KIND, C_STATE, C_TS = range(9)
K_TRAINING = 1  # issued by the training thread, which blocked on it (sync call)
K_DDP = 2  # a DDP gradient bucket (exposure = the backward tail, see CollectiveStats.emit)
K_HOST = 4  # timed with the host clock (issued before the run's clock was chosen)
K_PUSHED = 8  # pushed the COMM state of the current step
K_FAST = 16  # a blocking call timed by the wrapper's fast path (collectives.py): its time is still
# charged to the state it was issued in (C_STATE) and moves to COMM when the step is resolved
K_SYNC_FAST = K_TRAINING | K_FAST

Call = list[Any]
"""A call record ``[op, (group size, dim), bytes, issue mark, done mark | None, [(wait start, wait end)] |
None, K_* bits, state at issue, start ts | None]``, indexed by ``C_*``. A list because completion
callbacks fill ``C_DONE`` and waits append to ``C_EXPOSED``; the wrappers' fast path appends a tuple
of the same layout instead (complete when appended)."""

HOST_CLOCK = CpuClock()
"""Times calls issued before the run chose its clock (``K_HOST``)."""

_Row = list[Any]  # op, n, bytes, total_ns, exposed_ns, start_ts


class CollectiveStats:
    """Emits the collective records of one rank's steps, counting them in the run's ``counters``."""

    __slots__ = ("rank", "counters", "agg_threshold", "_submit")

    def __init__(
        self, rank: int, submit: Callable[[str, Any], None], counters: dict[str, int], agg_threshold: int
    ) -> None:
        self.rank = rank
        self.counters = counters
        self.agg_threshold = agg_threshold
        self._submit = submit

    def emit_cpu(self, st: StepData, origin: int, end_mark: int | None, durs: list[int] | None = None,
                 submit: Callable[[str, Any], None] | None = None) -> int:
        """The common case, inlined: host clock, no DDP buckets, at most ``agg_threshold`` calls, one
        record per call; returns the summed duration of the step's own calls (not the leftovers
        before it). The time of the step's K_FAST calls moves from their state to COMM in ``durs``."""
        pre = st.pre_calls
        n_pre = len(pre)
        rank = self.rank
        index = st.index
        if submit is None:
            submit = self._submit
        ts0 = st.ts
        comm_total = 0
        incomplete = 0
        seq = 0
        for op, (n, dim), nbytes, issue, done, pairs, kind, state, ts in (*pre, *st.calls) if n_pre else st.calls:
            if kind == K_SYNC_FAST and seq >= n_pre:
                # the wrapper's fast path: a complete blocking call, exposed throughout
                total = done - issue
                comm_total += total
                if durs is not None:
                    durs[state] -= total
                    durs[COMM] += total
                t = total / 1e9
                submit("collective", (rank, index, seq, op, n, nbytes, 1, t, t, ts0 + (issue - origin) / 1e9, dim))
                seq += 1
                continue
            if pairs is None and done is not None:
                total = done - issue
                exposed = total if kind & K_TRAINING else 0
            else:
                if done is None:
                    incomplete += 1
                    total = 0 if (seq < n_pre or end_mark is None) else max(0, end_mark - issue)
                else:
                    total = done - issue
                exposed = 0
                if pairs is not None:
                    for a, b in pairs:
                        exposed += b - a
                        if a - issue <= total < b - issue:
                            total = b - issue  # see emit
                    if exposed > total:
                        exposed = total
                elif kind & K_TRAINING:
                    exposed = total
            if ts is None:
                ts = ts0 + (issue - origin) / 1e9 if origin is not None else ts0
            if seq >= n_pre:
                comm_total += total
                if kind & K_FAST and durs is not None:
                    durs[state] -= total
                    durs[COMM] += total
            submit("collective", (rank, index, seq, op, n, nbytes, 1, total / 1e9, exposed / 1e9, ts, dim))
            seq += 1
        if incomplete:
            self.counters["collectives_incomplete"] += incomplete
        self.counters["collectives"] += seq
        return comm_total

    def emit(
        self,
        st: StepData,
        clock: Clock | None,
        origin: Mark,
        end_mark: Mark = None,
        durs: list[int] | None = None,
    ) -> tuple[int, int, int]:
        """Submit the step's collective records; return (comm_total_ns, ddp_tail_ns, tail_state).

        ``clock``: the run's (None: not chosen yet, the host clock); ``origin``/``end_mark``: the
        step's first and last marks (None for leftovers at finish); ``durs``: the step's per-state
        accumulators, where the time of K_FAST calls moves to COMM."""
        pre = st.pre_calls
        calls = st.calls
        n_pre = len(pre)
        clock = clock or HOST_CLOCK
        cpu = clock.kind == "cpu"
        if cpu and not st.ddp and n_pre + len(calls) <= self.agg_threshold:
            return self.emit_cpu(st, origin, end_mark, durs), 0, BACKWARD
        el = clock.elapsed_ns
        host_el = HOST_CLOCK.elapsed_ns
        ts0 = st.ts
        rows: list[_Row] = []
        comm_total = 0
        ddp: list[tuple[int, int, int]] = []  # (row, issue offset, completion offset)
        tail_state = BACKWARD
        incomplete = 0
        for i, c in enumerate((*pre, *calls) if n_pre else calls):
            kind = c[C_KIND]
            issue, done = c[C_ISSUE], c[C_DONE]
            e = host_el if kind & K_HOST else el
            if done is None:
                incomplete += 1
                # truncated at the step's end (an async work nobody waited for in the step)
                total = 0 if (i < n_pre or end_mark is None or kind & K_HOST) else max(0, e(issue, end_mark))
            else:
                total = done - issue if cpu or kind & K_HOST else e(issue, done)
                if total < 0:
                    total = 0
            exposed = 0
            pairs = c[C_EXPOSED]
            if pairs is not None:
                for a, b in pairs:
                    exposed += e(a, b)
                    if e(issue, a) <= total < e(issue, b):
                        # the wait began before the work completed: for the waiting thread it ended
                        # when wait() returned (wake-up included), so exposed never exceeds total
                        total = e(issue, b)
            elif kind & K_TRAINING:
                exposed = total  # a blocking call: the thread waited throughout
            if exposed > total:
                exposed = total
            ts = c[C_TS]
            if ts is None:  # in-step call: the step's start time plus the issue's offset
                ts = ts0 + (issue - origin if cpu else el(origin, issue)) / 1e9 if origin is not None else ts0
            if i >= n_pre:
                comm_total += total
                if kind & K_DDP and done is not None:
                    ddp.append((len(rows), e(origin, issue), e(origin, done)))
                elif kind & K_FAST and durs is not None:
                    durs[c[C_STATE]] -= total
                    durs[COMM] += total
            rows.append([c[C_OP], c[C_N], c[C_BYTES], total, exposed, ts])
        if incomplete:
            self.counters["collectives_incomplete"] += incomplete
        self.counters["collectives"] += len(rows)
        ddp_tail = 0
        if ddp:
            ddp_tail, tail_state = _ddp_tail(ddp, rows, calls, n_pre)
        self._submit_rows(st.index, rows)
        return comm_total, ddp_tail, tail_state

    def _submit_rows(self, index: int, rows: list[_Row]) -> None:
        rank = self.rank
        submit = self._submit
        if len(rows) <= self.agg_threshold:
            for seq, (op, (n, dim), b, total, exposed, ts) in enumerate(rows):
                submit("collective", (rank, index, seq, op, n, b, 1, total / 1e9, exposed / 1e9, ts, dim))
            return
        agg: dict[tuple[str, tuple[int, str], int], list[Any]] = {}
        for op, g, b, total, exposed, ts in rows:
            key = (op, g, b.bit_length())  # size bucket: power of 2 of the message bytes
            a = agg.get(key)
            if a is None:
                agg[key] = [b, 1, total, exposed, ts]
            else:
                a[0] += b
                a[1] += 1
                a[2] += total
                a[3] += exposed
                if ts < a[4]:
                    a[4] = ts
        for seq, ((op, (n, dim), _bucket), (b, calls_n, total, exposed, ts)) in enumerate(agg.items()):
            submit("collective", (rank, index, seq, op, n, b, calls_n, total / 1e9, exposed / 1e9, ts, dim))


def _ddp_tail(
    ddp: list[tuple[int, int, int]], rows: list[_Row], calls: Sequence[Sequence[Any]], n_pre: int
) -> tuple[int, int]:
    """DDP's reducer waits for every bucket at the end of backward, right after issuing the last one
    (its gradients are the last computed). The wait = the part of the buckets' completion that lies
    past the last issue, split over buckets as an interval union (each bucket row's exposed part).
    Returns (tail ns, the state the last bucket was issued in)."""
    last = max(ddp, key=lambda d: d[1])
    tail_state: int = calls[last[0] - n_pre][C_STATE]
    if tail_state == COMM:
        tail_state = BACKWARD
    covered = last[1]
    tail = 0
    for idx, _issue_off, done_off in sorted(ddp, key=lambda d: d[2]):
        extra = done_off - covered
        if extra > 0:
            row = rows[idx]
            row[4] = min(row[3], extra)
            tail += extra
            covered = done_off
    return tail, tail_state
