"""Zero-code instrumentation: what ``fleetscope run -- COMMAND`` does inside every Python process.

The launcher (``fleetscope/launcher.py``) puts a generated ``sitecustomize.py`` first on PYTHONPATH
and sets ``FLEETSCOPE_AUTO=1``; that file calls ``activate()`` in every Python process the command
starts. From then on, with no change to the training script:

* ``activate`` imports the standard library only. It waits for ``torch`` to be imported (a meta-path
  finder that wraps torch's loader), then, unless the process is torchrun's launcher itself, adds
  two *global* module hooks (``register_module_forward_pre_hook`` / ``register_module_forward_hook``)
  that only count the nesting depth of module calls.
* The launcher is recognised by what it does, not by its name: in every process, once torch's elastic
  agent (``LocalElasticAgent``) is imported it is watched (``failures.watch_elastic``), and the process
  whose agent starts workers — torchrun's, ``python -m torch.distributed.run``'s, ``accelerate
  launch``'s (which runs torchrun's ``run`` in its own process) — is the launcher: its module and
  optimizer hooks are removed (``_became_launcher``) and it reports the workers it sees fail. torchrun
  and ``-m torch.distributed.run`` are also known by name at torch's import, so they get no hooks.
* The first **top-level** module call in training mode with grad enabled marks a training process.
  The global hooks are removed again (they are not left on every module call). If the script has
  started a run itself (``fleetscope.agent.init``), the launcher yields to it and does nothing more.
  Otherwise it calls ``init`` (name ``FLEETSCOPE_RUN_NAME``: one name for every rank of the job, on every node;
  family ``FLEETSCOPE_FAMILY``) and ``run.instrument(model=<that module>)``: forward hooks on that
  top-level module only, plus DDP's comm hook, exactly as automatic mode.
* Step boundaries come from global optimizer hooks (``register_optimizer_step_pre_hook`` /
  ``..._post_hook``), registered when torch is imported (so they also see an ``optimizer.step()``
  entered before the run starts): a step ends when the first optimizer that stepped finishes
  ``step()``, so gradient-accumulation micro-steps are not steps. The next step opens at once in
  ``data``: the time until its first forward (loading the batch) is its ``data_s``.
* A closure passed to ``optimizer.step(closure)`` (Lightning's automatic optimization runs the last
  micro-batch's forward and backward in it) is the step's forward and backward: the pre-hook wraps
  it, and the optimizer phase begins when it returns (the first step's FLOP count ends there)
  (``torch_hooks._optimizer_step_pre``). In Lightning's first step the run starts *inside* that
  closure: the hook wrapped it before the run existed, and the step still ends at ``step()``'s end.
* A backward run *inside* the top-level forward (Lightning's manual optimization runs the whole
  ``training_step`` there) is marked ``backward``: ``torch.autograd.backward`` is wrapped once the run
  starts (``torch_hooks._NestedBackward``); a backward after the forward passes through unmarked.
* Collectives after the last optimizer step (HF Trainer's end-of-training gathers and barriers) land
  in the step opened in ``data``, which never ends: at ``finish`` it is discarded and they are
  reported as a ``collectives_after_last_step`` event, not as a step of their own (``run.finish``).

Every hook body is guarded: a failure is logged once and the job goes on, unsynchronised.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from typing import Any

from .import_hook import CallbackLoader

__all__ = ["activate", "is_launcher_process", "ENV_AUTO", "ENV_FAMILY"]

log = logging.getLogger(__name__)

ENV_AUTO = "FLEETSCOPE_AUTO"
ENV_FAMILY = "FLEETSCOPE_FAMILY"

_activated = False
_depth = 0  # nesting depth of module calls, until the first training forward
_started = False
_module_hooks: list[Any] = []
_run: Any = None  # the zero-code run, once started
_opt_hooks: list[Any] = []  # the global optimizer hooks (from torch's import on)
_boundary: list[Any] = []  # weakref to the optimizer whose step() ends a step (the first to step)
_warned: set[str] = set()
_launcher = False  # this process runs torch's elastic agent (torchrun, accelerate launch …)


def _warn_once(where: str, exc: BaseException) -> None:
    if where not in _warned:
        _warned.add(where)
        log.warning("fleetscope: zero-code instrumentation (%s) failed: %r", where, exc)


def is_launcher_process() -> bool:
    """The launcher's own process: it starts the ranks, trains nothing. torchrun (or
    torch.distributed.run / .launch) by name; any process once its elastic agent started workers
    (``accelerate launch``; ``failures.is_launcher``)."""
    if _launcher:
        return True
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0 in ("torchrun", "torchrun.exe"):
        return True
    path = (sys.argv[0] if sys.argv else "").replace("\\", "/")
    if path.endswith(("torch/distributed/run.py", "torch/distributed/launch.py")):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    for i, a in enumerate(orig[:-1]):
        if a == "-m" and orig[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return True
    return False


def activate() -> None:
    """Called by the launcher's sitecustomize in every Python process; idempotent, never raises."""
    global _activated
    if _activated or os.environ.get(ENV_AUTO) != "1":
        return
    _activated = True
    try:
        from .flight_recorder import enable

        enable()  # the Flight Recorder's buffer, before any process group exists (flight_recorder.py)
        from .failures import watch_elastic

        # whichever process runs torch's elastic agent is the launcher: it reports its failed workers
        watch_elastic(_became_launcher)
        from .framework_capture import arm

        arm()  # HF Trainer / Lightning / Accelerate logged metrics (and HF tokens), no script change (framework_capture.py)
        if "torch" in sys.modules and hasattr(sys.modules["torch"], "nn"):
            _on_torch_imported()
        else:
            sys.meta_path.insert(0, _TorchWatcher())
    except Exception as e:  # noqa: BLE001
        _warn_once("activate", e)


