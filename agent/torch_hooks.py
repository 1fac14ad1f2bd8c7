"""Automatic mode for PyTorch: ``run.instrument(model=..., optimizer=..., dataloader=...)``.

No change inside the training loop. What each hook marks (``run.py`` holds the state machine):

* data loader: its class is swapped, on this instance only, for a subclass whose ``__iter__`` returns
  a timed iterator; each ``next()`` is ``data``. A ``next()`` while no step is open starts a step (the
  step boundary); one while a step is open (gradient accumulation) adds to it. A ``next()`` that ends
  the epoch (``StopIteration``) leaves no step behind.
* model: a forward pre-hook (prepended, so it runs before FSDP's unshard) and a forward hook on the
  top-level module only (one hook pair costs ~2.5 µs, docs/benchmarks.md "Design measurements"). Without an instrumented loader
  the first training-mode forward of a step starts it; a forward in eval mode or under ``no_grad``
  never starts one.
* backward: from the end of forward to the start of ``optimizer.step()``. Chosen over autograd hooks
  because it needs no per-tensor hook (none on the loss, no ``register_full_backward_hook``, which
  breaks in-place ops on the module's outputs and adds autograd nodes), it works the same under DDP,
  FSDP2, activation checkpointing and gradient accumulation, and DDP's end-of-backward wait happens
  inside it. It therefore also holds the loss computation, ``zero_grad`` and gradient clipping.
* optimizer: ``register_step_pre_hook``/``register_step_post_hook``; the post hook ends the step. A
  closure passed to ``step(closure)`` (Lightning's automatic optimization) runs the step's forward and
  backward inside ``step()``: the pre-hook wraps it, and the optimizer phase (and the end of FLOP
  counting) begins when the closure returns, so it times the optimizer's own update only.
* DDP: the gradient all-reduce runs in the C++ reducer; a comm hook (``collectives.ddp_allreduce_hook``,
  the default all-reduce plus timing) makes the buckets visible. Skipped, with a log line, when the
  model already has a comm hook (the user's own, or DDP's mixed-precision hook). Its bucket settings and
  largest gradient tensor (FSDP2: its units' sizes) are sent once as a ``ddp`` / ``fsdp`` run event
  (``parallel_facts.py``): the server's bucket advice is checked against them.
* FLOPs: measured once by ``FlopCounterMode`` from the first step's forward to its optimizer update
  (every micro-batch of the step, a closure's included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from . import parallel_facts
from .machine import StepMachine
from .mfu import is_compiled, note_compile
from .step_end import end
from .step_state import BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER

__all__ = ["instrument", "default_counts"]

log = logging.getLogger(__name__)


def default_counts(batch: Any) -> dict[str, Any] | None:
    """Samples in a batch: the leading dimension of its first tensor (host metadata, no sync)."""
    x = batch
    for _ in range(3):
        if isinstance(x, Mapping):
            x = next(iter(x.values()), None)
        elif isinstance(x, (list, tuple)):
            x = x[0] if x else None
        else:
            break
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return {"samples": int(shape[0])}
    return None


# ---------------------------------------------------------------------- what each hook marks
# The transitions of the step machine (machine.py) that the automatic hooks drive.


def _forward_pre(run: StepMachine, training: bool) -> None:
    if run._step is None:
        if training:  # an eval forward outside a step must not open one
            run._begin(True, FORWARD)
    elif not run._stack:
        run._to(FORWARD)


def _forward_post(run: StepMachine) -> None:
    # backward = from the end of forward to the optimizer step (includes the loss and clipping)
    if run._step is not None and not run._stack and run._cur == FORWARD:
        run._to(BACKWARD)


def _optimizer_pre(run: StepMachine) -> None:
    if run._step is not None and not run._stack:
        run._to(OPTIMIZER)


class _NestedBackward:
    """``torch.autograd.backward`` (what ``Tensor.backward`` calls), wrapped for a training step that
    runs *inside* the top-level forward (Lightning's manual optimization: ``manual_backward`` and
    ``opt.step()`` in ``training_step``, within the DDP wrapper's forward). A backward entered while
    the step is in ``forward`` (and nothing nested) is pushed as ``backward`` and popped when it
    returns; every other backward (the usual one, after forward) passes straight through, unmarked.
    Installed by the zero-code launcher only (auto.py); ``remove`` puts the original back."""

    __slots__ = ("_orig", "_run_of", "_get_ident")

    def __init__(self, orig: Callable[..., Any], run_of: Callable[[], StepMachine | None]) -> None:
        import threading

        self._orig = orig
        self._run_of = run_of
        self._get_ident = threading.get_ident

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = None
        pushed = False
        try:
            run = self._run_of()
            if (run is not None and run._step is not None and run._cur == FORWARD and not run._stack
                    and self._get_ident() == run._tid):
                run._push(BACKWARD)
                pushed = True
        except Exception as e:  # noqa: BLE001
            if run is not None:
                run._error("backward", e)
        try:
            return self._orig(*args, **kwargs)
        finally:
            if pushed:
                try:
                    if run is not None and run._step is not None and run._cur == BACKWARD and run._stack:
                        run._pop()
                except Exception as e:  # noqa: BLE001
                    if run is not None:
                        run._error("backward", e)

    @staticmethod
    def install(run_of: Callable[[], StepMachine | None]) -> _NestedBackward | None:
        import torch.autograd

        cur = torch.autograd.backward
        if isinstance(cur, _NestedBackward):
            return None
        wrapper = _NestedBackward(cur, run_of)
        torch.autograd.backward = wrapper  # type: ignore[assignment]
        return wrapper

    def remove(self) -> None:
        import torch.autograd

        if torch.autograd.backward is self:
            torch.autograd.backward = self._orig  # type: ignore[assignment]


class _TimedClosure:
    """The closure handed to ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS):
    it runs the step's forward and backward, so the optimizer phase starts when it *returns*, not
    when ``step()`` is entered. ``run_of()`` is the run to mark (None: none, or not ours)."""

    __slots__ = ("_closure", "_run_of")

    def __init__(self, closure: Callable[[], Any], run_of: Callable[[], StepMachine | None]) -> None:
        self._closure = closure
        self._run_of = run_of

    def __call__(self) -> Any:
        out = self._closure()
        run = None
        try:
            run = self._run_of()
            if run is not None and not run._finished:
                _optimizer_pre(run)  # the optimizer's own update starts now
        except Exception as e:  # noqa: BLE001
            if run is not None:
                run._error("optimizer", e)
        return out


def _optimizer_step_pre(
    run: StepMachine | None, run_of: Callable[[], StepMachine | None], args: Any, kwargs: Any
) -> tuple[Any, Any] | None:
    """An optimizer pre-hook's transition (``args`` includes the optimizer itself, as torch passes
    them). Without a closure the optimizer phase begins here; with one, the closure is wrapped so
    that it begins when the closure returns (the closure's forward and backward are the step's own,
    and the FLOP meter keeps counting through them). Returns the new ``(args, kwargs)`` or None."""
    closure = kwargs.get("closure") if kwargs else None
    pos = closure is None and len(args) > 1
    if pos:
        closure = args[1]
    if isinstance(closure, _TimedClosure):
        return None  # another hook wrapped it already: the phase begins when it returns
    if closure is None or not callable(closure):
        if run is not None:
            _optimizer_pre(run)
        return None
    timed = _TimedClosure(closure, run_of)
    if pos:
        return (args[0], timed, *args[2:]), kwargs
    return args, {**kwargs, "closure": timed}


def _optimizer_post(run: StepMachine) -> None:
    st = run._step
    if st is None:
        return
    if st.auto:
        end(run)
    elif not run._stack:
        run._to(OTHER)


def _data_begin(run: StepMachine) -> int:
    """``next()`` on the loader begins; the token says what to undo: 1 = it opened the step, 2 = it
    switched the step to data, 3 = it pushed data (inside a phase)."""
    if run._step is None:
        run._begin(True, DATA)
        return 1
    if not run._stack:
        run._to(DATA)
        return 2
    run._push(DATA)
    return 3


def _data_end(run: StepMachine, token: int) -> None:
    if token == 3:
        run._pop()
    else:
        run._to(OTHER)


def _data_stop(run: StepMachine, token: int) -> None:
    if token == 1:
        run._discard()
    else:
        _data_end(run, token)


class _TimedIterator:
    """Wraps a loader's iterator; ``__next__`` is the data phase and the automatic step boundary."""

    __slots__ = ("_it", "_run", "_counts")

    def __init__(self, it: Any, run: StepMachine, counts: Callable[[Any], Any] | None) -> None:
        self._it = it
        self._run = run
        self._counts = counts

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        run = self._run
        token = 0
        try:
            if not run._finished:
                token = _data_begin(run)
        except Exception as e:  # noqa: BLE001
            run._error("data", e)
        try:
            batch = next(self._it)
        except StopIteration:
            if token:
                try:
                    _data_stop(run, token)
                except Exception as e:  # noqa: BLE001
                    run._error("data", e)
            raise
        except BaseException:
            if token:
                try:
                    _data_end(run, token)
                except Exception as e:  # noqa: BLE001
                    run._error("data", e)
            raise
        if token:
            try:
                _data_end(run, token)
                counts = self._counts
                if counts is not None:
                    c = counts(batch)
                    if c and run._step is not None:
                        run._add_counts(run._step, c.get("tokens"), c.get("padded_tokens"), c.get("samples"))
                        if c.get("seq_lens") is not None:
                            run._add_seq_lens(c["seq_lens"])
            except Exception as e:  # noqa: BLE001
                run._error("data", e)
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _TimedIterable:
    """For loaders whose class cannot be swapped (builtins such as lists): iterate this instead."""

    def __init__(self, loader: Any, run: StepMachine, counts: Callable[[Any], Any] | None) -> None:
        self._loader = loader
        self._run = run
        self._counts = counts

    def __iter__(self) -> _TimedIterator:
        return _TimedIterator(iter(self._loader), self._run, self._counts)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _instrument_loader(run: StepMachine, loader: Any, counts: Callable[[Any], Any] | None) -> Any:
    cls = type(loader)
    if getattr(cls, "_fleetscope_instrumented", False):
        loader._fleetscope_counts = counts  # re-instrumented: new run, new counts
        loader._fleetscope_run = run
        return loader
    orig_iter = cls.__iter__

    def __iter__(self: Any) -> Any:
        it = orig_iter(self)
        r = getattr(self, "_fleetscope_run", None)
        if r is None or r._finished:
            return it
        return _TimedIterator(it, r, getattr(self, "_fleetscope_counts", None))

    try:
        sub = type(
            cls.__name__,
            (cls,),
            {"__iter__": __iter__, "__module__": cls.__module__, "_fleetscope_instrumented": True},
        )
        loader.__class__ = sub
        loader._fleetscope_run = run
        loader._fleetscope_counts = counts
        return loader
    except (TypeError, AttributeError):
        log.info(
            "fleetscope: %s cannot be instrumented in place; iterate the object instrument() returned", cls
        )
        return _TimedIterable(loader, run, counts)


