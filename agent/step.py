"""``Step`` and ``Phase``: the prebuilt context managers of the training loop, the agent's hot path.

``run.step(...)`` returns the run's one ``Step``; ``run.phase(name)`` the one ``Phase`` of that name.
Their host-clock case is inlined here (one clock read, one integer add, one push or pop per
transition, see step_state.BIG); ``StepMachine._fast`` says it applies (a step is open, host clock,
no FLOP counting, no sampled tracing). Otherwise they call the machine's transitions (machine.py);
a step ends in step_end.py.
Every entry point catches what goes wrong and hands it to ``_error``: nothing raises into the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import step_state
from .machine import StepMachine
from .step_end import end, end_fast
from .step_state import BIG, NONE4, OTHER, Count, StepData, Tokens

__all__ = ["Step", "Phase", "PhaseTable"]

_get_ident = threading.get_ident


class Phase:
    """A named phase of the current step; prebuilt per name by ``Run.phase`` and reused.

    Enter pushes the phase's state, exit pops back to the enclosing one. Outside a step both are
    no-ops; an exit whose enter happened before the step began finds the stack empty."""

    __slots__ = ("_run", "_state", "name")

    def __init__(self, run: StepMachine, name: str, state: int) -> None:
        self._run = run
        self.name = name
        self._state = state

    def __enter__(self) -> Phase:
        run = self._run
        try:
            if run._fast:
                mark = run._mark  # two steps: run._mark() would be an unspecialized LOAD_METHOD
                t = mark()
                cur = run._cur
                run._durs[cur] += t - run._last
                run._last = t - BIG
                run._stack.append(cur)
                run._cur = self._state
            elif run._step is not None:
                run._push(self._state)
        except Exception as e:  # noqa: BLE001 - never raise into the loop
            run._error("phase", e)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        run = self._run
        try:
            if et is not None:
                self._raised(run)
            if run._fast:
                stack = run._stack
                if stack:
                    mark = run._mark
                    t = mark()
                    run._durs[run._cur] += t - run._last
                    run._last = t - BIG
                    run._cur = stack.pop()
            elif run._step is not None:
                run._pop()
        except Exception as e:  # noqa: BLE001
            run._error("phase", e)
        return None


    def _raised(self, run: StepMachine) -> None:
        """An exception leaves this phase: the innermost phase it left names the failure (Run._abort)."""
        st = run._step
        if st is not None:
            prev = getattr(run, "_raised_in", None)
            if prev is None or prev[0] != st.index:  # the first (innermost) phase of this step's exception
                run._raised_in = (st.index, self.name)  # type: ignore[attr-defined]


class PhaseTable(dict[str, Phase]):
    """name -> prebuilt Phase; its ``__getitem__`` (C) is ``Run.phase`` on each run instance, and an
    unknown name reaches ``new_phase``."""

    def __init__(self, new_phase: Callable[[str], Phase]) -> None:
        super().__init__()
        self.new_phase = new_phase

    def __missing__(self, name: str) -> Phase:
        return self.new_phase(name)


class Step:
    """``with run.step(tokens=..) as s:`` — one training step (manual mode); prebuilt and reused."""

    __slots__ = ("_run", "_phase", "_tokens", "_samples", "_padded", "_index")

    def __init__(self, run: StepMachine, phase: Callable[[str], Phase]) -> None:
        self._run = run
        self._phase = phase
        self._tokens: Tokens = None
        self._samples: Count = None
        self._padded: Count = None
        self._index: int | None = None

    def __enter__(self) -> Step:
        run = self._run
        try:
            st = run._step
            if st is None:
                if run._finished:
                    return self
                if (
                    run._cpu
                    and not run._flop_watch
                    and not run._gap
                    and run._collectives_tried
                    and run._tracer is None
                ):
                    # StepMachine._begin for the host clock, inlined: the common case of every step
                    index = self._index
                    st = run._spare
                    if st is None:
                        st = StepData(run._next_index if index is None else index, False)
                    else:
                        # the previous step's StepData, submitted by end_fast (its common case: no
                        # leftover calls, no DDP, no FLOPs): reset what a step may have set in it
                        run._spare = None
                        st.index = run._next_index if index is None else index
                        st.ts = step_state._time()  # StepData's clock (tests fix it there)
                        st.auto = False
                        if st.calls:
                            st.calls = []
                        st.modality = None
                        st.mem = NONE4
                        st.flags = 0
                    run._tid = _get_ident()
                    run._cur = OTHER
                    run._durs[:] = run._zeros
                    mark = run._mark
                    t = mark()
                    run._t0 = t
                    run._last = t - BIG
                    run._step = st
                    run._fast = True
                    tokens = self._tokens
                    samples = self._samples
                    padded = self._padded
                    if (
                        (tokens is None or type(tokens) is int)
                        and (samples is None or type(samples) is int)
                        and (padded is None or type(padded) is int)
                    ):
                        st.tokens = tokens  # a fresh step given ints or nothing: _add_counts, inlined
                        st.samples = samples
                        st.padded = padded
                    else:
                        st.tokens = st.samples = st.padded = None
                        run._add_counts(st, tokens, padded, samples)
                    return self
                st = run._begin(False, OTHER, self._index)
            else:
                st.auto = False  # adopt the step the instrumented loader opened (keeps its data time)
            tokens = self._tokens
            samples = self._samples
            padded = self._padded
            if tokens is not None or samples is not None or padded is not None:
                run._add_counts(st, tokens, padded, samples)
        except Exception as e:  # noqa: BLE001
            run._error("step", e)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        run = self._run
        st = run._step
        if st is None:
            return None
        try:
            if et is not None:
                run._abort()
            elif run._fast:
                end_fast(run, st)
            else:
                end(run)
        except Exception as e:  # noqa: BLE001
            run._error("step", e)
        return None

    def phase(self, name: str) -> Phase:
        """The prebuilt context manager of phase ``name`` (see ``Run.phase``)."""
        return self._phase(name)

    def count(self, tokens: Tokens = None, padded_tokens: Count = None, samples: Count = None,
              seq_lens: Any = None) -> None:
        """Add tokens (an int, or a dict per modality), padded tokens and samples to this step;
        ``seq_lens`` (the lengths of the step's sequences, a list or a CPU tensor) feeds the run's
        sequence-length histogram."""
        self._run.count(tokens=tokens, padded_tokens=padded_tokens, samples=samples, seq_lens=seq_lens)

    @property
    def index(self) -> int | None:
        """Index of the step in progress (None outside one)."""
        st = self._run._step
        return st.index if st is not None else None
