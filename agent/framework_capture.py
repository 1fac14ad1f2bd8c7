"""Zero-code capture of what training frameworks already log (``fleetscope run``): Hugging Face
``Trainer``'s logged metrics and tokens, Lightning's ``self.log`` metrics — through their own callback
APIs — and HF Accelerate's ``accelerator.log`` values, with no change to the script.

``arm()`` (called by ``auto.activate`` in every process ``fleetscope run`` starts; standard library
only) watches the imports of ``transformers.trainer``, ``lightning.pytorch.trainer.trainer`` /
``pytorch_lightning.trainer.trainer`` and ``accelerate.accelerator`` without importing them. Once such a
module has executed, its ``Trainer.__init__`` is wrapped: every Trainer built afterwards gets one
fleetscope callback (``Accelerator.log`` itself is wrapped).

* **HF Trainer** (``_HFCallback``): ``on_log`` → ``run.log`` of the numbers in the logs as
  ``hf/<name>`` (``hf/loss``, ``hf/learning_rate``, ``hf/grad_norm``, ``hf/epoch``,
  ``hf/num_input_tokens_seen`` when HF tracks it) at the step they describe (HF's ``global_step`` − 1),
  and ``hf/total_flos`` — HF's own FLOP estimate of the training (6 × parameters × tokens) — at its
  end (``on_train_end``). Tokens: each micro-batch's main input (``input_ids``) is counted on its rank after
  ``training_step`` (``Tensor.numel``: metadata, no device sync, no gather) and added to the open
  step (``run.count``), so ``tokens_per_s`` is measured for HF jobs; one ``framework_capture`` event
  says where the tokens come from (``{"framework": "hf_trainer", "tokens": "<input>.numel per
  micro-batch"}``).
* **Lightning** (``_LightningCallback``): ``on_train_batch_end`` reads ``trainer.callback_metrics``
  once per optimizer step (``global_step`` changed) and logs them as ``lightning/<name>`` at step
  ``global_step`` − 1. A metric on an accelerator is copied to the host without blocking and read at
  a later batch once its copy is done (never a device sync).
* **Accelerate** (``_patch_accelerate``): ``Accelerator.log(values, step=...)`` itself is wrapped — it
  is what the script calls whether or not a tracker is configured, on every rank (accelerate then runs
  the trackers on the main process only). The numbers in ``values`` go to ``run.log`` as
  ``accelerate/<name>`` (a nested mapping, as TensorBoard's ``add_scalars`` takes, as
  ``accelerate/<name>/<key>``) at ``step`` — the script's own step — or, without one, the step in
  progress. Python and numpy numbers and one-element CPU tensors are read at once; a one-element tensor
  on an accelerator is copied to the host without blocking and logged at a later ``log`` call once the
  copy is done (at ``end_training``, or the run's end, the rest is read). Then accelerate's own ``log``
  runs, unchanged.

The ``hf/``, ``lightning/`` and ``accelerate/`` prefixes say where a figure comes from. Every callback body is guarded:
a failure is reported once through the run and the job goes on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from .import_hook import AfterImport

__all__ = ["arm", "HF_PREFIX", "LIGHTNING_PREFIX", "ACCELERATE_PREFIX"]

log = logging.getLogger(__name__)

HF_PREFIX = "hf/"
LIGHTNING_PREFIX = "lightning/"
ACCELERATE_PREFIX = "accelerate/"
_MAX_PENDING = 64  # device metrics awaiting their host copy (Lightning on an accelerator)
_armed = False


def arm() -> None:
    """Watch the frameworks' trainer modules (idempotent; never raises)."""
    global _armed
    if _armed:
        return
    _armed = True
    try:
        targets: dict[str, Callable[[Any], None]] = {
            "transformers.trainer": _patch_hf,
            "lightning.pytorch.trainer.trainer": _patch_lightning,
            "pytorch_lightning.trainer.trainer": _patch_lightning,
            "accelerate.accelerator": _patch_accelerate,
        }
        for name, patch in list(targets.items()):
            mod = sys.modules.get(name)
            if mod is not None and (hasattr(mod, "Trainer") or hasattr(mod, "Accelerator")):
                patch(mod)
                del targets[name]
        if targets:
            sys.meta_path.insert(0, AfterImport({name: partial(_after, name, patch) for name, patch in targets.items()}))
    except Exception as e:  # noqa: BLE001
        log.warning("fleetscope: framework capture not armed: %r", e)


