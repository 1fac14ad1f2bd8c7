"""The step machine: the training thread's timing state and its transitions.

Timing is an exclusive state machine. Every transition (step start, phase enter/exit, blocking
collective enter/exit, automatic hooks) takes one mark; a mark is ``perf_counter_ns`` on CPU or a
recorded CUDA event on GPU (``clock.py``). Each interval between consecutive marks is charged to the
state that was current — at once on the host clock (``step_state.BIG``), at resolution on CUDA
(``pending.py``) — so

    step_s = data_s + compute_s + comm_exposed_s + other_s

holds by construction, and communication the training thread waited for inside a phase (a blocking
all-gather in FSDP's forward, a ``work.wait()`` in backward) is charged to ``comm_exposed_s``, not to
that phase. The only moved time is DDP's gradient all-reduce tail (measured off-thread, see
``collective_stats.py``); if moving it would drive a phase below zero, the residual goes negative,
is reported as ``other_s = 0`` with ``FLAG_NEGATIVE_RESIDUAL`` set, never clamped silently.

``StepMachine`` holds the state and the core transitions (begin, to, push, pop, counts, abort, FLOP
counting). Who drives them: ``Step``/``Phase`` (step.py, the host-clock case inlined), the collective
wrappers (collective_marks.py), the automatic hooks (torch_hooks.py); a step ends in step_end.py, the
one place its ``rank_step`` record is built. ``Run`` (run.py) adds the public API and the run's
lifecycle. Hot-path rules: docs/agent.md, "Cost on the training thread". Internal errors are caught at each entry point
and end in ``_error``: counted, logged once per place, never raised into the training loop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .clock import CpuClock, make_clock
from .collective_stats import CollectiveStats
from .config import AgentConfig
from .memory import NullSampler, make_sampler
from .mfu import FlopMeter, FlopRates, compile_seen, flop_rates, is_compiled, model_parallel_degree
from .pending import PendingSteps
from .protocols import Clock, HookHandle, Mark, MemorySampler, MemSample, StepTracer, Transport
from .step_state import (
    BIG,
    FIRST_CUSTOM,
    FLAG_FLOPS_MEASURED,
    FORWARD,
    NONE4,
    OPTIMIZER,
    OTHER,
    STATE_NAMES,
    Count,
    StepData,
    Tokens,
)  # fmt: skip

__all__ = ["StepMachine"]

log = logging.getLogger("fleetscope.agent.run")

_get_ident = threading.get_ident
_time = time.time
_SEQ_EPOCH = 1_700_000_000


def _no_clock() -> Mark:
    raise RuntimeError("no clock chosen yet")  # never on the hot path: a step chooses one first


SEQ_BINS = 24
"""Log2 bins of the sequence-length histogram: bin k counts lengths in [2^k, 2^(k+1)); the last is open."""
SEQ_EVERY_STEPS = 200
"""Steps folded into one ``seq_lens`` event (also sent at finish)."""


class StepMachine:
    """The timing state of one rank's training thread (``Run`` is the public face of it).

    Slots: the training thread reads and writes these attributes on every transition; slot reads
    are the cheapest attribute reads CPython 3.11 has.
    """

    __slots__ = (
        "config", "rank", "counters", "_submit", "_colls", "_pending", "_finished", "_closed",
        "_errors_logged", "_hooks", "_tracer", "_event_seq",
        "_clock", "_mark", "_cpu", "_nsteps", "_next_index",
        "_mem", "_mem_every", "_mem_interval", "_mem_next", "_mem_val",
        "_tid", "_step", "_spare", "_stack", "_cur", "_fast", "_durs", "_zeros", "_t0", "_last", "_in_coll",
        "_gap", "_state_names", "_flops_per_step", "_flops_per_token", "_flops_given", "_flop_meter",
        "_flop_watch", "_collectives_installed", "_collectives_tried", "_flop_rates", "_flop_split",
        "_flop_source", "_flop_mp", "_flop_probe", "_flop_probe_tries", "_flop_info",
        "_seq_hist", "_seq_steps", "_defer", "_flop_plain",
    )  # fmt: skip

    def __init__(
        self,
        *,
        config: AgentConfig,
        transport: Transport,
        rank: int,
        start_step: int,
        flops_per_step: float | None,
        flops_per_token: float | None,
        flops_source: str | None,
    ) -> None:
        self.config = config
        self.rank = rank
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
            "phase_names_overflow": 0,
            "flops_not_measured_compiled": 0,
            "seq_lens_on_device": 0,
            "internal_errors": 0,
        }
        self._errors_logged: set[str] = set()
        self._submit = transport.submit
        self._colls = CollectiveStats(rank, transport.submit, self.counters, config.collective_aggregate_threshold)
        self._defer = False  # Run: whether end_fast hands the step's records to the sender thread (step_end)
        self._flop_plain = False  # FLOPs counted without module hooks (a pipeline stage: pipeline_watch.py)
        self._pending = PendingSteps(config.max_pending_steps, self.counters)
        self._finished = False
        self._closed = False
        self._hooks: list[HookHandle] = []  # torch hooks automatic mode registered, removed at finish
        self._tracer: StepTracer | None = None
        # Events are keyed (run, rank, seq): a restarted process (same run name) must not reuse the
        # seq of its predecessor, so numbering starts at 4 × the seconds since 2023-11-14 (monotonic
        # across restarts, below 2**30 until 2032; the transport's own events use 2**30+).
        self._event_seq = max(0, int(_time()) - _SEQ_EPOCH) * 4 % (1 << 30)
        # clock, chosen at the first step (CUDA only once the script initialised CUDA)
        self._clock: Clock | None = None
        self._mark: Callable[[], Mark] = _no_clock  # the clock's mark(), bound once: one call per transition
        self._cpu = False
        self._nsteps = 0
        self._next_index = int(start_step)
        self._mem: MemorySampler = NullSampler()
        self._mem_every = config.memory_every_steps
        self._mem_interval = 0  # host clock: ns between two reads of the sampler (RSS: 100 ms)
        self._mem_next = -(1 << 62)
        self._mem_val: MemSample = NONE4
        # state machine of the training thread
        self._tid = _get_ident()
        self._step: StepData | None = None
        # the last host-clock step's StepData once submitted (step_end.end_fast), which the next
        # Step.__enter__ reuses instead of allocating one per step
        self._spare: StepData | None = None
        self._stack: list[int] = []
        self._cur = OTHER
        # host clock: per-state accumulators of the open step (see BIG), its first and last marks
        self._fast = False  # a step is open on the host clock and no FLOP counting is in progress
        self._durs: list[int] = [0] * FIRST_CUSTOM
        self._zeros: list[int] = [0] * FIRST_CUSTOM  # what _durs is reset to at each step's start
        self._t0 = 0
        self._last = 0
        self._in_coll = False  # the training thread is inside a wrapped collective (collectives.py)
        self._gap: list[Sequence[Any]] = []  # collectives issued outside any step, for the next step
        self._state_names: list[str] = list(STATE_NAMES)
        self._seq_hist: list[int] | None = None  # sequence lengths, log2 bins (count(seq_lens=...))
        self._seq_steps = 0
        # FLOPs
        self._flops_per_step = flops_per_step
        self._flops_per_token = flops_per_token
        self._flops_given = flops_source == "given" and flops_per_step is not None
        self._flop_meter: FlopMeter | None = None
        self._flop_watch = flops_source == "measured" and config.measure_flops
        self._flop_rates: FlopRates | None = None  # model/hardware FLOPs per position, once measured
        self._flop_split: tuple[int | None, int | None] = (None, None)  # (forward, recompute) of the measured step
        self._flop_source = flops_source
        self._flop_mp: int | None = None  # model-parallel degree the formula was divided by (None: not yet)
        self._flop_probe: tuple[Any, Any, Any] | None = None  # a compiled model's first training inputs
        self._flop_probe_tries = 0  # forwards left to wait for them (_arm_flop_probe)
        self._flop_info: dict[str, Any] = {}  # what the "flops" event says about the measurement
        self._collectives_installed = False
        self._collectives_tried = not config.collectives

    # ------------------------------------------------------------------ errors, events
    def _error(self, where: str, exc: BaseException) -> None:
        self.counters["internal_errors"] += 1
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            log.warning("fleetscope agent: internal error in %s (counted, ignored): %r", where, exc)
            if os.environ.get("FLEETSCOPE_DEBUG"):
                log.warning("fleetscope agent: traceback", exc_info=exc)

    def _event(self, kind: str, step: int | None, data: dict[str, Any]) -> None:
        """Submit a run event (``Run.event``); ``seq`` counts up per rank. Nothing after finish."""
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

    def _ensure_collectives(self) -> None:
        """Start recording torch.distributed collectives, once it is imported (``Run`` installs the
        wrappers; the bare machine records only what it is handed)."""
        self._collectives_tried = True

    # ------------------------------------------------------------------ clock
    def _use_clock(self, clock: Clock) -> None:
        """Fix the clock (the first step does it otherwise; tests inject fakes)."""
        self._clock = clock
        self._mark = clock.mark
        self._cpu = clock.kind == "cpu"
        clock.set_main_stream()
        if self._mem_every > 0:
            try:
                self._mem = make_sampler("cuda" if clock.kind == "cuda" else "cpu", emit=self._memory_event)
            except Exception as e:  # noqa: BLE001
                self._error("memory", e)
                self._mem = NullSampler()
            self._mem_interval = int(self._mem.min_interval_ns)
            self._mem_next = -(1 << 62)
        self._ensure_collectives()
        if self._flop_source == "estimated" and self._flop_mp is None:
            self._scale_formula_flops()

    def _setup_clock(self) -> None:
        try:
            clock: Clock = make_clock(self.config.clock)
        except Exception as e:  # noqa: BLE001
            self._error("clock", e)
            clock = CpuClock()
        self._use_clock(clock)

    # ------------------------------------------------------------------ transitions
    def _begin(self, auto: bool, state: int, index: int | None = None) -> StepData:
        if self._clock is None:
            self._setup_clock()
        elif not self._collectives_tried and "torch.distributed" in sys.modules:
            self._ensure_collectives()
        st = StepData(self._next_index if index is None else index, auto)
        self._tid = _get_ident()
        if self._stack:
            self._stack = []
        self._cur = state
        m = self._mark()
        if self._cpu:
            self._durs[:] = self._zeros
            self._t0 = m
            self._last = m - BIG
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

    def _at(self, m: Mark, state: int) -> None:
        """Transition of the open step to ``state`` at mark ``m`` (already taken)."""
        if self._cpu:
            self._durs[self._cur] += m - self._last
            self._last = m - BIG
        else:
            self._step.marks.append((m, state))  # type: ignore[union-attr, attr-defined]  # CUDA: the list _begin made
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

    def count(self, tokens: Tokens = None, padded_tokens: Count = None, samples: Count = None,
              seq_lens: Any = None) -> None:
        """Add tokens (int or dict per modality), padded tokens and samples to the current step;
        ``seq_lens``: the lengths of the step's sequences (a list, or a CPU tensor), for the run's
        sequence-length histogram."""
        st = self._step
        if st is None:
            return
        try:
            self._add_counts(st, tokens, padded_tokens, samples)
            if seq_lens is not None:
                self._add_seq_lens(seq_lens)
        except Exception as e:  # noqa: BLE001
            self._error("count", e)

    def _add_seq_lens(self, seq_lens: Any) -> None:
        """Fold sequence lengths into the log2 histogram (bin k: lengths in [2^k, 2^(k+1)); bin 0 also
        holds 0). A tensor on an accelerator is refused: reading it would synchronise the device."""
        dev = getattr(seq_lens, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            self.counters["seq_lens_on_device"] += 1
            return
        vals = seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens
        hist = self._seq_hist
        if hist is None:
            hist = self._seq_hist = [0] * SEQ_BINS
        for v in vals:
            k = int(v).bit_length() - 1
            hist[0 if k < 0 else min(k, SEQ_BINS - 1)] += 1
        self._seq_steps += 1
        if self._seq_steps >= SEQ_EVERY_STEPS:
            self._flush_seq_hist()

    def _flush_seq_hist(self) -> None:
        """Send the histogram so far as a ``seq_lens`` event and start a new one."""
        hist = self._seq_hist
        if not hist:
            return
        self._seq_hist = None
        self._event("seq_lens", None, {"bins": {str(k): n for k, n in enumerate(hist) if n}, "steps": self._seq_steps})
        self._seq_steps = 0

    def _memory_event(self, data: dict[str, Any]) -> None:
        """The rank's memory figures for the run so far (memory.py decides when: rarely, and at finish)."""
        self._event("memory", None, data)

    def _flush_memory(self) -> None:
        """At finish: the memory sampler's last ``memory`` event (a final read on CUDA), never raising."""
        try:
            fin = getattr(self._mem, "finish", None)
            if fin is not None:
                fin()
        except Exception as e:  # noqa: BLE001
            self._error("memory", e)

    def _add_counts(self, st: StepData, tokens: Tokens, padded: Count, samples: Count) -> None:
        """Add tokens (an int, or a mapping per modality), padded tokens and samples to ``st``."""
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
            self._flop_meter.cancel()
            self._flop_meter = None  # measure again on the next step
        # collectives issued in the dropped step stay visible, attributed to the next step
        self._gap = [*st.pre_calls, *st.calls, *self._gap]
        if self._clock is not None:
            self._clock.release([m for m, _ in st.marks])

    # ------------------------------------------------------------------ FLOPs (measured once)
    def _flops_transition(self, state: int) -> None:
        meter = self._flop_meter
        if meter is None:
            if state == FORWARD and self._step is not None:
                self._flops_start()
        elif meter.active and state == OPTIMIZER:
            self._flops_stop()
        elif state == FORWARD and meter.deferred:
            meter.forwards += 1  # another micro-batch of the measured step

    def _flops_start(self) -> None:
        if "torch" not in sys.modules:  # nothing to count, and importing torch here would cost seconds
            self._flop_watch = False
            return
        if self._flop_plain and self._nsteps == 0:
            return  # a pipeline's first step also runs the stages' shape inference: measure the next one
        if compile_seen():  # FlopCounterMode would make Dynamo skip the compiled frames (mfu.py)
            probe = self._flop_probe
            if probe is None and self._flop_probe_tries > 0:
                self._flop_probe_tries -= 1  # the model's inputs are captured at its next forward
                return
            if probe is None:
                self._flop_watch = False
                self.counters["flops_not_measured_compiled"] += 1
                return
            # measured once, on the uncompiled module and fake tensors, when the step's forwards are done
            self._flop_probe = None
            self._flop_meter = FlopMeter()
            self._flop_meter.defer(probe)
            return
        meter = self._flop_meter = FlopMeter(memory_emit=self._memory_modules_event)
        try:
            meter.start(modules=not self._flop_plain)
        except Exception as e:  # noqa: BLE001 - no torch / no FlopCounterMode: no measurement
            self._error("flops", e)
            self._flop_watch = False

    def _memory_modules_event(self, data: dict[str, Any]) -> None:
        """The per-module memory measured with the FLOPs (memory_modules.py): one event per rank."""
        self._event("memory_modules", None, data)

    def _flops_stop(self) -> None:
        meter = self._flop_meter
        self._flop_watch = False
        st = self._step
        try:
            flops = meter.stop() if meter is not None else None
        except Exception as e:  # noqa: BLE001
            self._error("flops", e)
            return
        if meter is not None and meter.refused:
            self.counters["flops_not_measured_compiled"] += 1
            self._flop_info = {"not_measured": meter.refused}
        if st is not None and flops:
            st.flops = flops  # hardware: everything counted
            st.flags |= FLAG_FLOPS_MEASURED
            if meter is not None:
                self._flop_split = (meter.forward, meter.recompute)
                self._flop_info = meter.info()

    def _arm_flop_probe(self, model: Any) -> None:
        """A compiled model is not measured under FlopCounterMode (mfu.py): capture the inputs of its
        next training forward instead (a one-shot forward pre-hook, removed once it fired), which
        ``mfu.measure_uncompiled`` replays on the eager module and fake tensors."""
        try:
            if self._flop_watch and model is not None and (compile_seen() or is_compiled(model)):
                self._arm_probe_hook(model)
        except Exception as e:  # noqa: BLE001
            self._error("flops", e)

    def _arm_probe_hook(self, model: Any) -> None:
        import torch

        handles: list[Any] = []

        def grab(module: Any, args: Any, kwargs: Any = None) -> None:
            try:
                if module.training and torch.is_grad_enabled() and handles:
                    handles.pop().remove()
                    if self._flop_watch:
                        self._flop_probe = (module, args, kwargs or {})
            except Exception as e:  # noqa: BLE001
                self._error("flops", e)

        try:
            h = model.register_forward_pre_hook(grab, prepend=True, with_kwargs=True)
        except TypeError:  # torch without with_kwargs/prepend
            h = model.register_forward_pre_hook(grab)
        handles.append(h)
        self._hooks.append(h)
        self._flop_probe_tries = 16

    def _scale_formula_flops(self) -> None:
        """The formula's FLOPs are the whole model's: a rank of a tensor/pipeline/context-parallel
        group does 1/degree of them. The degree is ``mp_size`` when given (``_flop_mp``), else read
        from the DeviceMesh process groups once, at the first step."""
        try:
            mp = model_parallel_degree() or 1
        except Exception as e:  # noqa: BLE001
            self._error("flops", e)
            mp = 1
        self._flop_mp = mp
        if mp > 1 and self._flops_per_token is not None:
            self._flops_per_token /= mp
            self._event("flops", None, {"source": "formula", "mp_degree": mp, "flops_per_token": self._flops_per_token})

    def _record_measured_flops(self, st: StepData) -> tuple[float, float]:
        """(model, hardware) FLOPs of the measured step; the rates every later step is scaled by
        (mfu.flop_rates: model = counted − recomputed, per real token; hardware per padded token)."""
        total = float(st.flops or 0)
        fwd, rec = self._flop_split
        rates = self._flop_rates = flop_rates(total, rec, st.tokens, st.padded)
        model, hw = rates.step(st.tokens, st.padded)
        self._event("flops", st.index, {"flops": model, "hw_flops": hw, "forward_flops": fwd, "recompute_flops": rec,
                                        "tokens": st.tokens, "padded_tokens": st.padded, "source": "measured",
                                        **self._flop_info})
        return model, hw