def _instrument_model(run: StepMachine, model: Any) -> list[Any]:
    import torch

    is_grad_enabled = torch.is_grad_enabled

    def pre(module: Any, args: Any) -> None:
        try:
            if not run._finished:
                _forward_pre(run, module.training and is_grad_enabled())
        except Exception as e:  # noqa: BLE001
            run._error("forward", e)

    def post(module: Any, args: Any, output: Any) -> None:
        try:
            if not run._finished:
                _forward_post(run)
        except Exception as e:  # noqa: BLE001
            run._error("forward", e)

    handles = [model.register_forward_pre_hook(pre, prepend=True), model.register_forward_hook(post)]
    _maybe_ddp_hook(model)
    parallel_facts.report(run, model)  # DDP's buckets / FSDP's units, once: what the advice checks against
    return handles


def _maybe_ddp_hook(model: Any) -> None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001 - torch without distributed
        return
    if not isinstance(model, DistributedDataParallel):
        return
    if getattr(model, "_comm_hooks", None) or getattr(model, "_fleetscope_comm_hook", False):
        if not getattr(model, "_fleetscope_comm_hook", False):
            log.info("fleetscope: DDP model already has a comm hook; gradient buckets are not timed")
        return
    from .collectives import ddp_allreduce_hook

    try:
        model.register_comm_hook(state=model.process_group, hook=ddp_allreduce_hook)
        setattr(model, "_fleetscope_comm_hook", True)  # noqa: B010 - nn.Module typing
    except Exception as e:  # noqa: BLE001 - e.g. after the first backward: leave DDP as it is
        log.info("fleetscope: could not register the DDP comm hook (%r); buckets are not timed", e)


