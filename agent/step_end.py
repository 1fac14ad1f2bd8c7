"""How a step ends: its last mark, memory sample, collectives and DDP tail, and ``record``, the one
place a ``rank_step`` record (and its ``modality_tokens``) is built.

``end_fast`` is the common end, inlined: host clock, no FLOP counting, no sampled tracing (the
state ``Step``/``Phase`` keep in ``run._fast``; its StepData is kept in ``run._spare`` for the next step);
``end`` is every other end (FLOP counting, tracing,
automatic mode, CUDA). A host-clock step is submitted at once (``submit_step``); a CUDA step waits in
``run._pending`` until its events completed (pending.py) and ``drain`` submits it. Both ends reach
``record``; tests/agent/test_step_record.py checks that they emit identical records.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from .machine import StepMachine
from .protocols import Mark
from .step_state import (
    BIG,
    COMM,
    FIRST_CUSTOM,
    FLAG_NEGATIVE_RESIDUAL,
    MASK,
    NONE4,
    OTHER,
    StepData,
)  # fmt: skip

__all__ = ["end_fast", "end", "submit_step", "record", "drain", "expand_step", "DEFERRED_STEP"]

DEFERRED_STEP = "_step"
"""Queue kind of a step whose records the sender thread builds (``expand_step``): ``end_fast``'s common
case when the run's transport takes it (``Run._defer``)."""


def end_fast(run: StepMachine, st: StepData) -> None:
    """``end`` on the host clock, inlined (``run._fast``: no FLOP counting, no tracer)."""
    mark = run._mark
    m = mark()
    durs = run._durs
    durs[run._cur] += m - run._last
    run._step = None
    run._fast = False
    if run._stack:
        run._stack = []
    run._cur = OTHER
    index = st.index
    run._next_index = index + 1
    run._nsteps += 1
    every = run._mem_every
    if every and (every == 1 or index % every == 0):
        # RSS moves slowly and a /proc read is a 2-4 µs syscall: read at most every
        # _mem_interval ns of the step clock, report the last reading in between
        if m >= run._mem_next:
            run._mem_next = m + run._mem_interval
            try:
                run._mem_val = run._mem.sample()
            except Exception as e:  # noqa: BLE001
                run._mem_val = NONE4
                run._error("memory", e)
        st.mem = run._mem_val
    t0 = run._t0
    if st.pre_calls or st.ddp or st.flops is not None:
        submit_step(run, st, durs, m - t0, t0, m)
        return
    # the common case of _submit_step: the step's own calls, host clock, no DDP tail
    if run._defer:
        # queue the raw marks; the sender thread builds the records (expand_step), off this thread
        run._submit(DEFERRED_STEP, (st, durs[:], m - t0, t0, m))
        return
    record(run, st, durs, m - t0, run._colls.emit_cpu(st, t0, m, durs) if st.calls else 0, 0)
    run._spare = st  # submitted, referenced nowhere else: the next Step.__enter__ reuses it


def expand_step(run: StepMachine, raw: tuple[StepData, list[int], int, Mark, Mark],
                submit: Callable[[str, Any], None]) -> None:
    """On the sender thread: the records of a step ``end_fast`` queued (``DEFERRED_STEP``), built by
    the same code as on the training thread and handed to ``submit``. The StepData is then offered
    back for reuse (the training thread takes ``run._spare`` and clears it; a step it did not take is
    garbage, never shared)."""
    st, durs, step_ns, t0, m = raw
    comm = run._colls.emit_cpu(st, t0, m, durs, submit) if st.calls else 0
    record(run, st, durs, step_ns, comm, 0, submit)
    if run._spare is None:
        run._spare = st


def end(run: StepMachine) -> None:
    st = run._step
    if st is None:
        return
    if run._tracer is not None:
        run._tracer.on_step_end(st.index)
    if run._fast:
        end_fast(run, st)
        return
    if run._flop_meter is not None and run._flop_meter.active:
        run._flops_stop()  # before the end mark: its cost stays inside the flagged step
    m = run._mark()
    cpu = run._cpu
    durs = run._durs
    if cpu:
        durs[run._cur] += m - run._last
    else:
        st.marks.append((m, OTHER))  # type: ignore[attr-defined]  # CUDA: the list _begin made
    run._step = None
    run._fast = False
    if run._stack:
        run._stack = []
    run._cur = OTHER
    index = st.index
    every = run._mem_every
    if every and (every == 1 or index % every == 0):
        try:
            if not cpu:
                st.mem = run._mem.sample()
            else:
                # RSS moves slowly and a /proc read is a 2-4 µs syscall: read it at most every
                # _mem_interval ns of the step clock, report the last reading in between
                if m >= run._mem_next:
                    run._mem_val = run._mem.sample()
                    run._mem_next = m + run._mem_interval
                st.mem = run._mem_val
        except Exception as e:  # noqa: BLE001
            run._error("memory", e)
    run._next_index = index + 1
    run._nsteps += 1
    if cpu:
        try:
            t0 = run._t0
            submit_step(run, st, durs, m - t0, t0, m)
        except Exception as e:  # noqa: BLE001
            run._error("emit", e)
    else:
        run._pending.append(st)
        drain(run)


