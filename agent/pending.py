"""CUDA steps waiting for their events: resolved lazily, never by a device synchronisation.

A step timed by CUDA events ends with ``(event, state)`` marks whose durations cannot be read yet.
It waits here until every one of its events (and of its collectives) reports ``query() == True``,
asked without blocking at later step ends and at flush; then each interval between consecutive marks
is charged to the state that was current (``step_state.BIG`` encoding) and the step goes to the
machine's ``_submit_step``. The step's end event is asked first: while the device lags, that one query
is all a step end costs. At most ``max_pending_steps`` wait; older ones are dropped and counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from .collective_stats import C_DONE, C_EXPOSED, C_ISSUE, C_KIND, K_HOST
from .protocols import Clock, Mark
from .step_state import BIG, StepData

__all__ = ["PendingSteps", "SubmitStep"]

SubmitStep = Callable[[StepData, list[int], int, Mark, Mark], None]
"""``StepMachine._submit_step(st, durs, step_ns, origin mark, end mark)``."""


class PendingSteps:
    """The CUDA steps of one run not yet resolved, oldest first."""

    __slots__ = ("_steps", "_max", "_counters")

    def __init__(self, max_pending: int, counters: dict[str, int]) -> None:
        self._steps: deque[StepData] = deque()
        self._max = max_pending
        self._counters = counters

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepData]:
        return iter(self._steps)

    def append(self, st: StepData) -> None:
        self._steps.append(st)

    def clear(self) -> int:
        """Forget every pending step (never resolved: counted by the caller); returns how many."""
        n = len(self._steps)
        self._steps = deque()
        return n

    def drain(
        self,
        clock: Clock,
        submit_step: SubmitStep,
        error: Callable[[str, BaseException], None],
        n_states: int,
        deadline: float | None = None,
    ) -> None:
        """Resolve and submit every leading step whose events completed. With ``deadline`` (finish),
        poll ``Event.query`` until then; without, return at the first incomplete step, after dropping
        the oldest steps beyond ``max_pending_steps``. ``n_states``: the run's states so far
        (built-in and custom phases)."""
        pend = self._steps
        while pend:
            st = pend[0]
            try:
                ready = _ready(clock, st)
            except Exception as e:  # noqa: BLE001
                error("resolve", e)
                ready = True
            if not ready:
                if deadline is not None and time.monotonic() < deadline:
                    time.sleep(0.002)  # polling Event.query(): no device synchronisation
                    continue
                while len(pend) > self._max:
                    dropped = pend.popleft()
                    self._counters["steps_dropped_unresolved"] += 1
                    clock.release([m for m, _ in dropped.marks])
                return
            pend.popleft()
            try:
                self._emit(clock, st, submit_step, n_states)
            except Exception as e:  # noqa: BLE001
                error("emit", e)

    def _emit(self, clock: Clock, st: StepData, submit_step: SubmitStep, n_states: int) -> None:
        """Resolve and submit a step timed by CUDA events, all of them complete."""
        # a mark skipped during a CUDA-graph capture: the step cannot be timed
        if st.check is not None and None in st.check:
            self._counters["steps_in_graph_capture"] += 1
            clock.release([m for m in st.check if m is not None])
            return
        el = clock.elapsed_ns
        marks = st.marks
        origin = marks[0][0]
        durs = [0] * n_states
        prev_off = 0
        prev_state = marks[0][1]
        for i in range(1, len(marks)):
            m, s = marks[i]
            off = el(origin, m)
            durs[prev_state] += off - prev_off + BIG  # see BIG
            prev_off = off
            prev_state = s
        submit_step(st, durs, prev_off, origin, marks[-1][0])
        used = [m for m, _ in marks]
        for c in (*st.pre_calls, *st.calls):
            if not c[C_KIND] & K_HOST:
                used.append(c[C_ISSUE])
                used.append(c[C_DONE])
                for a, b in c[C_EXPOSED] or ():
                    used.append(a)
                    used.append(b)
        clock.release(used)


def _ready(clock: Clock, st: StepData) -> bool:
    """Whether every event of the step has completed (``Event.query``, never a wait)."""
    if clock.kind == "cpu":
        return True
    check = st.check
    if check is None:
        if not clock.ready(st.marks[-1][0]):
            return False
        check = [m for m, _ in st.marks]
        for c in (*st.pre_calls, *st.calls):
            if c[C_KIND] & K_HOST:
                continue
            check.append(c[C_ISSUE])
            if c[C_DONE] is not None:
                check.append(c[C_DONE])
            for a, b in c[C_EXPOSED] or ():
                check.append(a)
                check.append(b)
        st.check = check
    ready = clock.ready
    i = st.ready_upto
    n = len(check)
    while i < n:
        if not ready(check[i]):
            st.ready_upto = i
            return False
        i += 1
    st.ready_upto = n
    return True

