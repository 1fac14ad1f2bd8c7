"""Declared pauses (``run.pause``) and checkpoints recognised without a code change.

``Pause`` sends a ``pause`` event when it begins and one when it ends (``duration_s``): the server
then knows that a rank without steps is not stalled. ``install`` wraps, once the job imported them,
``torch.distributed.checkpoint.save``/``load`` (and the older ``save_state_dict``/``load_state_dict``)
— every call — and ``torch.save``/``torch.load`` when the object holds at least ``LARGE_BYTES`` of
tensors (for ``load``: when the file is that large) — a pause with reason ``checkpoint_save`` /
``checkpoint_load`` plus a ``checkpoint_save``/``checkpoint_load`` event with ``duration_s`` (what
goodput counts as checkpoint time). Nothing runs per step; a nested call (``dcp.save`` calling
``torch.save``) is one pause.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .health import event
from .import_hook import AfterImport

__all__ = ["Pause", "install", "uninstall", "LARGE_BYTES", "tensor_bytes"]

log = logging.getLogger(__name__)

LARGE_BYTES = 64 * 1024 * 1024
"""``torch.save``/``torch.load`` of at least this many bytes of tensors is a checkpoint."""
_MAX_WALK = 100_000  # objects looked at when sizing what torch.save is given


class _TLS(threading.local):
    depth = 0


_tls = _TLS()


class Pause:
    """``with run.pause(reason, expected_s=None):`` — ``pause`` events at begin and end."""

    __slots__ = ("_run", "reason", "expected_s", "_t0", "_ts0", "_kind", "_step")

    def __init__(self, run: Any, reason: str, expected_s: float | None = None, *, kind: str | None = None) -> None:
        self._run = run
        self.reason = str(reason)[:64]
        try:
            self.expected_s = float(expected_s) if expected_s is not None else None
        except (TypeError, ValueError):
            self.expected_s = None
        self._kind = kind  # a checkpoint: also a checkpoint_save / checkpoint_load event at the end
        self._t0 = 0.0
        self._ts0 = 0.0
        self._step: int | None = None

    def _send(self, data: dict[str, Any], kind: str = "pause", ts: float | None = None) -> None:
        run = self._run
        try:
            if run is None or run._closed:
                return
            run._tx.submit("event", event(run, kind, self._step, data, ts=ts))
        except Exception as e:  # noqa: BLE001 - never into the loop
            log.debug("fleetscope: pause event failed (%r)", e)

    def __enter__(self) -> Pause:
        self._t0 = time.monotonic()
        self._ts0 = time.time()
        try:
            self._step = int(self._run.step_index)
        except Exception:  # noqa: BLE001
            self._step = None
        _tls.depth += 1
        self._send({"reason": self.reason, "state": "begin", "expected_s": self.expected_s}, ts=self._ts0)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        _tls.depth = max(0, _tls.depth - 1)
        dur = round(time.monotonic() - self._t0, 6)
        data: dict[str, Any] = {"reason": self.reason, "state": "end", "expected_s": self.expected_s, "duration_s": dur}
        if et is not None:
            data["error"] = et.__name__[:64]
        self._send(data)
        if self._kind is not None and et is None:
            self._send({"duration_s": dur, "auto": True}, kind=self._kind, ts=self._ts0)
        return None


def tensor_bytes(obj: Any, limit: int = LARGE_BYTES) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists, tuples, objects with ``state_dict``-like dicts),
    counted until ``limit`` is reached or ``_MAX_WALK`` objects were seen."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    tensor = torch.Tensor
    total = 0
    stack = [obj]
    seen = 0
    while stack and seen < _MAX_WALK and total < limit:
        o = stack.pop()
        seen += 1
        if isinstance(o, tensor):
            try:
                total += int(o.nelement()) * int(o.element_size())
            except Exception:  # noqa: BLE001 - a tensor without storage (meta, fake)
                pass
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


_get_run: Callable[[], Any] = lambda: None  # noqa: E731 - run.get_run, set by install (no import of run.py here)


def _current_run() -> Any:
    run = _get_run()
    if run is None or run._finished or os.getpid() != run._pid:
        return None
    return run


def _wrap(fn: Callable[..., Any], kind: str, large: Callable[[tuple[Any, ...], dict[str, Any]], bool]) -> Callable[..., Any]:
    reason = kind  # checkpoint_save / checkpoint_load

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _tls.depth:
            return fn(*args, **kwargs)  # inside a pause already (dcp.save -> torch.save)
        run = _current_run()
        if run is None:
            return fn(*args, **kwargs)
        try:
            big = large(args, kwargs)
        except Exception:  # noqa: BLE001
            big = False
        if not big:
            return fn(*args, **kwargs)
        with Pause(run, reason, kind=kind):
            return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    wrapper.__qualname__ = getattr(fn, "__qualname__", "wrapper")
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper._fleetscope_ckpt = True  # type: ignore[attr-defined]
    return wrapper


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


def _save_large(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    obj = args[0] if args else kwargs.get("obj")
    return tensor_bytes(obj) >= LARGE_BYTES


def _load_large(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    f = args[0] if args else kwargs.get("f")
    if isinstance(f, (str, os.PathLike)):
        try:
            return os.path.getsize(f) >= LARGE_BYTES
        except OSError:
            return False
    return False


_patched: list[tuple[Any, str, Any]] = []  # (module, name, original)
_watching = False


def _patch(mod: Any, name: str, kind: str, large: Callable[[tuple[Any, ...], dict[str, Any]], bool]) -> None:
    fn = getattr(mod, name, None)
    if fn is None or getattr(fn, "_fleetscope_ckpt", False):
        return
    setattr(mod, name, _wrap(fn, kind, large))
    _patched.append((mod, name, fn))


_DCP = (("save", "checkpoint_save"), ("save_state_dict", "checkpoint_save"),
        ("load", "checkpoint_load"), ("load_state_dict", "checkpoint_load"))


def _patch_dcp() -> None:
    dcp = sys.modules.get("torch.distributed.checkpoint")
    if dcp is None:
        return
    for name, kind in _DCP:
        _patch(dcp, name, kind, _always)


def _after_dcp() -> None:
    try:
        _patch_dcp()
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: torch.distributed.checkpoint not watched (%r)", e)


def install(get_run: Callable[[], Any]) -> None:
    """Watch torch.save/torch.load (torch imported) and torch.distributed.checkpoint (now or when
    imported), as pauses of the run ``get_run()`` returns. Idempotent; never raises."""
    global _watching, _get_run
    _get_run = get_run
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            _patch(torch, "save", "checkpoint_save", _save_large)
            _patch(torch, "load", "checkpoint_load", _load_large)
        if "torch.distributed.checkpoint" in sys.modules:
            _patch_dcp()
        elif not _watching:
            _watching = True
            sys.meta_path.insert(0, AfterImport({"torch.distributed.checkpoint": _after_dcp}))
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: checkpoints not watched (%r)", e)


def uninstall() -> None:
    """Restore what ``install`` wrapped."""
    while _patched:
        mod, name, fn = _patched.pop()
        if getattr(getattr(mod, name, None), "__wrapped__", None) is fn:
            setattr(mod, name, fn)
