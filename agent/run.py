"""Run, Step and Phase: the agent's hot path on the training thread.

Timing is an exclusive state machine. Every transition (step start, phase enter/exit, blocking
collective enter/exit, automatic hooks) appends one ``(mark, state)`` pair to the step; a mark is
``perf_counter_ns`` on CPU or a recorded CUDA event on GPU (``clock.py``). At resolution each
interval between consecutive marks is charged to the state that was current, so

    step_s = data_s + compute_s + comm_exposed_s + other_s

holds by construction, and communication the training thread waited for inside a phase (a blocking
all-gather in FSDP's forward, a ``work.wait()`` in backward) is charged to ``comm_exposed_s``, not to
that phase. The only moved time is DDP's gradient all-reduce tail (measured off-thread, see
``collectives.py``); if moving it would drive a phase below zero, the residual goes negative, is
reported as ``other_s = 0`` with ``FLAG_NEGATIVE_RESIDUAL`` set, never clamped silently.

Hot-path rules (docs/benchmarks.md, "Design measurements"): context managers are prebuilt and reused (no ``@contextmanager``),
a transition is one clock read and one list append, a step's end builds one tuple and calls
``transport.submit``. Nothing here calls ``.item()``, synchronises a device or does I/O besides one
``pread`` of ``/proc/self/statm`` on CPU. Internal errors are caught at each entry point, counted and
logged once per place; they never reach the training loop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from .clock import CpuClock, make_clock
from .memory import NullSampler, make_sampler

__all__ = [
    "Run",
    "Step",
    "Phase",
    "NoopRun",
    "FLAG_NEGATIVE_RESIDUAL",
    "FLAG_FLOPS_MEASURED",
    "STATE_NAMES",
    "get_run",
]

log = logging.getLogger(__name__)

# states of the training thread
OTHER, DATA, FORWARD, BACKWARD, OPTIMIZER, COMM = range(6)
STATE_NAMES: tuple[str, ...] = ("other", "data", "forward", "backward", "optimizer", "comm")
_FIRST_CUSTOM = 6
_COMPUTE_BUILTIN = (FORWARD, BACKWARD, OPTIMIZER)

#: rank_step ``flags`` bits
FLAG_NEGATIVE_RESIDUAL = 1
"""bit 0: a measurement error: the measured components exceeded step_s (other_s reported as 0, and
the excess not charged), docs/metrics.md "never clamped silently"."""
FLAG_FLOPS_MEASURED = 2
"""bit 1: FLOPs were counted (FlopCounterMode) during this step, which slowed it."""

# collective call record: a list, mutated by completion callbacks on other threads
C_OP, C_N, C_BYTES, C_ISSUE, C_DONE, C_EXPOSED, C_KIND, C_STATE, C_TS = range(9)
K_TRAINING = 1  # issued by the training thread, which blocked on it (sync call)
K_DDP = 2  # a DDP gradient bucket (exposure = the backward tail, see _emit)
K_HOST = 4  # timed with the host clock (issued before the run's clock was chosen)
K_PUSHED = 8  # pushed the COMM state of the current step
K_FAST = 16  # a blocking call timed by the wrapper's fast path (collectives.py): its time is still
# charged to the state it was issued in (C_STATE) and moves to COMM when the step is resolved
_K_SYNC_FAST = K_TRAINING | K_FAST

_HOST = CpuClock()
_SEQ_EPOCH = 1_700_000_000
_active_run: Run | None = None


def get_run() -> Run | None:
    """The run ``init`` started in this process and not yet finished, if any."""
    return _active_run


def _set_active(run: Run | None) -> None:
    global _active_run
    _active_run = run


_NONE4 = (None, None, None, None)
_get_ident = threading.get_ident
_time = time.time

# Host clock (CPU) accounting is incremental: at each transition the interval since the previous one
# is added to the state that was current, plus _BIG. A state's accumulator is therefore 0 if the state
# never occurred in the step ("not measured", None on the wire) and k·_BIG + ns after k intervals, so
# one integer add per transition records both the time and the fact (``_MASK`` takes the ns back).
# The trick costs nothing on the hot path: ``_last`` holds the previous mark minus _BIG.
_BIG = 1 << 50  # 13 days of ns: more than any step
_MASK = _BIG - 1


class _StepData:
    """One step on one rank, from its first mark until it is resolved and submitted. On the host
    clock the per-state times live on the Run (``Run._durs``), on CUDA in ``marks``. Slots: every
    field is read at the step's end, and a slot read is the cheapest attribute read there is."""

    __slots__ = (
        "index", "ts", "auto", "calls", "pre_calls", "ddp", "tokens", "padded", "samples", "modality",
        "mem", "flags", "flops", "ready_upto", "check", "marks",
    )  # fmt: skip

    def __init__(self, index: int, auto: bool) -> None:
        self.index = index
        self.ts = _time()
        self.auto = auto
        self.calls: list[Any] = []
        self.pre_calls: Any = ()
        self.ddp = False  # DDP buckets among the calls (their exposure is the backward tail, see _emit)
        self.tokens: int | None = None
        self.padded: int | None = None
        self.samples: int | None = None
        self.modality: dict[str, int] | None = None
        self.mem: tuple[Any, Any, Any, Any] = _NONE4
        self.flags = 0
        self.flops: int | None = None
        self.ready_upto = 0
        self.check: list[Any] | None = None
        self.marks: Any = ()  # CUDA clock: [(event, state), ...]