def submit_step(run: StepMachine, st: StepData, durs: list[int], step_ns: int, origin: Mark, end_mark: Mark) -> None:
    """Submit the step's collectives, move DDP's tail into exposed comm, then the record.
    ``durs``: per-state accumulators (k·BIG + ns, 0 = the state never occurred)."""
    flags = st.flags
    comm_total_ns = 0
    if st.calls or st.pre_calls:
        comm_total_ns, ddp_tail_ns, tail_state = run._colls.emit(st, run._clock, origin, end_mark, durs)
        if ddp_tail_ns > 0:
            # the training thread waited for DDP's last buckets inside backward: move that time
            # from the phase it was charged to into exposed comm. A tail longer than the phase is
            # a measurement error: only the phase's time moves (the server rejects components
            # that exceed step_s) and the step is flagged, not silently clamped.
            moved = min(ddp_tail_ns, durs[tail_state] & MASK)
            if moved < ddp_tail_ns:
                flags |= FLAG_NEGATIVE_RESIDUAL
                run.counters["negative_residuals"] += 1
            durs[tail_state] -= moved
            durs[COMM] = (durs[COMM] or BIG) + moved
    record(run, st, durs, step_ns, comm_total_ns, flags)


def record(run: StepMachine, st: StepData, durs: list[int], step_ns: int, comm_total_ns: int, flags: int,
           submit: Callable[[str, Any], None] | None = None) -> None:
    """Build and submit the step's ``rank_step`` record (wire.RANK_STEP_FIELDS order) and its
    ``modality_tokens``: the only place either is built. ``submit``: where they go (default the
    run's transport; ``expand_step`` passes the sender thread's batch)."""
    custom = len(durs) > FIRST_CUSTOM
    if custom:
        _, data, fwd, bwd, opt, comm = durs[:FIRST_CUSTOM]
    else:  # one UNPACK_SEQUENCE instead of five subscripts (states 0..5: step_state)
        _, data, fwd, bwd, opt, comm = durs
    data_ns = data & MASK
    fwd_ns = fwd & MASK
    bwd_ns = bwd & MASK
    opt_ns = opt & MASK
    comm_ns = comm & MASK
    compute_ns = fwd_ns + bwd_ns + opt_ns
    if custom:
        for d in durs[FIRST_CUSTOM:]:
            compute_ns += d & MASK
    other_ns = step_ns - data_ns - compute_ns - comm_ns
    if other_ns < 0:  # cannot happen with one clock (integer ns); kept as the safety net
        flags |= FLAG_NEGATIVE_RESIDUAL
        other_ns = 0
        run.counters["negative_residuals"] += 1
    flops: float | None
    hw_flops: float | None = None  # hardware FLOPs: known once measured (recompute and padding included)
    if run._flops_given:
        flops = run._flops_per_step
    elif st.flops is not None:
        flops, hw_flops = run._record_measured_flops(st)
    elif run._flop_rates is not None:
        flops, hw_flops = run._flop_rates.step(st.tokens, st.padded)
    elif run._flops_per_token is not None and (st.tokens or st.padded):
        # model FLOPs (given or estimated per token) count the real tokens: padding is not model work
        flops = run._flops_per_token * (st.tokens or st.padded)  # type: ignore[operator]
    else:
        flops = run._flops_per_step
    has_comm = run._collectives_installed or bool(st.calls)
    mem = st.mem
    rank = run.rank
    index = st.index
    if submit is None:
        submit = run._submit  # a slot holding a bound method: LOAD_ATTR, not an unspecialized LOAD_METHOD
    submit(
        "rank_step",
        (
            rank,
            index,
            step_ns / 1e9,
            st.ts,
            data_ns / 1e9 if data else None,
            compute_ns / 1e9,
            fwd_ns / 1e9 if fwd else None,
            bwd_ns / 1e9 if bwd else None,
            opt_ns / 1e9 if opt else None,
            comm_ns / 1e9 if (has_comm or comm) else None,
            comm_total_ns / 1e9 if has_comm else None,
            other_ns / 1e9,
            st.tokens,
            st.padded,
            st.samples,
            flops,
            mem[0],
            mem[1],
            mem[2],
            mem[3],
            flags,
            hw_flops,
        ),
    )
    if st.modality:
        for name, v in st.modality.items():
            submit("modality_tokens", (rank, index, name, v))
    if custom:
        names = run._state_names
        for i in range(FIRST_CUSTOM, len(durs)):
            d = durs[i] & MASK
            if d and i < len(names):
                submit("phase", (rank, index, names[i][:64], d / 1e9))


def drain(run: StepMachine, deadline: float | None = None) -> None:
    """Resolve and submit the pending CUDA steps whose events completed (pending.py)."""
    clock = run._clock
    if clock is not None and run._pending:
        run._pending.drain(clock, partial(submit_step, run), run._error, len(run._state_names), deadline)
