"""The step machine's collective transitions: what the collective wrappers (collectives.py) and
DDP's comm hook call around each call, and the call record each one appends to the step.

A blocking call on the training thread (on GPU: on the loop's stream) enters the exposed-comm state
at its issue mark and leaves it when the call returns; a ``work.wait()`` does the same around the
wait, and its interval is the call's exposed part. An async call is timed from its issue to its
completion callback. A call outside any step goes to ``run._gap`` and is recorded with the next step
(not counted in its time). The wrappers' fast path (a blocking call inside a host-clock step) does
not come here: it appends its record itself (collectives.py). Records: collective_stats.py.
"""

from __future__ import annotations

import threading
import time

from .collective_stats import C_DONE, C_EXPOSED, C_KIND, HOST_CLOCK, K_DDP, K_HOST, K_PUSHED, K_TRAINING, Call
from .machine import StepMachine
from .protocols import Clock, Mark
from .step_state import COMM

__all__ = ["coll_begin", "gap_call", "coll_end", "coll_done_async", "wait_begin", "wait_end", "ddp_issue"]

_get_ident = threading.get_ident
_time = time.time


def coll_begin(run: StepMachine, op: str, n: tuple[int, str], nbytes: int, sync: bool) -> Call:
    """A collective is being issued (any thread). A blocking one on the training thread (and, on
    GPU, on the loop's stream) pushes the exposed-comm state, sharing the issue mark."""
    clock = run._clock
    st = run._step
    if clock is None or st is None:
        return gap_call(run, op, n, nbytes, sync, K_TRAINING if sync and _get_ident() == run._tid else 0)
    m = run._mark()
    cur = run._cur
    call = [op, n, nbytes, m, None, None, 0, cur, None]
    st.calls.append(call)
    if sync and _get_ident() == run._tid and (run._cpu or clock.on_main_stream()):
        call[C_KIND] = K_TRAINING | K_PUSHED
        run._stack.append(cur)
        run._at(m, COMM)
    return call


def gap_call(run: StepMachine, op: str, n: tuple[int, str], nbytes: int, sync: bool, kind: int) -> Call:
    """A collective outside any step: recorded with the next step, not counted in its time."""
    clock = run._clock
    if clock is None:
        clock = HOST_CLOCK
        kind |= K_HOST
    call = [op, n, nbytes, clock.mark(), None, None, kind, run._cur, _time()]
    if len(run._gap) < 4096:
        run._gap.append(call)
    else:
        run.counters["collectives_dropped"] += 1
    return call


def _clock_of(run: StepMachine, call: Call) -> Clock:
    return HOST_CLOCK if call[C_KIND] & K_HOST or run._clock is None else run._clock


def coll_end(run: StepMachine, call: Call, sync: bool) -> None:
    """The collective call returned (for an async one: it was issued)."""
    m = _clock_of(run, call).mark()
    if sync:
        call[C_DONE] = m
        if call[C_KIND] & K_PUSHED:
            if run._step is not None and run._stack and run._cur == COMM:
                run._at(m, run._stack.pop())


def coll_done_async(run: StepMachine, call: Call) -> None:
    """Completion callback of an async collective (any thread)."""
    if call[C_DONE] is None:
        call[C_DONE] = _clock_of(run, call).mark_async()


def wait_begin(run: StepMachine, call: Call) -> tuple[Mark, bool]:
    clock = _clock_of(run, call)
    m = clock.mark()
    pushed = False
    if run._step is not None and _get_ident() == run._tid and clock.on_main_stream():
        run._stack.append(run._cur)
        run._at(m, COMM)
        pushed = True
    return (m, pushed)


def wait_end(run: StepMachine, call: Call, token: tuple[Mark, bool]) -> None:
    m = _clock_of(run, call).mark()
    m0, pushed = token
    if pushed and run._step is not None and run._stack and run._cur == COMM:
        run._at(m, run._stack.pop())
    if pushed:
        ex = call[C_EXPOSED]
        if ex is None:
            call[C_EXPOSED] = [(m0, m)]
        else:
            ex.append((m0, m))
    if call[C_DONE] is None:
        call[C_DONE] = m


def ddp_issue(run: StepMachine, n: tuple[int, str], nbytes: int) -> Call:
    """A DDP gradient bucket's all-reduce is being issued (from the autograd thread)."""
    st = run._step
    if run._clock is None or st is None:
        return gap_call(run, "all_reduce", n, nbytes, False, K_DDP)
    call = ["all_reduce", n, nbytes, run._mark(), None, None, K_DDP, run._cur, None]
    st.ddp = True
    st.calls.append(call)
    return call
