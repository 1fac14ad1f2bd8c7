"""``Run``: one training run as one rank sees it — the public API and the run's lifecycle on top of
the step machine (machine.py), whose state it is.

The pieces: ``machine.StepMachine`` (timing state and transitions, the one ``rank_step`` builder),
``step.Step``/``step.Phase`` (the prebuilt context managers: the hot path), ``collective_stats``
(collective records), ``pending`` (CUDA steps awaiting their events), ``collectives``/``torch_hooks``
(the torch integration, imported only once torch is), and the transport behind
``protocols.Transport``. Nothing here calls ``.item()``, synchronises a device or does I/O besides
one ``pread`` of ``/proc/self/statm`` on CPU (memory.py). See docs/agent.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from functools import partial
from typing import Any

from .config import AgentConfig
from .machine import StepMachine
from .protocols import StepTracer, Transport
from .scalars import log_scalars
from .step import Phase, PhaseTable, Step
from .step_end import DEFERRED_STEP, drain, expand_step
from .step_state import (
    FIRST_CUSTOM,
    FLAG_FLOPS_MEASURED,
    FLAG_NEGATIVE_RESIDUAL,
    STATE_NAMES,
    Count,
    StepData,
    Tokens,
)  # fmt: skip

__all__ = ["Run", "Step", "Phase", "FLAG_NEGATIVE_RESIDUAL", "FLAG_FLOPS_MEASURED", "STATE_NAMES", "get_run", "MAX_CUSTOM_PHASES", "OVERFLOW_PHASE"]

_active_run: Run | None = None


MAX_CUSTOM_PHASES = 32
"""Distinct custom phase names a run keeps; the time of later names is kept under ``OVERFLOW_PHASE``."""
OVERFLOW_PHASE = "other_phases"


def get_run() -> Run | None:
    """The run ``init`` started in this process and not yet finished, if any."""
    return _active_run


def _set_active(run: Run | None) -> None:
    global _active_run
    _active_run = run


class Run(StepMachine):
    """One training run as seen from this rank. Built by ``fleetscope.agent.init``.

    ``run.phase(name)``: the context manager of phase ``name`` of the current step. "data",
    "forward", "backward", "optimizer" fill their columns; any other name is a custom compute phase
    (in compute_s). The same prebuilt object for a name every call. It is an attribute (the C
    ``__getitem__`` of the name -> Phase table, about 60 ns cheaper per call than a Python method);
    an unknown name reaches ``_new_phase``.
    """

    __slots__ = ("info", "name", "world_size", "phase", "__weakref__", "_tx", "_pid", "_lock", "_phases", "_step_cm",
                 "_scalar_names", "_aborted_at", "_raised_in")

    def __init__(
        self,
        *,
        config: AgentConfig,
        transport: Transport,
        run_info: dict[str, Any],
        rank: int,
        world_size: int,
        start_step: int,
        flops_per_step: float | None,
        flops_per_token: float | None,
        flops_source: str | None,
    ) -> None:
        super().__init__(
            config=config,
            transport=transport,
            rank=rank,
            start_step=start_step,
            flops_per_step=flops_per_step,
            flops_per_token=flops_per_token,
            flops_source=flops_source,
        )
        self.info = run_info
        self.name: str = run_info.get("name", "")
        self.world_size = world_size
        self._tx = transport
        self._pid = os.getpid()
        self._lock = threading.Lock()  # finish() vs atexit, never taken on the hot path
        self._phases = PhaseTable(self._new_phase)
        self.phase = self._phases.__getitem__  # see the class docstring
        self._step_cm = Step(self, self.phase)
        self._scalar_names: set[str] = set()  # run.log: the names seen (bounded, agent/scalars.py)
        self._aborted_at: tuple[int, str | None] | None = None  # (step, phase) the last exception aborted
        self._raised_in: tuple[int, str] | None = None  # (step, phase) an exception left first (step.Phase)
        # A transport with ``expanders`` (transport.Transport) resolves the common step end on its sender
        # thread: end_fast queues the step's raw marks, step_end.expand_step builds its records there
        expanders = getattr(transport, "expanders", None)
        if isinstance(expanders, dict):
            expanders[DEFERRED_STEP] = partial(expand_step, self)
            self._defer = True
        if config.trace_every_steps > 0:
            self._tracer = self._make_tracer(config.trace_every_steps, config.trace_active_steps)

    # ------------------------------------------------------------------ public API
    def step(
        self,
        tokens: Tokens = None,
        samples: Count = None,
        padded_tokens: Count = None,
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
        state = STATE_NAMES.index(name) if name in STATE_NAMES[: FIRST_CUSTOM - 1] else None
        if state is None and name != OVERFLOW_PHASE and len(self._state_names) - FIRST_CUSTOM >= MAX_CUSTOM_PHASES:
            # bounded cardinality: later names share one state (their time still counts as compute)
            self.counters["phase_names_overflow"] += 1
            p = self._phases[name] = self._phases[OVERFLOW_PHASE]
            return p
        if state is None:
            state = len(self._state_names)
            self._state_names.append(name)
            self._zeros.append(0)
            if len(self._durs) <= state:  # a custom phase first seen inside an open step
                self._durs.append(0)
        p = self._phases[name] = Phase(self, name, state)
        return p

    def instrument(self, model: Any = None, optimizer: Any = None, dataloader: Any = None, *, counts: Any = None) -> Any:
        """Automatic mode for PyTorch: hooks on the model (forward), the optimizer (step) and the data
        loader (``next``), plus DDP's gradient all-reduce. Returns the data loader to iterate (the same
        object when it could be instrumented in place). ``counts(batch)`` may return
        ``{"tokens": int | {modality: int}, "padded_tokens": int, "samples": int}``."""
        if self._finished:
            return dataloader
        try:
            from .torch_hooks import instrument

            loader = instrument(self, model=model, optimizer=optimizer, dataloader=dataloader, counts=counts)
            self._arm_flop_probe(model)  # a compiled model's FLOPs: from its inputs, once (machine.py)
            self._note_params(model)
            return loader
        except Exception as e:  # noqa: BLE001
            self._error("instrument", e)
            return dataloader

    def _note_params(self, model: Any) -> None:
        """The model's parameter count (``mfu.count_params``) into the run's meta, unless ``init`` was given
        one: ``params`` (and ``active_params`` = params: a dense model as far as the agent can see). Never raises."""
        try:
            meta = self.info.get("meta") or {}
            if model is None or meta.get("params"):
                return
            from .mfu import count_params

            n = count_params(model)
            if not n:
                return
            items = {"params": float(n), "active_params": float(meta.get("active_params") or n),
                     "params_source": "measured"}
            self.info["meta"] = {**meta, **items}
            update = getattr(self._tx, "update_run_meta", None)
            if update is not None:
                update(**items)
        except Exception:  # noqa: BLE001 - the job never fails for the agent
            pass

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record training scalars (loss, learning rate, grad norm, any metric) of ``step`` (None: the
        step in progress, else the last finished one): finite numbers only, at most 256 names per run
        (names ≤ 128 characters); anything else is dropped and counted, never raised. No device sync:
        pass Python floats (``loss.item()`` where you already call it) or CPU tensors."""
        log_scalars(self, metrics, step)

    def event(self, kind: str, step: int | None = None, **data: Any) -> None:
        """Record a run event (checkpoint, eval, restart ...) with free-form ``data``."""
        self._event(kind, step, data)

    def pause(self, reason: str, expected_s: float | None = None) -> Any:
        """``with run.pause("eval", expected_s=120):`` — a declared pause (evaluation, checkpoint, a
        planned wait): ``pause`` events (state "begin"/"end", the end with ``duration_s``) tell the
        server that the time without steps is expected, so it is no stall and no hang."""
        from .checkpoint_watch import Pause

        return Pause(self, reason, expected_s)

    def _abort(self) -> None:
        # the step's body raised: remember where (a failure record names the step and phase)
        st = self._step
        if st is not None:
            try:
                cur = self._stack[-1] if self._cur == 5 and self._stack else self._cur
                name = self._state_names[cur] if 0 <= cur < len(self._state_names) else None
                raised, self._raised_in = self._raised_in, None
                if raised is not None and raised[0] == st.index:
                    name = raised[1]  # a manual `with run.phase(...)` the exception left, closed by now
                self._aborted_at = (int(st.index), None if name in (None, "other", "comm") else name)
            except Exception:  # noqa: BLE001
                self._aborted_at = None
        super()._abort()

    def flush(self, timeout: float | None = None) -> bool:
        """Submit every resolvable step and ask the transport to send what it holds."""
        try:
            drain(self)
            return bool(self._tx.flush(timeout=timeout))
        except Exception as e:  # noqa: BLE001
            self._error("flush", e)
            return False

    def finish(self, status: str = "finished", timeout: float | None = None) -> None:
        """End the run: resolve pending steps (bounded), submit, mark the run, flush within ``timeout``
        (default ``exit_timeout_s``), remove hooks and restore torch.distributed. Idempotent."""
        budget = float(self.config.exit_timeout_s if timeout is None else timeout)
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
            drain(self, deadline=time.monotonic() + min(1.0, budget / 2))
            self.counters["steps_dropped_unresolved"] += self._pending.clear()  # never resolved: not waited on
            if self._gap and self._nsteps:
                # after the last step (HF Trainer's end-of-training gathers): not a step of their own
                gap, self._gap = self._gap, []
                ops: dict[str, int] = {}
                for c in gap:
                    ops[str(c[0])] = ops.get(str(c[0]), 0) + 1
                self.counters["collectives_after_last_step"] = self.counters.get("collectives_after_last_step", 0) + len(gap)
                self._event("collectives_after_last_step", self._next_index - 1, {"calls": len(gap), "ops": ops})
            elif self._gap:
                st = StepData(self._next_index, False)
                st.pre_calls, self._gap = self._gap, []
                self._colls.emit(st, self._clock, None)
            self._flush_seq_hist()
            self._flush_memory()
        except Exception as e:  # noqa: BLE001
            self._error("finish", e)
        self._unhook()
        try:
            from .device_telemetry import flush_window

            flush_window(self)  # the device window still open (device_telemetry.py)
        except Exception as e:  # noqa: BLE001
            self._error("finish", e)
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
        if _active_run is self:
            _set_active(None)

    @property
    def finished(self) -> bool:
        return self._finished

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

    # ------------------------------------------------------------------ internal
    def _make_tracer(self, every: int, active: int) -> StepTracer | None:
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

    def _ensure_collectives(self) -> None:
        """Wrap torch.distributed's collectives once it is imported (retried at each step until then)."""
        if self._collectives_tried or not self.config.collectives:
            return
        if "torch.distributed" not in sys.modules:
            return  # torch not imported (yet): retried at the next step
        self._collectives_tried = True
        try:
            from . import collectives, funcol

            self._collectives_installed = collectives.install(self)
            if self._collectives_installed:
                funcol.install()  # DTensor's collectives, when its module is imported
        except Exception as e:  # noqa: BLE001
            self._error("collectives", e)

    def _make_inert(self) -> None:
        """In a forked child (a DataLoader worker): every hook and context manager becomes a no-op;
        the parent's transport, spool and steps are left alone."""
        self._finished = True
        self._closed = True
        self._step = None
        self._fast = False
        self._pending.clear()
        self._gap = []
        self._flop_watch = False
        if self._collectives_installed:
            from . import collectives

            collectives._run = None  # the wrappers pass straight through in the child

    def _unhook(self) -> None:
        for h in self._hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooks = []
        if self._collectives_installed:
            try:
                from . import collectives, funcol

                if collectives._run is self:
                    funcol.uninstall()
                collectives.uninstall(self)
            except Exception as e:  # noqa: BLE001
                self._error("collectives", e)