def _after_torch() -> None:
    try:
        _on_torch_imported()
    except Exception as e:  # noqa: BLE001
        _warn_once("torch import", e)


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is looked for, wraps the real spec's loader."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            spec = importlib.util.find_spec("torch")
        except Exception:  # noqa: BLE001
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = CallbackLoader(spec.loader, _after_torch)
        return spec


def _on_torch_imported() -> None:
    if _started or _module_hooks:
        return
    if is_launcher_process():
        return  # torchrun's process: it reports the workers it sees fail (watch_elastic, in activate)
    _install_optimizer_hooks()
    from . import pipeline_watch

    pipeline_watch.arm()  # pipeline stages built before the run starts are reported when it does
    from torch.nn.modules import module as mm

    from .mfu import watch_torch_compile

    watch_torch_compile()  # the job may compile: then the first step's FLOPs are not measured (mfu.py)
    # torch warns when a compiled module runs while global module hooks exist: these are ours, so
    # the warning is about us and hidden until they are removed (at the first training forward)
    warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING)
    _filters.append(warnings.filters[0])
    _module_hooks.append(mm.register_module_forward_pre_hook(_global_pre))
    try:
        _module_hooks.append(mm.register_module_forward_hook(_global_post, always_call=True))
    except TypeError:  # older torch without always_call
        _module_hooks.append(mm.register_module_forward_hook(_global_post))


_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
_filters: list[Any] = []  # the warning filters added while the global hooks exist


def _global_pre(module: Any, args: Any) -> None:
    global _depth
    d = _depth
    _depth = d + 1
    if d or _started:
        return
    try:
        import torch

        if module.training and torch.is_grad_enabled():
            _start(module)
    except Exception as e:  # noqa: BLE001
        _warn_once("start", e)


def _global_post(module: Any, args: Any, output: Any) -> None:
    global _depth
    if _depth > 0:
        _depth -= 1


def _remove_module_hooks() -> None:
    for h in _module_hooks:
        try:
            h.remove()
        except Exception:  # noqa: BLE001
            pass
    _module_hooks.clear()
    for f in _filters:
        try:
            warnings.filters.remove(f)  # type: ignore[attr-defined]
        except ValueError:
            pass
    _filters.clear()
    mutated = getattr(warnings, "_filters_mutated", None)  # so the removal takes effect (CPython)
    if mutated is not None:
        mutated()