def _after(fullname: str, patch: Callable[[Any], None]) -> None:
    try:
        patch(sys.modules[fullname])
    except Exception as e:  # noqa: BLE001
        log.warning("fleetscope: framework capture of %s failed: %r", fullname, e)


def _wrap_init(cls: Any, attach: Callable[[Any], None]) -> None:
    init = cls.__init__
    if getattr(init, "_fleetscope_wrapped", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            attach(self)
        except Exception as e:  # noqa: BLE001
            log.warning("fleetscope: could not attach to %s: %r", type(self).__name__, e)

    __init__._fleetscope_wrapped = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__


def _run() -> Any:
    """The process's recording run, or None."""
    from .run import get_run

    run = get_run()
    return run if run is not None and not run._finished else None


def _numbers(logs: Any, prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if not isinstance(logs, dict):
        return out
    for k, v in logs.items():
        if type(v) in (int, float) and isinstance(k, str):
            out[prefix + k] = float(v)
    return out


# ------------------------------------------------------------------ Hugging Face Trainer


def _patch_hf(mod: Any) -> None:
    trainer_cls = getattr(mod, "Trainer", None)
    callback_cls = getattr(mod, "TrainerCallback", None)
    if trainer_cls is None or callback_cls is None:
        return
    hf_callback = _hf_callback_class(callback_cls)

    def attach(trainer: Any) -> None:
        trainer.add_callback(hf_callback())
        _count_tokens(trainer)

    _wrap_init(trainer_cls, attach)


def _hf_callback_class(base: Any) -> Any:
    class FleetscopeHFCallback(base):  # type: ignore[misc, valid-type]
        """fleetscope: HF's logged metrics → run.log as hf/<name> (agent/framework_capture.py)."""

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            try:
                run = _run()
                if run is None:
                    return
                data = _numbers(logs, HF_PREFIX)
                if data:
                    run.log(data, step=max(int(state.global_step) - 1, 0))
            except Exception as e:  # noqa: BLE001
                _report("hf_trainer", e)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            try:  # HF's own FLOP estimate of the whole training (6 × parameters × tokens, all processes)
                run = _run()
                flos: Any = getattr(state, "total_flos", None)
                if run is not None and type(flos) in (int, float) and flos > 0:
                    run.log({HF_PREFIX + "total_flos": float(flos)}, step=max(int(state.global_step) - 1, 0))
            except Exception as e:  # noqa: BLE001
                _report("hf_trainer", e)

    return FleetscopeHFCallback


def _count_tokens(trainer: Any) -> None:
    """Wrap this trainer's ``training_step``: each micro-batch's main-input tokens go to the open step."""
    step_fn = trainer.training_step
    if getattr(step_fn, "_fleetscope_wrapped", False):
        return
    name = getattr(getattr(trainer, "model", None), "main_input_name", "input_ids")
    said: list[bool] = []

    def training_step(*args: Any, **kwargs: Any) -> Any:
        out = step_fn(*args, **kwargs)
        try:
            inputs: Any = args[1] if len(args) > 1 else kwargs.get("inputs")
            x: Any = inputs.get(name) if hasattr(inputs, "get") else None
            run = _run() if x is not None and hasattr(x, "numel") else None
            if run is not None:
                run.count(tokens=int(x.numel()))
                if not said:
                    said.append(True)
                    run.event("framework_capture", framework="hf_trainer", tokens=f"{name}.numel per micro-batch")
        except Exception as e:  # noqa: BLE001
            _report("hf_trainer", e)
        return out

    training_step._fleetscope_wrapped = True  # type: ignore[attr-defined]
    trainer.training_step = training_step


# ------------------------------------------------------------------ Lightning


def _patch_lightning(mod: Any) -> None:
    trainer_cls = getattr(mod, "Trainer", None)
    if trainer_cls is None:
        return
    base_name = mod.__name__.rsplit(".trainer.trainer", 1)[0]  # lightning.pytorch / pytorch_lightning
    made: list[Any] = []

    def attach(trainer: Any) -> None:
        # the callbacks package is imported by the time a Trainer is built (the trainer module imports it)
        if not made:
            made.append(_lightning_callback_class(sys.modules[base_name + ".callbacks"].Callback))
        trainer.callbacks.append(made[0]())

    _wrap_init(trainer_cls, attach)


def _lightning_callback_class(base: Any) -> Any:
    class FleetscopeLightningCallback(base):  # type: ignore[misc, valid-type]
        """fleetscope: Lightning's ``self.log`` metrics → run.log as lightning/<name>."""

        def __init__(self) -> None:
            super().__init__()
            self._last = -1
            self._pending: list[tuple[int, str, Any, Any]] = []  # (step, name, host copy, copy-done event)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            try:
                run = _run()
                if run is None:
                    return
                self._resolve(run)
                step = int(trainer.global_step) - 1
                if step < 0 or step == self._last:
                    return  # a micro-batch of an accumulating step: once per optimizer step
                self._last = step
                data: dict[str, float] = {}
                for k, v in dict(trainer.callback_metrics).items():
                    if not isinstance(k, str):
                        continue
                    if type(v) in (int, float):
                        data[LIGHTNING_PREFIX + k] = float(v)
                    elif hasattr(v, "device") and getattr(v, "numel", lambda: 0)() == 1:
                        if v.device.type == "cpu":
                            data[LIGHTNING_PREFIX + k] = float(v.detach().item())  # host memory: no sync
                        elif len(self._pending) < _MAX_PENDING:
                            self._pending.append(_host_copy(step, LIGHTNING_PREFIX + k, v))
                if data:
                    run.log(data, step=step)
            except Exception as e:  # noqa: BLE001
                _report("lightning", e)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            try:
                run = _run()
                if run is not None:
                    self._resolve(run, wait=True)
            except Exception as e:  # noqa: BLE001
                _report("lightning", e)

        def _resolve(self, run: Any, wait: bool = False) -> None:
            keep = []
            by_step: dict[int, dict[str, float]] = {}
            for step, name, host, done in self._pending:
                if done is None or wait or done.query():
                    if wait and done is not None:
                        done.synchronize()  # training is over: nothing to stall
                    by_step.setdefault(step, {})[name] = float(host.item())
                else:
                    keep.append((step, name, host, done))
            self._pending = keep
            for step, data in sorted(by_step.items()):
                run.log(data, step=step)

    return FleetscopeLightningCallback


# ------------------------------------------------------------------ HF Accelerate


def _patch_accelerate(mod: Any) -> None:
    cls = getattr(mod, "Accelerator", None)
    if cls is None:
        return
    log_fn = cls.__dict__.get("log")
    if log_fn is None or getattr(log_fn, "_fleetscope_wrapped", False):
        return

    def log(self: Any, values: Any, step: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            _accelerate_capture(values, step)
        except Exception as e:  # noqa: BLE001
            _report("accelerate", e)
        return log_fn(self, values, step, *args, **kwargs)

    log._fleetscope_wrapped = True  # type: ignore[attr-defined]
    log.__wrapped__ = log_fn  # type: ignore[attr-defined]
    log.__doc__ = log_fn.__doc__
    cls.log = log
    end = cls.__dict__.get("end_training")
    if end is not None and not getattr(end, "_fleetscope_wrapped", False):
        def end_training(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                run = _run()
                if run is not None:
                    _accelerate_pending.resolve(run, wait=True)  # training is over: nothing to stall
            except Exception as e:  # noqa: BLE001
                _report("accelerate", e)
            return end(self, *args, **kwargs)

        end_training._fleetscope_wrapped = True  # type: ignore[attr-defined]
        end_training.__wrapped__ = end  # type: ignore[attr-defined]
        end_training.__doc__ = end.__doc__
        cls.end_training = end_training


def _step_of(step: Any) -> int | None:
    """The step passed to ``Accelerator.log`` as an int (None: none, or one not read without a sync)."""
    if step is None or type(step) is bool:
        return None
    if type(step) is int:
        return step
    if type(step).__module__ == "torch" and getattr(getattr(step, "device", None), "type", "cpu") != "cpu":
        return None  # reading it would synchronise the device
    try:
        return int(step.__index__())
    except Exception:  # noqa: BLE001
        return None


def _accelerate_capture(values: Any, step: Any) -> None:
    run = _run()
    if run is None or not hasattr(values, "items"):
        return
    pending = _accelerate_pending
    if pending.items:
        pending.resolve(run)
    at = _step_of(step)
    data: dict[str, Any] = {}
    for k, v in values.items():
        if not isinstance(k, str):
            continue
        if hasattr(v, "items"):  # {"loss": {"train": .., "eval": ..}}: TensorBoard's add_scalars
            for k2, v2 in v.items():
                if isinstance(k2, str):
                    _accelerate_value(run, data, pending, f"{ACCELERATE_PREFIX}{k}/{k2}", v2, at)
        else:
            _accelerate_value(run, data, pending, ACCELERATE_PREFIX + k, v, at)
    if data:
        run.log(data, step=at)


def _accelerate_value(run: Any, data: dict[str, Any], pending: Any, name: str, v: Any, step: int | None) -> None:
    t = type(v)
    if t is int or t is float:
        data[name] = v
    elif t.__module__ == "torch" and hasattr(v, "device"):
        if v.device.type == "cpu" or v.numel() != 1:
            data[name] = v  # run.log reads a one-element CPU tensor, drops (and counts) the rest
        elif len(pending.items) < _MAX_PENDING:
            if step is None:  # the step it was logged in (as run.log takes it), not the one it is read in
                st = run._step
                step = st.index if st is not None else (run._next_index - 1 if run._nsteps else run._next_index)
            pending.items.append(_host_copy(step, name, v))
            pending.at_finish(run)
    elif t.__module__ == "numpy":
        data[name] = v
    # strings (TensorBoard's add_text), images, tables …: not scalars


class _Pending:
    """Accelerator values on a device, copied to the host without blocking, awaiting their copy."""

    def __init__(self) -> None:
        self.items: list[tuple[int, str, Any, Any]] = []  # (step, name, host copy, copy-done event)
        self._hooked: Any = None  # the run whose finish reads what is left

    def at_finish(self, run: Any) -> None:
        """Read what is left when ``run`` finishes (its hooks are removed before it closes)."""
        if run is None or self._hooked is run:
            return
        self._hooked = run
        pending = self

        class _AtFinish:
            def remove(self) -> None:
                if pending.items:
                    pending.resolve(run, wait=True)

        run._hooks.append(_AtFinish())

    def resolve(self, run: Any, wait: bool = False) -> None:
        keep = []
        by_step: dict[int, dict[str, float]] = {}
        for step, name, host, done in self.items:
            if done is None or wait or done.query():
                if wait and done is not None:
                    done.synchronize()
                by_step.setdefault(step, {})[name] = float(host.item())
            else:
                keep.append((step, name, host, done))
        self.items = keep
        for step, data in sorted(by_step.items()):
            run.log(data, step=step)


_accelerate_pending = _Pending()


def _host_copy(step: int, name: str, v: Any) -> tuple[int, str, Any, Any]:
    """A non-blocking copy of a device scalar to host memory and an event marking its completion."""
    import torch

    host = v.detach().to("cpu", non_blocking=True)
    done = None
    if v.device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
    return step, name, host, done


_reported: set[str] = set()


def _report(where: str, e: BaseException) -> None:
    run = _run()
    if run is not None:
        run._error(f"capture:{where}", e)
    elif where not in _reported:
        _reported.add(where)
        log.warning("fleetscope: framework capture (%s) failed: %r", where, e)