class Phase:
    """A named phase of the current step; prebuilt per name by ``Run.phase`` and reused.

    Enter pushes the phase's state, exit pops back to the enclosing one. The host-clock case is
    inlined here (the hottest code of the agent: one clock read, one integer add, one push or pop);
    ``run._fast`` says it applies (a step is open, host clock, no FLOP counting in progress). Otherwise
    ``Run._push``/``Run._pop`` do it. Outside a step both are no-ops; an exit whose enter happened
    before the step began finds the stack empty."""

    __slots__ = ("_run", "_state", "name")

    def __init__(self, run: Run, name: str, state: int) -> None:
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
                run._last = t - _BIG
                run._stack.append(cur)
                run._cur = self._state
            elif run._step is not None:
                run._push(self._state)
        except Exception as e:  # noqa: BLE001 - never raise into the loop
            run._error("phase", e)
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        run = self._run
        try:
            if run._fast:
                stack = run._stack
                if stack:
                    mark = run._mark
                    t = mark()
                    run._durs[run._cur] += t - run._last
                    run._last = t - _BIG
                    run._cur = stack.pop()
            elif run._step is not None:
                run._pop()
        except Exception as e:  # noqa: BLE001
            run._error("phase", e)
        return None


class _PhaseTable(dict):  # type: ignore[type-arg]
    """name -> prebuilt Phase; its ``__getitem__`` (C) is ``Run.phase`` on each run instance."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run

    def __missing__(self, name: str) -> Phase:
        return self.run._new_phase(name)


class Step:
    """``with run.step(tokens=..) as s:`` — one training step (manual mode); prebuilt and reused."""

    __slots__ = ("_run", "_tokens", "_samples", "_padded", "_index")

    def __init__(self, run: Run) -> None:
        self._run = run
        self._tokens: Any = None
        self._samples: int | None = None
        self._padded: int | None = None
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
                    # Run._begin for the host clock, inlined: the common case of every step
                    index = self._index
                    st = _StepData(run._next_index if index is None else index, False)
                    run._tid = _get_ident()
                    run._cur = OTHER
                    run._durs[:] = run._zeros
                    mark = run._mark
                    t = mark()
                    run._t0 = t
                    run._last = t - _BIG
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

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        run = self._run
        st = run._step
        if st is None:
            return None
        try:
            if et is not None:
                run._abort()
            elif run._fast:
                run._end_fast(st)
            else:
                run._end()
        except Exception as e:  # noqa: BLE001
            run._error("step", e)
        return None

    def phase(self, name: str) -> Phase:
        """The prebuilt context manager of phase ``name`` (see ``Run.phase``)."""
        return self._run.phase(name)

    def count(self, tokens: Any = None, padded_tokens: int | None = None, samples: int | None = None) -> None:
        """Add tokens (an int, or a dict per modality), padded tokens and samples to this step."""
        self._run.count(tokens=tokens, padded_tokens=padded_tokens, samples=samples)

    @property
    def index(self) -> int | None:
        """Index of the step in progress (None outside one)."""
        st = self._run._step
        return st.index if st is not None else None


class Run:
    """One training run as seen from this rank. Built by ``fleetscope.agent.init``.

    ``run.phase(name)``: the context manager of phase ``name`` of the current step. "data",
    "forward", "backward", "optimizer" fill their columns; any other name is a custom compute phase
    (in compute_s). The same prebuilt object for a name every call. It is an attribute (the C
    ``__getitem__`` of the name -> Phase table, about 60 ns cheaper per call than a Python method);
    an unknown name reaches ``_new_phase``.

    Slots: the training thread reads and writes these attributes on every transition, and more
    than 30 instance attributes would leave CPython 3.11 without its fast attribute paths.
    """

    __slots__ = (
        "config", "info", "name", "rank", "world_size", "counters", "phase", "__weakref__", "_tracer",
        "_tx", "_submit", "_pid", "_finished", "_closed", "_lock", "_errors_logged", "_hooks",
        "_clock", "_mark", "_cpu", "_nsteps", "_next_index", "_event_seq",
        "_mem", "_mem_every", "_mem_interval", "_mem_next", "_mem_val",
        "_tid", "_step", "_stack", "_cur", "_fast", "_durs", "_zeros", "_t0", "_last", "_in_coll",
        "_pending", "_max_pending", "_gap", "_agg_threshold", "_phases", "_state_names", "_step_cm",
        "_flops_per_step", "_flops_per_token", "_flops_source", "_flops_given", "_flop_meter",
        "_flop_watch", "_collectives_installed", "_collectives_tried",
    )  # fmt: skip

    def __init__(
        self,
        *,
        config: Any,
        transport: Any,
        run_info: dict[str, Any],
        rank: int,
        world_size: int,
        start_step: int = 0,
        flops_per_step: float | None = None,
        flops_per_token: float | None = None,
        flops_source: str | None = None,
    ) -> None:
        self.config = config
        self.info = run_info
        self.name: str = run_info.get("name", "")
        self.rank = rank
        self.world_size = world_size
        self._tx = transport
        self._submit = transport.submit
        self._pid = os.getpid()
        self._finished = False
        self._closed = False
        # clock, chosen at the first step (CUDA only once the script initialised CUDA)
        self._clock: Any = None
        self._mark: Any = None
        self._cpu = False
        self._nsteps = 0
        self._mem: Any = NullSampler()
        self._mem_every = int(getattr(config, "memory_every_steps", 1))
        self._mem_interval = 0  # host clock: ns between two reads of the sampler (RSS: 100 ms)
        self._mem_next = -(1 << 62)
        self._mem_val: tuple[Any, Any, Any, Any] = _NONE4
        # state machine of the training thread
        self._tid = _get_ident()
        self._step: _StepData | None = None
        self._stack: list[int] = []
        self._cur = OTHER
        # host clock: per-state accumulators of the open step (see _BIG), its first and last marks
        self._fast = False  # a step is open on the host clock and no FLOP counting is in progress
        self._durs: list[int] = [0] * _FIRST_CUSTOM
        self._zeros: list[int] = [0] * _FIRST_CUSTOM  # what _durs is reset to at each step's start
        self._t0: Any = 0
        self._last: Any = 0
        self._in_coll = False  # the training thread is inside a wrapped collective (collectives.py)
        self._next_index = int(start_step)
        self._pending: deque[_StepData] = deque()
        self._max_pending = int(getattr(config, "max_pending_steps", 256))
        self._gap: list[list[Any]] = []
        self._agg_threshold = int(getattr(config, "collective_aggregate_threshold", 64))
        self._state_names: list[str] = list(STATE_NAMES)
        self._phases = _PhaseTable(self)
        self.phase: Callable[[str], Phase] = self._phases.__getitem__  # see the class docstring
        self._step_cm = Step(self)
        # FLOPs
        self._flops_per_step = flops_per_step
        self._flops_per_token = flops_per_token
        self._flops_source = flops_source
        self._flops_given = flops_source == "given" and flops_per_step is not None
        self._flop_meter: Any = None
        self._flop_watch = flops_source == "measured" and bool(getattr(config, "measure_flops", True))
        self._tracer: Any = None
        every = int(getattr(config, "trace_every_steps", 0) or 0)
        if every > 0:
            self._tracer = self._make_tracer(every, int(getattr(config, "trace_active_steps", 2) or 2))
        # bookkeeping. Events are keyed (run, rank, seq): a restarted process (same run name) must not
        # reuse the seq of its predecessor, so numbering starts at 4 × the seconds since 2023-11-14
        # (monotonic across restarts, below 2**30 until 2032; the transport's own events use 2**30+).
        self._event_seq = max(0, int(_time()) - _SEQ_EPOCH) * 4 % (1 << 30)
        self._hooks: list[Any] = []
        self._collectives_installed = False
        self._collectives_tried = not getattr(config, "collectives", True)
        self._lock = threading.Lock()  # finish() vs atexit, never taken on the hot path
        self.counters: dict[str, int] = {
            "steps": 0,
            "steps_aborted": 0,
            "steps_discarded": 0,
            "steps_dropped_unresolved": 0,
            "steps_in_graph_capture": 0,
            "collectives": 0,
            "collectives_incomplete": 0,
            "collectives_dropped": 0,
            "negative_residuals": 0,
            "internal_errors": 0,
        }
        self._errors_logged: set[str] = set()

    # ------------------------------------------------------------------ public API
    def step(
        self,
        tokens: Any = None,
        samples: int | None = None,
        padded_tokens: int | None = None,
        step: int | None = None,
    ) -> Step:
        """Context manager of one training step. ``tokens`` may be an int or a dict per modality;
        ``step`` overrides the index (resumed jobs). Returns the same prebuilt object every call."""
        cm = self._step_cm
        cm._tokens = tokens
        cm._samples = samples
        cm._padded = padded_tokens
        cm._index = step
        return cm

    def _new_phase(self, name: str) -> Phase:
        state = STATE_NAMES.index(name) if name in STATE_NAMES[: _FIRST_CUSTOM - 1] else None
        if state is None:
            state = len(self._state_names)
            self._state_names.append(name)
            self._zeros.append(0)
            if len(self._durs) <= state:  # a custom phase first seen inside an open step
                self._durs.append(0)
        p = self._phases[name] = Phase(self, name, state)
        return p

    def count(self, tokens: Any = None, padded_tokens: int | None = None, samples: int | None = None) -> None:
        """Add tokens (int or dict per modality), padded tokens and samples to the current step."""
        st = self._step
        if st is None:
            return
        try:
            self._add_counts(st, tokens, padded_tokens, samples)
        except Exception as e:  # noqa: BLE001
            self._error("count", e)

    def instrument(
        self, model: Any = None, optimizer: Any = None, dataloader: Any = None, *, counts: Any = None
    ) -> Any:
        """Automatic mode for PyTorch: hooks on the model (forward), the optimizer (step) and the data
        loader (``next``), plus DDP's gradient all-reduce. Returns the data loader to iterate (the same
        object when it could be instrumented in place). ``counts(batch)`` may return
        ``{"tokens": int | {modality: int}, "padded_tokens": int, "samples": int}``."""
        if self._finished:
            return dataloader
        try:
            from .torch_hooks import instrument

            return instrument(self, model=model, optimizer=optimizer, dataloader=dataloader, counts=counts)
        except Exception as e:  # noqa: BLE001
            self._error("instrument", e)
            return dataloader

    def event(self, kind: str, step: int | None = None, **data: Any) -> None:
        """Record a run event (checkpoint, eval, restart ...) with free-form ``data``."""
        if self._closed:
            return
        try:
            seq = self._event_seq
            self._event_seq += 1
            self._submit(
                "event",
                {
                    "rank": self.rank,
                    "seq": seq,
                    "kind": kind,
                    "ts": _time(),
                    "step": self._next_index if step is None else step,
                    "data": data,
                },
            )
        except Exception as e:  # noqa: BLE001
            self._error("event", e)

    def flush(self, timeout: float | None = None) -> bool:
        """Submit every resolvable step and ask the transport to send what it holds."""
        try:
            self._drain()
            return bool(self._tx.flush(timeout=timeout))
        except Exception as e:  # noqa: BLE001
            self._error("flush", e)
            return False

    def _make_tracer(self, every: int, active: int) -> Any:
        """The sampled profiler (agent/tracing.py): its summaries travel as ``trace_summary`` events."""
        try:
            from .tracing import SampledTracer, json_safe

            def submit(d: dict[str, Any]) -> None:
                data = {k: v for k, v in json_safe(d).items() if k not in ("kind", "step")}
                self.event("trace_summary", step=d.get("step"), **data)

            return SampledTracer(every, max(1, min(active, every)), submit, self.rank)
        except Exception as e:  # noqa: BLE001
            self._error("tracing", e)
            return None

    def finish(self, status: str = "finished", timeout: float | None = None) -> None:
        """End the run: resolve pending steps (bounded), submit, mark the run, flush within ``timeout``
        (default ``exit_timeout_s``), remove hooks and restore torch.distributed. Idempotent."""
        budget = float(getattr(self.config, "exit_timeout_s", 5.0) if timeout is None else timeout)
        deadline = time.monotonic() + budget
        tracer = self._tracer
        if tracer is not None and not self._finished and os.getpid() == self._pid:
            self._tracer = None
            try:  # before the run is marked finished: the last summary is still an event of the run
                tracer.close(timeout=min(3.0, budget / 2))  # a trace being reduced gets a bounded wait
            except Exception as e:  # noqa: BLE001
                self._error("finish", e)
        with self._lock:
            if self._finished or os.getpid() != self._pid:
                return
            self._finished = True
        try:
            if self._step is not None:
                self._discard()
            self._drain(deadline=time.monotonic() + min(1.0, budget / 2))
            for st in list(self._pending):  # never resolved: counted, not waited on
                self.counters["steps_dropped_unresolved"] += 1
                self._pending.remove(st)
            if self._gap:
                st = _StepData(self._next_index, False)
                st.pre_calls, self._gap = self._gap, []
                self._emit_collectives(st, None)
        except Exception as e:  # noqa: BLE001
            self._error("finish", e)
        self._unhook()
        try:
            self._tx.finish_run(status)
        except Exception as e:  # noqa: BLE001
            self._error("finish", e)
        self._closed = True
        try:
            self._tx.close(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001
            self._error("finish", e)
        try:
            self._mem.close()
        except Exception:  # noqa: BLE001
            pass
        global _active_run
        if _active_run is self:
            _active_run = None

    @property
    def finished(self) -> bool:
        return self._finished

    def _make_inert(self) -> None:
        """In a forked child (a DataLoader worker): every hook and context manager becomes a no-op;
        the parent's transport, spool and steps are left alone."""
        self._finished = True
        self._closed = True
        self._step = None
        self._fast = False
        self._pending = deque()
        self._gap = []
        self._flop_watch = False
        if self._collectives_installed:
            from . import collectives

            collectives._run = None  # the wrappers pass straight through in the child

    @property
    def step_index(self) -> int:
        """Index of the step in progress, or of the next one."""
        st = self._step
        return st.index if st is not None else self._next_index

    def stats(self) -> dict[str, Any]:
        """Agent counters (steps, drops, internal errors) and the transport's own."""
        out: dict[str, Any] = dict(self.counters)
        out["steps"] = self._nsteps
        out["clock"] = self._clock.kind if self._clock is not None else None
        out["pending_steps"] = len(self._pending)
        try:
            out["transport"] = self._tx.stats()
        except Exception:  # noqa: BLE001
            out["transport"] = None
        return out

    # ------------------------------------------------------------------ internal: errors
    def _error(self, where: str, exc: BaseException) -> None:
        self.counters["internal_errors"] += 1
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            log.warning("fleetscope agent: internal error in %s (counted, ignored): %r", where, exc)

    # ------------------------------------------------------------------ internal: clock
    def _use_clock(self, clock: Any) -> None:
        """Fix the clock (the first step does it otherwise; tests inject fakes)."""
        self._clock = clock
        self._mark = clock.mark
        self._cpu = clock.kind == "cpu"
        clock.set_main_stream()
        if self._mem_every > 0:
            try:
                self._mem = make_sampler("cuda" if clock.kind == "cuda" else "cpu")
            except Exception as e:  # noqa: BLE001
                self._error("memory", e)
                self._mem = NullSampler()
            self._mem_interval = int(getattr(self._mem, "min_interval_ns", 0))
            self._mem_next = -(1 << 62)
        self._ensure_collectives()

    def _setup_clock(self) -> None:
        kind = getattr(self.config, "clock", "auto")
        try:
            clock = make_clock(kind)
        except Exception as e:  # noqa: BLE001
            self._error("clock", e)
            clock = CpuClock()
        self._use_clock(clock)

    def _ensure_collectives(self) -> None:
        if self._collectives_tried or not getattr(self.config, "collectives", True):
            return

        if "torch.distributed" not in sys.modules:
            return  # torch not imported (yet): retried at the next step
        self._collectives_tried = True
        try:
            from . import collectives

            self._collectives_installed = collectives.install(self)
        except Exception as e:  # noqa: BLE001
            self._error("collectives", e)

    # ------------------------------------------------------------------ internal: state machine
    def _begin(self, auto: bool, state: int, index: int | None = None) -> _StepData:
        if self._clock is None:
            self._setup_clock()
        elif not self._collectives_tried and "torch.distributed" in sys.modules:
            self._ensure_collectives()
        st = _StepData(self._next_index if index is None else index, auto)
        self._tid = _get_ident()
        if self._stack:
            self._stack = []
        self._cur = state
        m = self._mark()
        if self._cpu:
            self._durs[:] = self._zeros
            self._t0 = m
            self._last = m - _BIG
        else:
            st.marks = [(m, state)]
        if self._gap:
            st.pre_calls, self._gap = self._gap, []
        self._step = st
        if self._flop_watch:
            self._fast = False
            if state == FORWARD:
                self._flops_start()
        else:
            self._fast = self._cpu
        if self._tracer is not None:  # sampled tracing (off by default): the slow path, like FLOP counting
            self._fast = False
            self._tracer.on_step_start(st.index)
        return st

    def _at(self, m: Any, state: int) -> None:
        """Transition of the open step to ``state`` at mark ``m`` (already taken)."""
        if self._cpu:
            self._durs[self._cur] += m - self._last
            self._last = m - _BIG
        else:
            self._step.marks.append((m, state))  # type: ignore[union-attr]
        self._cur = state

    def _to(self, state: int) -> None:
        if self._step is None:
            return
        self._at(self._mark(), state)
        if self._flop_watch:
            self._flops_transition(state)

    def _push(self, state: int) -> None:
        self._stack.append(self._cur)
        self._to(state)

    def _pop(self) -> None:
        if self._stack:
            self._to(self._stack.pop())

    def _end_fast(self, st: _StepData) -> None:
        """``_end`` and ``_submit_step`` on the host clock, inlined (``_fast``: no FLOP counting)."""
        mark = self._mark
        m = mark()
        durs = self._durs
        durs[self._cur] += m - self._last
        self._step = None
        self._fast = False
        if self._stack:
            self._stack = []
        self._cur = OTHER
        index = st.index
        self._next_index = index + 1
        self._nsteps += 1
        mem = _NONE4
        every = self._mem_every
        if every and (every == 1 or index % every == 0):
            # RSS moves slowly and a /proc read is a 2-4 µs syscall: read at most every
            # _mem_interval ns of the step clock, report the last reading in between
            if m >= self._mem_next:
                self._mem_next = m + self._mem_interval
                try:
                    self._mem_val = self._mem.sample()
                except Exception as e:  # noqa: BLE001
                    self._mem_val = _NONE4
                    self._error("memory", e)
            mem = self._mem_val
        t0 = self._t0
        if st.pre_calls or st.ddp or st.flops is not None:
            st.mem = mem
            self._submit_step(st, durs, m - t0, t0, m)
            return
        calls = st.calls
        comm_total_ns = self._emit_collectives_cpu(st, t0, m, durs) if calls else 0
        data = durs[DATA]
        fwd = durs[FORWARD]
        bwd = durs[BACKWARD]
        opt = durs[OPTIMIZER]
        comm = durs[COMM]
        step_ns = m - t0
        data_ns = data & _MASK
        fwd_ns = fwd & _MASK
        bwd_ns = bwd & _MASK
        opt_ns = opt & _MASK
        comm_ns = comm & _MASK
        compute_ns = fwd_ns + bwd_ns + opt_ns
        if len(durs) > _FIRST_CUSTOM:
            for d in durs[_FIRST_CUSTOM:]:
                compute_ns += d & _MASK
        other_ns = step_ns - data_ns - compute_ns - comm_ns
        flags = 0
        if other_ns < 0:  # cannot happen with one clock (integer ns); kept as the safety net
            flags = FLAG_NEGATIVE_RESIDUAL
            other_ns = 0
            self.counters["negative_residuals"] += 1
        if self._flops_given:
            flops = self._flops_per_step
        elif self._flops_per_token is not None and (st.padded or st.tokens):
            flops = self._flops_per_token * (st.padded or st.tokens)
        else:
            flops = self._flops_per_step
        has_comm = self._collectives_installed or bool(calls)
        submit = self._submit  # a slot holding a bound method: LOAD_ATTR, not an unspecialized LOAD_METHOD
        submit(
            "rank_step",
            (
                self.rank,
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
            ),
        )
        if st.modality:
            for name, v in st.modality.items():
                submit("modality_tokens", (self.rank, index, name, v))

    def _end(self) -> None:
        st = self._step
        if st is None:
            return
        if self._tracer is not None:
            self._tracer.on_step_end(st.index)
        if self._fast:
            self._end_fast(st)
            return
        if self._flop_meter is not None and self._flop_meter.active:
            self._flops_stop()  # before the end mark: its cost stays inside the flagged step
        m = self._mark()
        cpu = self._cpu
        if cpu:
            durs = self._durs
            durs[self._cur] += m - self._last
        else:
            st.marks.append((m, OTHER))
        self._step = None
        self._fast = False
        if self._stack:
            self._stack = []
        self._cur = OTHER
        index = st.index
        every = self._mem_every
        if every and (every == 1 or index % every == 0):
            try:
                if not cpu:
                    st.mem = self._mem.sample()
                else:
                    # RSS moves slowly and a /proc read is a 2-4 µs syscall: read it at most every
                    # _mem_interval ns of the step clock, report the last reading in between
                    if m >= self._mem_next:
                        self._mem_val = self._mem.sample()
                        self._mem_next = m + self._mem_interval
                    st.mem = self._mem_val
            except Exception as e:  # noqa: BLE001
                self._error("memory", e)
        self._next_index = index + 1
        self._nsteps += 1
        if cpu:
            try:
                t0 = self._t0
                self._submit_step(st, durs, m - t0, t0, m)
            except Exception as e:  # noqa: BLE001
                self._error("emit", e)
        else:
            self._pending.append(st)
            self._drain()

    def _abort(self) -> None:
        """The step's body raised: the step is not submitted (counted)."""
        if self._step is not None:
            self.counters["steps_aborted"] += 1
            self._drop_step()

    def _discard(self) -> None:
        """An automatically opened step that never ran (the loader was exhausted)."""
        if self._step is not None:
            self.counters["steps_discarded"] += 1
            self._drop_step()

    def _drop_step(self) -> None:
        st = self._step
        assert st is not None
        self._step = None
        self._fast = False
        self._stack = []
        self._cur = OTHER
        if self._flop_meter is not None and self._flop_meter.active:
            self._flop_meter.stop()
            self._flop_meter = None  # measure again on the next step
        # collectives issued in the dropped step stay visible, attributed to the next step
        self._gap = list(st.pre_calls) + st.calls + self._gap
        if self._clock is not None:
            self._clock.release([m for m, _ in st.marks])

    def _add_counts(self, st: _StepData, tokens: Any, padded: Any, samples: Any) -> None:
        if tokens is not None:
            if type(tokens) is int:
                st.tokens = tokens if st.tokens is None else st.tokens + tokens
            elif isinstance(tokens, Mapping):
                mod = st.modality
                if mod is None:
                    mod = st.modality = {}
                total = 0
                for k, v in tokens.items():
                    v = int(v)
                    mod[k] = mod.get(k, 0) + v
                    total += v
                st.tokens = (st.tokens or 0) + total
            else:
                st.tokens = (st.tokens or 0) + int(tokens)
        if padded is not None:
            st.padded = (st.padded or 0) + int(padded)
        if samples is not None:
            st.samples = (st.samples or 0) + int(samples)

    # ------------------------------------------------------------------ internal: automatic hooks
    def _auto_forward_pre(self, training: bool) -> None:
        if self._step is None:
            if training:  # an eval forward outside a step must not open one
                self._begin(True, FORWARD)
        elif not self._stack:
            self._to(FORWARD)

    def _auto_forward_post(self) -> None:
        # backward = from the end of forward to the optimizer step (includes the loss and clipping)
        if self._step is not None and not self._stack and self._cur == FORWARD:
            self._to(BACKWARD)

    def _auto_optimizer_pre(self) -> None:
        if self._step is not None and not self._stack:
            self._to(OPTIMIZER)

    def _auto_optimizer_post(self) -> None:
        st = self._step
        if st is None:
            return
        if st.auto:
            self._end()
        elif not self._stack:
            self._to(OTHER)

    def _auto_data_begin(self) -> int:
        if self._step is None:
            self._begin(True, DATA)
            return 1
        if not self._stack:
            self._to(DATA)
            return 2
        self._push(DATA)
        return 3

    def _auto_data_end(self, token: int) -> None:
        if token == 3:
            self._pop()
        else:
            self._to(OTHER)

    def _auto_data_stop(self, token: int) -> None:
        if token == 1:
            self._discard()
        else:
            self._auto_data_end(token)

    # ------------------------------------------------------------------ internal: FLOPs
    def _flops_transition(self, state: int) -> None:
        meter = self._flop_meter
        if meter is None:
            if state == FORWARD and self._step is not None:
                self._flops_start()
        elif meter.active and state == OPTIMIZER:
            self._flops_stop()

    def _flops_start(self) -> None:
        if "torch" not in sys.modules:  # nothing to count, and importing torch here would cost seconds
            self._flop_watch = False
            return
        from .mfu import FlopMeter

        meter = self._flop_meter = FlopMeter()
        try:
            meter.start()
        except Exception as e:  # noqa: BLE001 - no torch / no FlopCounterMode: no measurement
            self._error("flops", e)
            self._flop_watch = False

    def _flops_stop(self) -> None:
        meter = self._flop_meter
        self._flop_watch = False
        st = self._step
        try:
            flops = meter.stop()
        except Exception as e:  # noqa: BLE001
            self._error("flops", e)
            return
        if st is not None and flops:
            st.flops = flops
            st.flags |= FLAG_FLOPS_MEASURED

    # ------------------------------------------------------------------ internal: collectives
    def _coll_begin(self, op: str, n: int, nbytes: int, sync: bool) -> list[Any]:
        """A collective is being issued (any thread). A blocking one on the training thread (and, on
        GPU, on the loop's stream) pushes the exposed-comm state, sharing the issue mark."""
        clock = self._clock
        st = self._step
        if clock is None or st is None:
            return self._gap_call(
                op, n, nbytes, sync, K_TRAINING if sync and _get_ident() == self._tid else 0
            )
        m = self._mark()
        cur = self._cur
        call = [op, n, nbytes, m, None, None, 0, cur, None]
        st.calls.append(call)
        if sync and _get_ident() == self._tid and (self._cpu or clock.on_main_stream()):
            call[C_KIND] = K_TRAINING | K_PUSHED
            self._stack.append(cur)
            self._at(m, COMM)
        return call

    def _gap_call(self, op: str, n: int, nbytes: int, sync: bool, kind: int) -> list[Any]:
        """A collective outside any step: recorded with the next step, not counted in its time."""
        clock = self._clock
        if clock is None:
            clock = _HOST
            kind |= K_HOST
        call = [op, n, nbytes, clock.mark(), None, None, kind, self._cur, _time()]
        if len(self._gap) < 4096:
            self._gap.append(call)
        else:
            self.counters["collectives_dropped"] += 1
        return call

    def _coll_end(self, call: list[Any], sync: bool) -> None:
        """The collective call returned (for an async one: it was issued)."""
        kind = call[C_KIND]
        m = _HOST.mark() if kind & K_HOST else self._mark()
        if sync:
            call[C_DONE] = m
            if kind & K_PUSHED:
                if self._step is not None and self._stack and self._cur == COMM:
                    self._at(m, self._stack.pop())

    def _coll_done_async(self, call: list[Any]) -> None:
        """Completion callback of an async collective (any thread)."""
        if call[C_DONE] is None:
            call[C_DONE] = (_HOST if call[C_KIND] & K_HOST else self._clock).mark_async()

    def _wait_begin(self, call: list[Any]) -> tuple[Any, bool]:
        kind = call[C_KIND]
        clock = _HOST if kind & K_HOST else self._clock
        m = clock.mark()
        st = self._step
        pushed = False
        if st is not None and _get_ident() == self._tid and clock.on_main_stream():
            self._stack.append(self._cur)
            self._at(m, COMM)
            pushed = True
        return (m, pushed)

    def _wait_end(self, call: list[Any], token: tuple[Any, bool]) -> None:
        kind = call[C_KIND]
        m = (_HOST if kind & K_HOST else self._clock).mark()
        m0, pushed = token
        if pushed and self._step is not None and self._stack and self._cur == COMM:
            self._at(m, self._stack.pop())
        if pushed:
            ex = call[C_EXPOSED]
            if ex is None:
                call[C_EXPOSED] = [(m0, m)]
            else:
                ex.append((m0, m))
        if call[C_DONE] is None:
            call[C_DONE] = m

    def _ddp_issue(self, n: int, nbytes: int) -> list[Any]:
        """A DDP gradient bucket's all-reduce is being issued (from the autograd thread)."""
        st = self._step
        if self._clock is None or st is None:
            return self._gap_call("all_reduce", n, nbytes, False, K_DDP)
        call = ["all_reduce", n, nbytes, self._mark(), None, None, K_DDP, self._cur, None]
        st.ddp = True
        st.calls.append(call)
        return call

    # ------------------------------------------------------------------ internal: resolution
    def _ready(self, st: _StepData) -> bool:
        """Whether every event of the step has completed (``Event.query``, never a wait). The step's
        end event is asked first: while the device lags, that one query is all a step end costs."""
        clock = self._clock
        if clock is None or clock.kind == "cpu":
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

    def _drain(self, deadline: float | None = None) -> None:
        pend = self._pending
        while pend:
            st = pend[0]
            try:
                ready = self._ready(st)
            except Exception as e:  # noqa: BLE001
                self._error("resolve", e)
                ready = True
            if not ready:
                if deadline is not None and time.monotonic() < deadline:
                    time.sleep(0.002)  # polling Event.query(): no device synchronisation
                    continue
                while len(pend) > self._max_pending:
                    dropped = pend.popleft()
                    self.counters["steps_dropped_unresolved"] += 1
                    self._clock.release([m for m, _ in dropped.marks])
                return
            pend.popleft()
            try:
                self._emit(st)
            except Exception as e:  # noqa: BLE001
                self._error("emit", e)

    def _emit(self, st: _StepData) -> None:
        """Resolve and submit a step timed by CUDA events, all of them complete."""
        clock = self._clock
        # a mark skipped during a CUDA-graph capture: the step cannot be timed
        if st.check is not None and None in st.check:
            self.counters["steps_in_graph_capture"] += 1
            clock.release([m for m in st.check if m is not None])
            return
        el = clock.elapsed_ns
        marks = st.marks
        origin = marks[0][0]
        durs = [0] * len(self._state_names)
        prev_off = 0
        prev_state = marks[0][1]
        for i in range(1, len(marks)):
            m, s = marks[i]
            off = el(origin, m)
            durs[prev_state] += off - prev_off + _BIG  # see _BIG
            prev_off = off
            prev_state = s
        self._submit_step(st, durs, prev_off, origin, marks[-1][0])
        used = [m for m, _ in marks]
        for c in (*st.pre_calls, *st.calls):
            if not c[C_KIND] & K_HOST:
                used.append(c[C_ISSUE])
                used.append(c[C_DONE])
                for a, b in c[C_EXPOSED] or ():
                    used.append(a)
                    used.append(b)
        clock.release(used)

    def _submit_step(self, st: _StepData, durs: list[int], step_ns: int, origin: Any, end: Any) -> None:
        """Build the rank_step tuple from the per-state accumulators (k·_BIG + ns, 0 = the state never
        occurred) and submit it, after the step's collectives."""
        flags = st.flags
        comm_total_ns = 0
        if st.calls or st.pre_calls:
            comm_total_ns, ddp_tail_ns, tail_state = self._emit_collectives(st, origin, end, durs)
            if ddp_tail_ns > 0:
                # the training thread waited for DDP's last buckets inside backward: move that time
                # from the phase it was charged to into exposed comm. A tail longer than the phase is
                # a measurement error: only the phase's time moves (the server rejects components
                # that exceed step_s) and the step is flagged, not silently clamped.
                moved = min(ddp_tail_ns, durs[tail_state] & _MASK)
                if moved < ddp_tail_ns:
                    flags |= FLAG_NEGATIVE_RESIDUAL
                    self.counters["negative_residuals"] += 1
                durs[tail_state] -= moved
                durs[COMM] = (durs[COMM] or _BIG) + moved

        data = durs[DATA]
        fwd = durs[FORWARD]
        bwd = durs[BACKWARD]
        opt = durs[OPTIMIZER]
        comm = durs[COMM]
        data_ns = data & _MASK
        compute_ns = (fwd & _MASK) + (bwd & _MASK) + (opt & _MASK)
        if len(durs) > _FIRST_CUSTOM:
            for d in durs[_FIRST_CUSTOM:]:
                compute_ns += d & _MASK
        comm_ns = comm & _MASK
        other_ns = step_ns - data_ns - compute_ns - comm_ns
        if other_ns < 0:  # cannot happen with one clock (integer ns); kept as the safety net
            flags |= FLAG_NEGATIVE_RESIDUAL
            other_ns = 0
            self.counters["negative_residuals"] += 1

        if self._flops_given:
            flops = self._flops_per_step
        elif st.flops is not None:
            flops = float(st.flops)
            self._record_measured_flops(st)
        elif self._flops_per_token is not None and (st.padded or st.tokens):
            # the device computes every position of a padded batch: scale by padded tokens when known
            flops = self._flops_per_token * (st.padded or st.tokens)
        else:
            flops = self._flops_per_step

        has_comm = self._collectives_installed or bool(st.calls)
        mem = st.mem
        rank = self.rank
        self._submit(
            "rank_step",
            (
                rank,
                st.index,
                step_ns / 1e9,
                st.ts,
                data_ns / 1e9 if data else None,
                compute_ns / 1e9,
                (fwd & _MASK) / 1e9 if fwd else None,
                (bwd & _MASK) / 1e9 if bwd else None,
                (opt & _MASK) / 1e9 if opt else None,
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
            ),
        )
        if st.modality:
            for name, v in st.modality.items():
                self._submit("modality_tokens", (rank, st.index, name, v))

    def _record_measured_flops(self, st: _StepData) -> None:
        flops = st.flops
        if not flops:
            return
        self._flops_per_step = float(flops)
        if st.padded or st.tokens:
            self._flops_per_token = flops / (st.padded or st.tokens)
        self.event("flops", step=st.index, flops=float(flops), tokens=st.tokens, source="measured")

    def _emit_collectives_cpu(
        self, st: _StepData, origin: Any, end_mark: Any, durs: list[int] | None = None
    ) -> int:
        """The common case, inlined: host clock, no DDP buckets, one record per call; returns the
        summed duration of the step's own calls (not the leftovers before it). The time of the step's
        K_FAST calls moves from the state they were issued in to COMM in ``durs``."""
        pre = st.pre_calls
        n_pre = len(pre)
        rank = self.rank
        index = st.index
        submit = self._submit
        ts0 = st.ts
        comm_total = 0
        incomplete = 0
        seq = 0
        for op, n, nbytes, issue, done, pairs, kind, state, ts in (*pre, *st.calls) if n_pre else st.calls:
            if kind == _K_SYNC_FAST and seq >= n_pre:
                # the wrapper's fast path: a complete blocking call, exposed throughout
                total = done - issue
                comm_total += total
                if durs is not None:
                    durs[state] -= total
                    durs[COMM] += total
                t = total / 1e9
                submit("collective", (rank, index, seq, op, n, nbytes, 1, t, t, ts0 + (issue - origin) / 1e9))
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
                            total = b - issue  # see _emit_collectives
                    if exposed > total:
                        exposed = total
                elif kind & K_TRAINING:
                    exposed = total
            if ts is None:
                ts = ts0 + (issue - origin) / 1e9
            if seq >= n_pre:
                comm_total += total
                if kind & K_FAST and durs is not None:
                    durs[state] -= total
                    durs[COMM] += total
            submit("collective", (rank, index, seq, op, n, nbytes, 1, total / 1e9, exposed / 1e9, ts))
            seq += 1
        if incomplete:
            self.counters["collectives_incomplete"] += incomplete
        self.counters["collectives"] += seq
        return comm_total

    def _emit_collectives(
        self, st: _StepData, origin: Any, end_mark: Any = None, durs: list[int] | None = None
    ) -> tuple[int, int, int]:
        """Submit the step's collective records; return (comm_total_ns, ddp_tail_ns, tail_state).

        ``origin``/``end_mark``: the step's first and last marks (None for leftovers at finish);
        ``durs``: the step's per-state accumulators, where the time of K_FAST calls moves to COMM."""
        pre = st.pre_calls
        calls = st.calls
        n_pre = len(pre)
        clock = self._clock or _HOST
        cpu = clock.kind == "cpu"
        if cpu and not st.ddp and n_pre + len(calls) <= self._agg_threshold:
            return self._emit_collectives_cpu(st, origin, end_mark, durs), 0, BACKWARD
        el = clock.elapsed_ns
        host_el = _HOST.elapsed_ns
        ts0 = st.ts
        # rows: op, n, bytes, total_ns, exposed_ns, start_ts
        rows: list[list[Any]] = []
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
                ts = ts0 + (issue - origin if cpu else el(origin, issue)) / 1e9
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
            # DDP's reducer waits for every bucket at the end of backward, right after issuing the
            # last one (its gradients are the last computed). The wait = the part of the buckets'
            # completion that lies past the last issue, split over buckets as an interval union.
            last = max(ddp, key=lambda d: d[1])
            tail_state = calls[last[0] - n_pre][C_STATE]
            if tail_state == COMM:
                tail_state = BACKWARD
            covered = last[1]
            for idx, _issue_off, done_off in sorted(ddp, key=lambda d: d[2]):
                extra = done_off - covered
                if extra > 0:
                    row = rows[idx]
                    row[4] = min(row[3], extra)
                    ddp_tail += extra
                    covered = done_off

        rank = self.rank
        index = st.index
        submit = self._submit
        if len(rows) <= self._agg_threshold:
            for seq, (op, n, b, total, exposed, ts) in enumerate(rows):
                submit("collective", (rank, index, seq, op, n, b, 1, total / 1e9, exposed / 1e9, ts))
        else:
            agg: dict[tuple[str, int, int], list[Any]] = {}
            for op, n, b, total, exposed, ts in rows:
                key = (op, n, b.bit_length())  # size bucket: power of 2 of the message bytes
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
            for seq, ((op, n, _bucket), (b, calls_n, total, exposed, ts)) in enumerate(agg.items()):
                submit("collective", (rank, index, seq, op, n, b, calls_n, total / 1e9, exposed / 1e9, ts))
        return comm_total, ddp_tail, tail_state

    # ------------------------------------------------------------------ internal: teardown
    def _unhook(self) -> None:
        for h in self._hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooks = []
        if self._collectives_installed:
            try:
                from . import collectives

                collectives.uninstall(self)
            except Exception as e:  # noqa: BLE001
                self._error("collectives", e)


