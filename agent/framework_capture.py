"""Zero-code capture of what training frameworks already log (``fleetscope run``): Hugging Face
``Trainer``'s logged metrics and tokens, Lightning's ``self.log`` metrics — through their own callback
APIs, with no change to the script.

``arm()`` (called by ``auto.activate`` in every process ``fleetscope run`` starts; standard library
only) watches the imports of ``transformers.trainer`` and ``lightning.pytorch.trainer.trainer`` /
``pytorch_lightning.trainer.trainer`` without importing them. Once such a module has executed, its
``Trainer.__init__`` is wrapped: every Trainer built afterwards gets one fleetscope callback.

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

The ``hf/`` and ``lightning/`` prefixes say where a figure comes from. Every callback body is guarded:
a failure is reported once through the run and the job goes on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from .import_hook import AfterImport

__all__ = ["arm", "HF_PREFIX", "LIGHTNING_PREFIX"]

log = logging.getLogger(__name__)

HF_PREFIX = "hf/"
LIGHTNING_PREFIX = "lightning/"
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
        }
        for name, patch in list(targets.items()):
            mod = sys.modules.get(name)
            if mod is not None and hasattr(mod, "Trainer"):
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
