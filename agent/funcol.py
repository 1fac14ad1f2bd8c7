"""Record functional collectives (``torch.distributed._functional_collectives``): what DTensor's
redistributions (tensor / sequence parallel, ``parallelize_module``) and compiled-away-from-graph
collectives call. They never pass through the c10d functions ``collectives.py`` wraps: the C++ ops
``_c10d_functional.*`` call the process group directly.

A functional collective is asynchronous: the call issues the work and returns an
``AsyncCollectiveTensor``; the thread waits on it at first use, in the module's ``wait_tensor``. So
the wrapper records the call at issue (``coll_begin`` with ``sync=False``), the patched
``wait_tensor`` times the wait on the training thread (exposed, like ``Work.wait``) and completes the
call. A result that comes back already waited (tracing, or a gather that had to concatenate) is
complete at return. The group is named like every other: for ``(mesh, dim)`` by the mesh's dim name
directly.

Installed by ``collectives.install`` when the module is imported, restored by ``uninstall``. Under
``torch.compile`` the functional collectives are in the graph and not seen here.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from typing import Any

from . import collectives as _c
from .collective_marks import coll_begin, coll_end, wait_begin, wait_end

__all__ = ["install", "uninstall", "FUNCOL"]

log = logging.getLogger(__name__)

MODULE = "torch.distributed._functional_collectives"

#: function -> (wire op, bytes rule: "in" = the input tensor, "out" = n × the input)
FUNCOL: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "in"),
    "broadcast": ("broadcast", "in"),
    "all_gather_single": ("all_gather", "out"),
    "all_gather_tensor": ("all_gather", "out"),
    "reduce_scatter_single": ("reduce_scatter", "in"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "permute_tensor": ("send", "in"),
}

_patched: dict[str, Any] = {}  # name -> wrapper installed in the module
_orig: dict[str, Any] = {}
_pending: dict[int, tuple[Any, Any]] = {}  # storage pointer of an issued result -> (run, call)
_MAX_PENDING = 4096
_lock = threading.Lock()


class _TLS(threading.local):
    busy = False


_tls = _TLS()


def _info(mod: Any, group: Any, tag: str) -> tuple[int, str]:
    """(size, dim) of a functional collective's ``group`` argument."""
    mesh_cls = getattr(mod, "DeviceMesh", None)
    if isinstance(group, tuple) and len(group) == 2 and mesh_cls is not None and isinstance(group[0], mesh_cls):
        mesh, d = group
        pg = mesh.get_group(d)
        n = _c._group_info(pg)[0]
        names = getattr(mesh, "mesh_dim_names", None)
        return n, (str(names[d])[:48] if names else f"mesh_dim_{d}")
    if mesh_cls is not None and isinstance(group, mesh_cls) and group.ndim == 1:
        pg = group.get_group(0)
        n = _c._group_info(pg)[0]
        names = getattr(group, "mesh_dim_names", None)
        return n, (str(names[0])[:48] if names else _c._group_info(pg)[1])
    resolved = mod._resolve_group(group, tag)
    if isinstance(resolved, str):
        resolved = _c._c10d._resolve_process_group(resolved)
    return _c._group_info(resolved)


def _storage_key(t: Any) -> int | None:
    try:
        elem = getattr(t, "elem", t)
        return int(elem.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001
        return None


def _never() -> bool:
    return False


def _compiling_check() -> Any:
    """``torch.compiler.is_compiling`` (torch ≥ 2.3; ``torch._dynamo.is_compiling`` before): True
    while Dynamo traces, a constant it folds, so a traced wrapper adds nothing to the graph."""
    torch = sys.modules.get("torch")
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn if callable(fn) else _never


def _make(name: str, fn: Any, mod: Any) -> Any:
    op, rule = FUNCOL[name]
    params = list(inspect.signature(fn).parameters)
    gi = params.index("group") if "group" in params else 99
    tagi = params.index("tag") if "tag" in params else 99

    compiling = _compiling_check()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = _c._run
        # inside a graph torch.compile traces, the collective is the graph's (the Flight Recorder
        # counts it, flight_recorder.py): no recording, which would put Python side effects and
        # fake-tensor sizes into the trace
        if run is None or _tls.busy or run._in_coll or compiling():
            return fn(*args, **kwargs)
        call = None
        try:
            x: Any = args[0] if args else kwargs.get(params[0])
            group = args[gi] if gi < len(args) else kwargs.get("group")
            tag = args[tagi] if tagi < len(args) else kwargs.get("tag", "")
            info = _info(mod, group, tag)
            if info[0] > 0:
                nbytes = int(x.nbytes) * (info[0] if rule == "out" else 1)  # type: ignore[union-attr]
                call = coll_begin(run, op, info, nbytes, False)
        except Exception as e:  # noqa: BLE001 - recording never breaks the collective
            run._error("funcol", e)
            call = None
        _tls.busy = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _tls.busy = False
        if call is not None:
            try:
                acs = getattr(mod, "AsyncCollectiveTensor", None)
                key = _storage_key(result) if acs is not None and isinstance(result, acs) else None
                if key is None:
                    coll_end(run, call, True)  # came back waited
                else:
                    coll_end(run, call, False)
                    with _lock:
                        if len(_pending) >= _MAX_PENDING:
                            _pending.clear()
                        _pending[key] = (run, call)
            except Exception as e:  # noqa: BLE001
                run._error("funcol", e)
        return result

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper._fleetscope = True  # type: ignore[attr-defined]
    return wrapper


def _make_wait(fn: Any) -> Any:
    compiling = _compiling_check()

    def wait_tensor(tensor: Any) -> Any:
        if not _pending or compiling():
            return fn(tensor)
        key = _storage_key(tensor)
        with _lock:
            entry = _pending.pop(key, None) if key is not None else None
        if entry is None:
            return fn(tensor)
        run, call = entry
        token = None
        try:
            token = wait_begin(run, call)
        except Exception as e:  # noqa: BLE001
            run._error("funcol_wait", e)
        try:
            return fn(tensor)
        finally:
            if token is not None:
                try:
                    wait_end(run, call, token)
                except Exception as e:  # noqa: BLE001
                    run._error("funcol_wait", e)

    wait_tensor.__wrapped__ = fn  # type: ignore[attr-defined]
    wait_tensor.__doc__ = getattr(fn, "__doc__", None)
    wait_tensor._fleetscope = True  # type: ignore[attr-defined]
    return wait_tensor


def install() -> bool:
    """Wrap the functional collectives if their module is imported; True if wrapped."""
    mod = sys.modules.get(MODULE)
    if mod is None or _patched:
        return bool(_patched)
    try:
        for name in FUNCOL:
            fn = getattr(mod, name, None)
            if fn is None or getattr(fn, "_fleetscope", False):
                continue
            _orig[name] = fn
            w = _make(name, fn, mod)
            setattr(mod, name, w)
            _patched[name] = w
        fn = getattr(mod, "wait_tensor", None)
        if fn is not None and not getattr(fn, "_fleetscope", False):
            _orig["wait_tensor"] = fn
            w = _make_wait(fn)
            setattr(mod, "wait_tensor", w)  # noqa: B010
            _patched["wait_tensor"] = w
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: functional collectives not wrapped (%r)", e)
    return bool(_patched)


def uninstall() -> None:
    mod = sys.modules.get(MODULE)
    for name, w in list(_patched.items()):
        if mod is not None and getattr(mod, name, None) is w:
            setattr(mod, name, _orig[name])
    _patched.clear()
    _orig.clear()
    with _lock:
        _pending.clear()
