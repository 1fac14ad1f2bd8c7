"""Pipeline parallelism (``torch.distributed.pipelining``): which stage each rank runs, and the schedule.

With a run active, two wrappers report the pipeline as run events:

* ``_PipelineStageBase.__init__`` (every stage class, ``PipelineStage`` and the tracer's
  ``_PipelineStage``, runs it): one ``pp_stage`` event per stage object —
  ``{"stage", "num_stages", "group_rank", "group_size"}``; a rank with several stages (interleaved
  or V schedules) reports each.
* ``step()`` of every schedule class that defines one (``_PipelineSchedule``,
  ``PipelineScheduleSingle``, ``PipelineScheduleMulti``, and any subclass of them in the module):
  one ``pp_schedule`` event per schedule object — ``{"schedule": <class name>, "n_microbatches",
  "stages": [stage indices]}`` — and a ``pp_stage`` event for each of its stages not yet reported
  (stages built before ``fleetscope.agent.init``).

Stages built before the run starts — the zero-code launcher starts it at the first training forward,
which the schedule's first ``step()`` makes — are kept (weakly) and reported when the run attaches.

Nothing imports ``torch.distributed.pipelining``: if it is already imported the classes are wrapped at
once, otherwise an import watcher on ``sys.meta_path`` wraps them right after the package has run.

FLOPs of a run with a pipeline stage are counted without ``FlopCounterMode``'s module tracker: it puts
multi-grad hooks on module inputs, and the schedules' ``torch.autograd.grad(inputs=...)`` then fails
("A leaf node was passed to _will_engine_execute_node ..."), killing the job. Without it each rank
counts its own stage's operators over every micro-batch of the step (mfu.py ``FlopMeter.start``).

The P2P transfers themselves go through ``dist.isend``/``dist.irecv`` (the schedules' ``_batch_p2p``
calls ``P2POp.op`` directly or via ``batch_isend_irecv``) and are recorded by ``collectives.py``.

Every wrapper calls the original and never raises anything of its own into the job.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from .import_hook import CallbackLoader

__all__ = ["arm", "attach", "detach", "installed", "PACKAGE"]

log = logging.getLogger(__name__)

PACKAGE = "torch.distributed.pipelining"
_STAGE_MOD = PACKAGE + ".stage"
_SCHED_MOD = PACKAGE + ".schedules"

_armed = False
_orig: dict[tuple[type, str], Callable[..., Any]] = {}  # (class, attribute) -> the original function
_pending: weakref.WeakSet[Any] = weakref.WeakSet()  # stages built while no run was active
_reported: weakref.WeakSet[Any] = weakref.WeakSet()  # stages and schedules the active run has reported
_reported_run: Any = None  # weakref to the run ``_reported`` belongs to
_warned: set[str] = set()
_watcher: _PipeliningWatcher | None = None
_attached: Any = None  # weakref to the run ``attach`` was last called with


def installed() -> bool:
    """True while the stage and schedule classes are wrapped."""
    return bool(_orig)


def _warn_once(where: str, exc: BaseException) -> None:
    if where not in _warned:
        _warned.add(where)
        log.warning("fleetscope: pipeline stage recording (%s) failed: %r", where, exc)


def _live_run() -> Any:
    from .run import get_run

    run = get_run()
    if run is None or run._finished:
        return None
    return run


def _seen(run: Any) -> weakref.WeakSet[Any]:
    """The objects already reported into ``run`` (reset when another run is active)."""
    global _reported, _reported_run
    if _reported_run is None or _reported_run() is not run:
        _reported = weakref.WeakSet()
        _reported_run = weakref.ref(run)
    return _reported


def _no_flops(run: Any) -> None:
    """Count ``run``'s FLOPs without module hooks from now on (see the module docstring): a meter
    already running with them is dropped and the next step is measured instead — each rank counts
    its own stage's work, every micro-batch of the step."""
    if getattr(run, "_flop_plain", True):
        return
    run._flop_plain = True
    meter = getattr(run, "_flop_meter", None)
    if meter is not None and meter.active and getattr(meter, "modules", True):
        try:
            meter.cancel()
        except Exception as e:  # noqa: BLE001
            log.debug("fleetscope: FLOP meter stop failed (%r)", e)
        run._flop_meter = None
        run._flop_watch = True  # measure the next step, without module hooks


def _report_stage(run: Any, stage: Any) -> None:
    seen = _seen(run)
    if stage in seen:
        return
    seen.add(stage)
    _pending.discard(stage)
    _no_flops(run)
    run.event(
        "pp_stage",
        stage=int(stage.stage_index),
        num_stages=int(stage.num_stages),
        group_rank=int(stage.group_rank),
        group_size=int(stage.group_size),
    )