def _instrument_optimizer(run: StepMachine, optimizer: Any) -> list[Any]:
    def run_of() -> StepMachine:
        return run

    def pre(opt: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        try:
            if not run._finished:
                return _optimizer_step_pre(run, run_of, args, kwargs)
        except Exception as e:  # noqa: BLE001
            run._error("optimizer", e)
        return None

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        try:
            if not run._finished:
                _optimizer_post(run)
        except Exception as e:  # noqa: BLE001
            run._error("optimizer", e)

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def _model_on_cuda(model: Any) -> bool:
    try:
        p = next(iter(model.parameters()), None)
    except Exception:  # noqa: BLE001
        return False
    return p is not None and getattr(p.device, "type", "") == "cuda"


def instrument(
    run: StepMachine,
    *,
    model: Any = None,
    optimizer: Any = None,
    dataloader: Any = None,
    counts: Callable[[Any], Any] | None = None,
) -> Any:
    """Install the hooks on ``run``; return the data loader to iterate."""
    if model is not None and is_compiled(model):
        note_compile()  # no FlopCounterMode over a compiled model (mfu.py)
    if model is not None:
        if run._clock is None and run.config.clock == "auto":
            from .clock import make_clock

            run._use_clock(make_clock("cuda" if _model_on_cuda(model) else "cpu"))
        run._hooks.extend(_instrument_model(run, model))
    if optimizer is not None:
        run._hooks.extend(_instrument_optimizer(run, optimizer))
    run._ensure_collectives()
    if dataloader is not None:
        dataloader = _instrument_loader(run, dataloader, counts if counts is not None else default_counts)
    return dataloader