class _NoopCM:
    """Prebuilt do-nothing context manager (and step) of the disabled agent."""

    __slots__ = ()
    index = None

    def __enter__(self) -> _NoopCM:
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        return None

    def phase(self, name: str) -> _NoopCM:
        return self

    def count(self, tokens: Any = None, padded_tokens: Any = None, samples: Any = None) -> None:
        return None


_NOOP = _NoopCM()


class NoopRun:
    """What ``init`` returns when the agent is disabled: every method is a near-free no-op."""

    finished = False
    step_index = 0
    rank = 0
    world_size = 1
    name = ""
    info: dict[str, Any] = {}

    def step(
        self, tokens: Any = None, samples: Any = None, padded_tokens: Any = None, step: Any = None
    ) -> Any:
        return _NOOP

    def phase(self, name: str) -> Any:
        return _NOOP

    def count(self, tokens: Any = None, padded_tokens: Any = None, samples: Any = None) -> None:
        return None

    def instrument(
        self, model: Any = None, optimizer: Any = None, dataloader: Any = None, *, counts: Any = None
    ) -> Any:
        return dataloader

    def event(self, kind: str, step: Any = None, **data: Any) -> None:
        return None

    def flush(self, timeout: Any = None) -> bool:
        return True

    def finish(self, status: str = "finished", timeout: Any = None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"disabled": True}