def _stages_of(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if isinstance(stages, (list, tuple)):
        return list(stages)
    stage = getattr(schedule, "_stage", None)
    return [stage] if stage is not None else []


def _report_schedule(run: Any, schedule: Any) -> None:
    seen = _seen(run)
    if schedule in seen:
        return
    stages = _stages_of(schedule)
    for st in stages:
        _report_stage(run, st)
    seen.add(schedule)
    n = getattr(schedule, "_n_microbatches", None)
    run.event(
        "pp_schedule",
        schedule=type(schedule).__name__,
        n_microbatches=int(n) if isinstance(n, int) else None,
        stages=[int(s.stage_index) for s in stages],
    )


def _flush_pending(run: Any) -> None:
    for stage in sorted(_pending, key=lambda s: getattr(s, "stage_index", 0)):
        _report_stage(run, stage)


# ---------------------------------------------------------------------- the wrappers


def _wrap_stage_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            if _orig:  # still installed
                run = _live_run()
                if run is not None:
                    _report_stage(run, self)
                else:
                    _pending.add(self)  # reported when a run attaches (zero-code: the first forward)
        except Exception as e:  # noqa: BLE001
            _warn_once("stage", e)

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    __init__._fleetscope = True  # type: ignore[attr-defined]
    __init__.__qualname__ = getattr(orig, "__qualname__", "__init__")
    __init__.__doc__ = getattr(orig, "__doc__", None)
    return __init__


def _wrap_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            run = _live_run() if _orig else None
            if run is not None:
                _report_schedule(run, self)
        except Exception as e:  # noqa: BLE001
            _warn_once("schedule", e)
        result = orig(self, *args, **kwargs)
        try:  # the first step of a zero-code job starts the run (its first forward) inside the call
            run = _live_run() if _orig else None
            if run is not None:
                _report_schedule(run, self)
        except Exception as e:  # noqa: BLE001
            _warn_once("schedule", e)
        return result

    step.__wrapped__ = orig  # type: ignore[attr-defined]
    step._fleetscope = True  # type: ignore[attr-defined]
    step.__qualname__ = getattr(orig, "__qualname__", "step")
    step.__doc__ = getattr(orig, "__doc__", None)
    return step


def _patch() -> None:
    """Wrap the stage constructor and the schedules' ``step`` (the package is imported)."""
    if _orig:
        return
    stage_mod = sys.modules.get(_STAGE_MOD)
    sched_mod = sys.modules.get(_SCHED_MOD)
    if stage_mod is None or sched_mod is None:
        return
    base = getattr(stage_mod, "_PipelineStageBase", None)
    if isinstance(base, type) and "__init__" in base.__dict__:
        fn = base.__dict__["__init__"]
        if not getattr(fn, "_fleetscope", False):
            _orig[(base, "__init__")] = fn
            base.__init__ = _wrap_stage_init(fn)  # type: ignore[misc]
    root = getattr(sched_mod, "_PipelineSchedule", None)
    if isinstance(root, type):
        for obj in list(vars(sched_mod).values()):
            if not (isinstance(obj, type) and issubclass(obj, root)):
                continue
            fn = obj.__dict__.get("step")
            if fn is None or not callable(fn) or getattr(fn, "_fleetscope", False):
                continue
            _orig[(obj, "step")] = fn
            setattr(obj, "step", _wrap_step(fn))  # noqa: B010


def _unpatch() -> None:
    for (cls, attr), fn in list(_orig.items()):
        try:
            cur = cls.__dict__.get(attr)
            if getattr(cur, "__wrapped__", None) is fn:
                setattr(cls, attr, fn)
        except Exception as e:  # noqa: BLE001
            log.debug("fleetscope: %s.%s not restored (%r)", cls.__name__, attr, e)
    _orig.clear()


def _after_pipelining() -> None:
    try:
        _remove_watcher()
        if _armed:
            _patch()
    except Exception as e:  # noqa: BLE001
        _warn_once("import", e)


class _PipeliningWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the pipelining package is looked for, wraps the real spec's loader."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != PACKAGE:
            return None
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = CallbackLoader(spec.loader, _after_pipelining)
            return spec
        except Exception as e:  # noqa: BLE001 - the normal import machinery takes over
            _warn_once("import watcher", e)
            return None


def _remove_watcher() -> None:
    global _watcher
    w, _watcher = _watcher, None
    if w is not None:
        try:
            sys.meta_path.remove(w)
        except ValueError:
            pass


def arm() -> None:
    """Wrap the pipelining classes now if the package is imported, else when it is. Idempotent,
    never raises. Stages built before a run is active are remembered for ``attach``."""
    global _armed, _watcher
    try:
        _armed = True
        if PACKAGE in sys.modules:
            _patch()
        elif _watcher is None and not _orig:
            _watcher = _PipeliningWatcher()
            sys.meta_path.insert(0, _watcher)
    except Exception as e:  # noqa: BLE001
        _warn_once("arm", e)


class _Handle:
    """Removed with the run's other hooks at ``finish``."""

    def __init__(self, run: Any) -> None:
        self._run = weakref.ref(run)

    def remove(self) -> None:
        detach(self._run())


def attach(run: Any) -> _Handle:
    """Report into ``run`` (the active run) from now on, and the stages already built; returns the
    handle ``Run._unhook`` removes at finish."""
    global _attached
    arm()
    _attached = weakref.ref(run)
    try:
        _flush_pending(run)
    except Exception as e:  # noqa: BLE001
        _warn_once("attach", e)
    return _Handle(run)


def detach(run: Any = None) -> None:
    """Restore the pipelining classes and drop the import watcher (at the finish of ``run``; a run
    that is no longer the attached one changes nothing)."""
    global _armed, _reported_run, _attached
    if run is not None and _attached is not None and _attached() is not run:
        return
    _armed = False
    _attached = None
    try:
        _remove_watcher()
        _unpatch()
    except Exception as e:  # noqa: BLE001
        _warn_once("detach", e)
    _pending.clear()
    _reported.clear()
    _reported_run = None