def _start(module: Any) -> None:
    """The first top-level training forward of this process: start the run (unless the script did)."""
    global _started, _run
    _started = True
    _remove_module_hooks()
    from . import get_run, init
    from .run import Run
    from .torch_hooks import _forward_pre

    if get_run() is not None:
        log.info("fleetscope: the script started its own run; zero-code instrumentation yields to it")
        _remove_optimizer_hooks()
        return
    from .mfu import detect_dtype

    dtype, dtype_source = detect_dtype(module)  # inside the first forward: its autocast state, its parameters
    run = init(model_family=os.environ.get(ENV_FAMILY) or None, dtype=dtype,
               meta={"instrumented_by": "fleetscope run", "dtype_source": dtype_source})
    if not isinstance(run, Run):
        _remove_optimizer_hooks()
        return  # disabled, or init failed (it said why)
    run.instrument(model=module)
    # this call's own module pre-hook was registered too late to run: take its transition here
    if not run._finished:
        _forward_pre(run, True)
    _install_optimizer_hooks()  # (normally there since torch's import)
    _run = run
    from .torch_hooks import _NestedBackward

    nested = _NestedBackward.install(_live_run)  # a backward inside the forward (Lightning, manual)
    if nested is not None:
        run._hooks.append(nested)
    run._hooks.extend(_opt_hooks)  # removed at finish
    _opt_hooks.clear()


def _became_launcher() -> None:
    """This process's elastic agent starts workers (``failures.watch_elastic``): it trains nothing, so
    the hooks that wait for a training forward and for optimizer steps go (``accelerate launch``
    imported torch, and got them, before it ran torchrun's ``run``)."""
    global _launcher
    _launcher = True
    if _run is None and not _started:
        _remove_module_hooks()
        _remove_optimizer_hooks()


def _remove_optimizer_hooks() -> None:
    for h in _opt_hooks:
        try:
            h.remove()
        except Exception:  # noqa: BLE001
            pass
    _opt_hooks.clear()


def _install_optimizer_hooks() -> None:
    if _opt_hooks or _run is not None or _launcher:
        return
    from torch.optim import optimizer as om

    _opt_hooks.append(om.register_optimizer_step_pre_hook(_opt_pre))
    _opt_hooks.append(om.register_optimizer_step_post_hook(_opt_post))


def _live_run() -> Any:
    """The zero-code run while it records (not finished, still the process's run), else None."""
    run = _run
    if run is None or run._finished:
        return None
    get_run = _get_run
    if get_run is None:
        from .run import get_run as get_run_

        get_run = _set_get_run(get_run_)
    return run if get_run() is run else None


_get_run: Any = None  # agent.run.get_run, once imported (the hooks call _live_run on every step)


def _set_get_run(f: Any) -> Any:
    global _get_run
    _get_run = f
    return f


def _is_boundary(opt: Any) -> bool:
    """Whether ``opt``'s ``step()`` ends the step: the first optimizer that stepped while the run
    recorded (again the next one to step if that optimizer was garbage-collected)."""
    import weakref

    if not _boundary or _boundary[0]() is None:
        _boundary[:] = [weakref.ref(opt)]
    return _boundary[0]() is opt


def _opt_pre(opt: Any, args: Any, kwargs: Any) -> Any:
    from .torch_hooks import _optimizer_step_pre

    run = None
    try:
        if _run is None:
            if _started:
                return None  # the script runs its own run (or init failed): nothing to do
            # before the first training forward: the run may start inside this step's closure
            return _optimizer_step_pre(None, _live_run, args, kwargs)
        run = _live_run()
        if run is None:
            return None
        _is_boundary(opt)
        return _optimizer_step_pre(run, _live_run, args, kwargs)
    except Exception as e:  # noqa: BLE001
        if run is not None:
            run._error("optimizer", e)
        else:
            _warn_once("optimizer", e)
    return None


def _opt_post(opt: Any, args: Any, kwargs: Any) -> None:
    run = None
    try:
        run = _live_run()
        if run is None:
            return
        from .step_state import DATA, OTHER
        from .torch_hooks import _optimizer_post

        if _is_boundary(opt):
            _optimizer_post(run)  # ends the step
            if run._step is None:
                run._begin(True, DATA)  # the next step: data until its first forward
        elif run._step is not None and not run._stack:
            run._to(OTHER)
    except Exception as e:  # noqa: BLE001
        if run is not None:
            run._error("optimizer", e)
        else:
            _warn_once("optimizer", e)
