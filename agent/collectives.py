"""Record torch.distributed collectives: op, group size, bytes, duration, exposed vs overlapped.

``install(run)`` replaces the public collective functions of ``torch.distributed`` (and the same names
in ``torch.distributed.distributed_c10d``, so that library code calling either module is seen) with
thin wrappers, and ``Work.wait`` with a timed version for the works those wrappers returned.

Per call the wrapper takes two clock marks and appends one call record to the current step:

* a blocking call (``async_op=False``) on the training thread: the whole call is exposed — the thread
  waited — and is charged to ``comm_exposed_s`` (on GPU: CUDA events on the current stream, whose gap
  is the stream's stall on the collective; a call issued on a side stream counts as overlapped);
* ``async_op=True``: the issue is timed; completion is taken from the work's future callback (gloo:
  the moment the work finishes, on its thread; NCCL: an event recorded on a stream that waits for the
  collective), and ``work.wait()`` on the training thread is the exposed part;
* DDP's gradient buckets do not go through Python collectives (the C++ reducer calls the process
  group). ``torch_hooks.instrument`` registers :func:`ddp_allreduce_hook` — the default all-reduce hook
  plus timing — so buckets are recorded as ``all_reduce`` calls. Their exposed part is the tail of
  backward: the reducer waits for all buckets right after the last one is issued, so exposure =
  (last bucket completion − last bucket issue), partitioned over buckets (``collective_stats.py``).

``bytes`` follows NCCL-tests' "size" (the number its algbw divides by; busbw = algbw × wire.busbw_factor):
all_reduce, broadcast, reduce, send/recv: the tensor; all_gather: the gathered output (n × the
per-rank input); reduce_scatter and all_to_all: the full per-rank input; gather/scatter: the per-rank
chunk; barrier: 0.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .collective_marks import coll_begin, coll_done_async, coll_end, ddp_issue, wait_begin, wait_end
from .collective_stats import K_SYNC_FAST, Call
from .machine import StepMachine
from .mfu import MESH_SIZES

__all__ = ["install", "uninstall", "installed", "ddp_allreduce_hook", "WRAPPED", "message_bytes"]

log = logging.getLogger(__name__)

#: function name -> (wire op, bytes rule, always async). Rules: "t0"/"t1" = that positional tensor,
#: "l0"/"l1" = sum over that tensor list, "ll0" = sum over a list of lists, "" = 0 bytes.
WRAPPED: dict[str, tuple[str, str, bool]] = {
    "all_reduce": ("all_reduce", "t0", False),
    "all_reduce_coalesced": ("all_reduce", "l0", False),
    "broadcast": ("broadcast", "t0", False),
    "reduce": ("reduce", "t0", False),
    "all_gather": ("all_gather", "l0", False),
    "all_gather_single": ("all_gather", "t0", False),
    "all_gather_into_tensor": ("all_gather", "t0", False),
    "_all_gather_base": ("all_gather", "t0", False),
    "all_gather_coalesced": ("all_gather", "ll0", False),
    "reduce_scatter": ("reduce_scatter", "l1", False),
    "reduce_scatter_single": ("reduce_scatter", "t1", False),
    "reduce_scatter_tensor": ("reduce_scatter", "t1", False),
    "_reduce_scatter_base": ("reduce_scatter", "t1", False),
    "all_to_all": ("all_to_all", "l1", False),
    "all_to_all_single": ("all_to_all", "t1", False),
    "send": ("send", "t0", False),
    "recv": ("recv", "t0", False),
    "isend": ("send", "t0", True),
    "irecv": ("recv", "t0", True),
    "gather": ("gather", "t0", False),
    "scatter": ("scatter", "t0", False),
    "barrier": ("barrier", "", False),
}

_run: StepMachine | None = None  # the run collectives are recorded into (None: wrappers pass through)
_Fn = Callable[..., Any]  # a torch.distributed function, or our wrapper of it
_orig: dict[str, _Fn] = {}  # name -> original function
_patched: dict[tuple[str, str], _Fn] = {}  # (module, name) -> wrapper installed there
_orig_wait: _Fn | None = None
_works: weakref.WeakKeyDictionary[Any, tuple[StepMachine, Call]] = weakref.WeakKeyDictionary()  # work -> its call
_sizes: dict[Any, GroupInfo] = {}  # group -> (size, dim)
_c10d: Any = None  # torch.distributed.distributed_c10d, bound by install()


class _TLS(threading.local):
    busy = False  # inside a wrapped collective: nested calls (e.g. all_gather_into_tensor ->
    # all_gather_single) are the same collective and are not recorded twice


_tls = _TLS()
_get_ident = threading.get_ident


def installed() -> bool:
    return bool(_patched)


GroupInfo = tuple[int, str]
"""(ranks in the group — -1 when this rank is not in it —, its dimension label): slot ``C_N`` of a call."""

_MAX_GROUPS = 1024
_mesh_dims: dict[str, str] = {}  # process-group name -> DeviceMesh dim name (mesh_watch below)
_labels_sent: set[str] = set()  # group names already described by a "comm_group" event


def _group_info(group: Any) -> GroupInfo:
    """(size, dimension) of ``group`` (None: the default group), cached per group object."""
    if group is None:
        group = _c10d.GroupMember.WORLD
        if group is None:
            return int(_c10d.get_world_size(None)), "world"  # raises "not initialized" like the call would
    info = _sizes.get(group)
    if info is None:
        n = int(_c10d.get_world_size(group))
        dim = "world"
        try:
            dim = group_label(group)
        except Exception as e:  # noqa: BLE001 - the label is best effort, the record is not
            log.debug("fleetscope: no label for a process group (%r)", e)
        info = (n, dim)
        if len(_sizes) > _MAX_GROUPS:
            _sizes.clear()
        _sizes[group] = info
        if n > 0:
            _describe(group, n, dim)
    return info


_group_size = _group_info  # the wrappers' name for it


def group_label(group: Any) -> str:
    """The parallel dimension a process group belongs to, the same on every rank of that dimension:

    1. the DeviceMesh dim name the job gave it (``mesh_dim_names``; recorded when the mesh was made,
       or read from the group's description ``mesh_<name>`` that DeviceMesh sets);
    2. ``"world"`` for the default group (all ranks);
    3. else a stable id from its shape: ``g<size>s<stride>`` (e.g. ``g2s1`` for [0,1] and [2,3])."""
    name = _group_name(group)
    if name is not None:
        dim = _mesh_dims.get(name)
        if dim is not None:
            return dim
    desc = getattr(group, "group_desc", None)
    if isinstance(desc, str) and desc.startswith("mesh_") and desc not in ("mesh_default",):
        return desc[5:][:48]
    world = _c10d.GroupMember.WORLD
    if group is world:
        return "world"
    ranks = _group_ranks(group)
    if ranks is not None and world is not None and len(ranks) == _c10d.get_world_size(world):
        return "world"
    if ranks and len(ranks) > 1:
        stride = ranks[1] - ranks[0]
        if all(b - a == stride for a, b in zip(ranks, ranks[1:], strict=False)):
            return f"g{len(ranks)}s{stride}"
        return f"g{len(ranks)}"
    return f"g{len(ranks) if ranks else 0}"


def _group_name(group: Any) -> str | None:
    try:
        name = group.group_name
        return str(name) if name is not None else None
    except Exception:  # noqa: BLE001
        return None


def _group_ranks(group: Any) -> list[int] | None:
    try:
        return sorted(int(r) for r in _c10d.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001
        return None


#: ranks one ``comm_group`` event lists at most (the server's ``MAX_GROUP_RANKS_LISTED``); a group whose
#: ranks are an arithmetic progression (every DeviceMesh group) is sent as start/stride/size instead
MAX_GROUP_RANKS_LISTED = 16_384


def group_members(ranks: list[int]) -> dict[str, Any]:
    """How a group's sorted global ranks travel: ``{"start", "stride"}`` when they are an arithmetic
    progression (exact for any size), else ``{"ranks": [...]}`` with at most MAX_GROUP_RANKS_LISTED."""
    if len(ranks) == 1:
        return {"start": ranks[0], "stride": 1}
    if len(ranks) >= 2:
        stride = ranks[1] - ranks[0]
        if stride > 0 and all(b - a == stride for a, b in zip(ranks, ranks[1:], strict=False)):
            return {"start": ranks[0], "stride": stride}
    return {"ranks": ranks[:MAX_GROUP_RANKS_LISTED]}


def _describe(group: Any, n: int, dim: str) -> None:
    """One ``comm_group`` event per group this rank uses: its dimension, size and global ranks (as
    start/stride, or listed: ``group_members``), so the server can tell whether the group spans nodes.
    Never raises: the training loop does not see a failure here."""
    try:
        run = _run
        name = _group_name(group) or dim
        if run is None or name in _labels_sent or len(_labels_sent) >= 64:
            return
        _labels_sent.add(name)
        ranks = _group_ranks(group) or []
        data: dict[str, Any] = {"dim": dim, "size": n, "group": name[:64]}
        if ranks and len(ranks) == n:
            data.update(group_members(ranks))
        elif ranks and len(ranks) < n:  # not the whole group: listed as it is
            data["ranks"] = ranks[:MAX_GROUP_RANKS_LISTED]
        run._event("comm_group", None, data)
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: comm_group event failed (%r)", e)


def register_mesh(mesh: Any) -> None:
    """Name the process groups of a DeviceMesh by its dim names (called for every mesh made)."""
    try:
        names = getattr(mesh, "mesh_dim_names", None)
        for i in range(mesh.ndim):
            dim = str(names[i]) if names else f"mesh_dim_{i}"
            if len(MESH_SIZES) < _MAX_GROUPS:
                MESH_SIZES[dim[:48]] = int(mesh.size(i))  # mfu.model_parallel_degree
            pg = mesh.get_group(i)
            name = _group_name(pg)
            if name is not None and len(_mesh_dims) < _MAX_GROUPS:
                _mesh_dims[name] = dim[:48]
                _sizes.pop(pg, None)  # label it anew
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: DeviceMesh not registered (%r)", e)


def _nbytes_list(x: Any) -> int:
    return sum(int(t.nbytes) for t in x) if x is not None else 0


def message_bytes(rule: str, x: Any) -> int:
    """Bytes of the argument ``x`` of a collective under ``rule`` (see ``WRAPPED``)."""
    if not rule or x is None:
        return 0
    kind = rule[:-1]
    if kind == "t":
        return int(x.nbytes)
    if kind == "l":
        return _nbytes_list(x)
    return sum(_nbytes_list(inner) for inner in x)


_K_SYNC = K_SYNC_FAST  # a blocking call of the training thread, timed by the fast path
_message_bytes = message_bytes


def _make_wrapper(name: str, fn: _Fn) -> _Fn:
    """The wrapper of ``fn``: the generic one below, or, where the signature allows it, a generated
    one with ``fn``'s exact parameters whose hot case is inlined (see ``_make_fast``)."""
    op, rule, always_async = WRAPPED[name]
    try:
        sig = inspect.signature(fn)
        params = list(sig.parameters)
    except (TypeError, ValueError):  # pragma: no cover
        sig = None
        params = []
    generic = _make_generic(fn, op, rule, always_async, params)
    wrapper = generic
    if sig is not None and not always_async:
        try:
            wrapper = _make_fast(name, fn, op, rule, sig, generic)
        except Exception as e:  # noqa: BLE001 - an unusual signature: the generic wrapper does it all
            log.debug("fleetscope: generic wrapper for %s (%r)", name, e)
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__qualname__ = getattr(fn, "__qualname__", name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper._fleetscope = True  # type: ignore[attr-defined]
    return wrapper


def _make_generic(fn: _Fn, op: str, rule: str, always_async: bool, params: list[str]) -> _Fn:
    """Any call: async, on another thread, outside a step, on the CUDA clock (``collective_marks.coll_begin``)."""
    gi = params.index("group") if "group" in params else 99
    ai = params.index("async_op") if "async_op" in params else 99
    ti = int(rule[-1]) if rule else 99
    tname = params[ti] if ti < len(params) else ""
    single = rule[:-1] == "t"
    tls = _tls

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = _run
        if run is None:
            return fn(*args, **kwargs)
        # nested calls (all_gather_into_tensor -> all_gather_single ...) are the same collective: the
        # training thread says so in run._in_coll, any other thread in its thread-local
        main = _get_ident() == run._tid
        if run._in_coll if main else tls.busy:
            return fn(*args, **kwargs)
        call = None
        sync = True
        try:
            nargs = len(args)
            group = args[gi] if gi < nargs else kwargs.get("group")
            if group is None:
                group = _c10d.GroupMember.WORLD  # the default group (re-created by destroy + init)
            n = _sizes.get(group)
            if n is None:
                n = _group_info(group)
            if n[0] > 0:  # -1: this rank is not in the group, nothing happens
                if always_async:
                    sync = False
                elif ai < nargs:
                    sync = not args[ai]
                elif kwargs:
                    sync = not kwargs.get("async_op", False)
                x: Any = args[ti] if ti < nargs else kwargs.get(tname)
                nbytes = x.nbytes if single else message_bytes(rule, x)
                call = coll_begin(run, op, n, nbytes, sync)
        except Exception as e:  # noqa: BLE001 - recording must never break the collective
            run._error("collective", e)
            call = None
        if main:
            run._in_coll = True
        else:
            tls.busy = True
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if main:
                run._in_coll = False
            else:
                tls.busy = False
            if call is not None:
                try:
                    coll_end(run, call, True)
                except Exception as e:  # noqa: BLE001
                    run._error("collective", e)
            raise
        if main:
            run._in_coll = False
        else:
            tls.busy = False
        if call is not None:
            try:
                if sync or result is None:
                    coll_end(run, call, True)
                else:
                    _track(run, call, result)
            except Exception as e:  # noqa: BLE001
                run._error("collective", e)
        return result

    return wrapper


# The hot case, generated per function with its exact parameters (no *args/**kwargs packing, no
# argument search): a blocking call on the training thread inside a step timed by the host clock.
# Two clock reads and one record tuple; the call's time stays charged to the state it was issued in
# (K_FAST) and is moved to exposed comm when the step is resolved (CollectiveStats.emit_cpu), off
# this path. ``run._in_coll`` tells a nested call (all_gather_into_tensor -> all_gather_single ...)
# that it is part of this one. Anything else goes to the generic wrapper. Like dataclasses, the
# function is built from source.
_FAST_SRC = """
def _fs_factory(_fs_fn, _fs_generic, _fs_op, _fs_rule{defaults}):
    def {name}({params}):
        _fs_run = _run
        if (
            _fs_run is not None
            and _fs_run._fast
            and {sync}
            and not _fs_run._in_coll
            and _get_ident() == _fs_run._tid
        ):
            try:
                _fs_g = {group}
                if _fs_g is None:
                    _fs_g = {world}
                _fs_n = _sizes.get(_fs_g)
                if _fs_n is None:
                    _fs_n = _group_size(_fs_g)
                _fs_bytes = {nbytes}
            except Exception as _fs_e:  # the generic wrapper records the error and calls
                return _fs_generic({args})
            if _fs_n[0] <= 0:  # this rank is not in the group: nothing happens
                return _fs_fn({args})
            _fs_mark = _fs_run._mark
            _fs_run._in_coll = True
            _fs_t0 = _fs_mark()
            try:
                return _fs_fn({args})
            finally:
                _fs_t1 = _fs_mark()
                _fs_run._in_coll = False
                _fs_st = _fs_run._step
                if _fs_st is not None:
                    _fs_st.calls.append(
                        (_fs_op, _fs_n, _fs_bytes, _fs_t0, _fs_t1, None, _K_SYNC, _fs_run._cur, None)
                    )
        return _fs_generic({args})

    return {name}
"""


def _make_fast(name: str, fn: _Fn, op: str, rule: str, sig: inspect.Signature, generic: _Fn) -> _Fn:
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    kwonly = inspect.Parameter.KEYWORD_ONLY
    names = list(sig.parameters)
    if not name.isidentifier() or any(p.kind not in (plain, kwonly) for p in sig.parameters.values()):
        raise ValueError(f"signature {sig} is not generated")
    if any(n.startswith("_fs_") for n in names):
        raise ValueError(f"parameter names of {sig} clash")
    defs: list[str] = []
    values: list[Any] = []
    star = False
    for p in sig.parameters.values():
        if p.kind is kwonly and not star:
            defs.append("*")
            star = True
        if p.default is inspect.Parameter.empty:
            defs.append(p.name)
        else:
            defs.append(f"{p.name}=_fs_d{len(values)}")
            values.append(p.default)
    args = ", ".join(p.name if p.kind is plain else f"{p.name}={p.name}" for p in sig.parameters.values())
    ti = int(rule[-1]) if rule else -1
    if ti >= len(names):
        raise ValueError(f"no tensor argument {ti} in {sig}")
    if not rule:
        nbytes = "0"
    elif rule[:-1] == "t":
        nbytes = f"{names[ti]}.nbytes"
    else:
        nbytes = f"_message_bytes(_fs_rule, {names[ti]})"
    src = _FAST_SRC.format(
        name=name,
        params=", ".join(defs),
        defaults="".join(f", _fs_d{i}" for i in range(len(values))),
        sync="not async_op" if "async_op" in names else "True",
        group="group" if "group" in names else "None",
        # the default group: GroupMember.WORLD is two Python properties deep, _world._default_pg is
        # what they return (torch >= 2.1; _world is created once, never rebound)
        world="_c10d._world._default_pg" if _has_world_attr() else "_c10d.GroupMember.WORLD",
        nbytes=nbytes,
        args=args,
    )
    ns: dict[str, Any] = {}
    # this module's globals: the function reads _run, _sizes, _c10d ... as they are at call time
    exec(compile(src, f"<fleetscope wrapper of {name}>", "exec"), globals(), ns)
    return ns["_fs_factory"](fn, generic, op, rule, *values)


def _has_world_attr() -> bool:
    try:
        return "_default_pg" in vars(_c10d._world)
    except Exception:  # noqa: BLE001 - another torch, or install() not called yet
        return False


def _track(run: StepMachine, call: Call, work: Any) -> None:
    """An async collective was issued: time its ``wait()`` and catch its completion."""
    _works[work] = (run, call)
    try:
        work.get_future().add_done_callback(lambda _f: coll_done_async(run, call))
    except Exception:  # noqa: BLE001 - backends without futures: completion = end of wait()
        pass


def _timed_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
    orig = _orig_wait
    assert orig is not None  # bound by install() before it replaced Work.wait with this
    entry = _works.pop(self, None) if _works else None
    if entry is None:
        return orig(self, *args, **kwargs)
    run, call = entry
    token = None
    try:
        token = wait_begin(run, call)
    except Exception as e:  # noqa: BLE001
        run._error("wait", e)
    try:
        return orig(self, *args, **kwargs)
    finally:
        if token is not None:
            try:
                wait_end(run, call, token)
            except Exception as e:  # noqa: BLE001
                run._error("wait", e)


def install(run: StepMachine) -> bool:
    """Record collectives into ``run`` from now on; False if torch.distributed is unavailable."""
    global _run, _orig_wait, _c10d
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed import distributed_c10d as c10d

    _c10d = c10d

    if not _patched:
        wrappers: dict[int, Any] = {}  # one wrapper per original object, shared by both modules
        for name in WRAPPED:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "_fleetscope", False):
                    continue
                w = wrappers.get(id(fn))
                if w is None:
                    w = wrappers[id(fn)] = _make_wrapper(name, fn)
                    _orig.setdefault(name, fn)
                setattr(mod, name, w)
                _patched[(mod.__name__, name)] = w
        work_cls = getattr(c10d, "Work", None)
        if work_cls is not None and _orig_wait is None:
            _orig_wait = work_cls.wait
            work_cls.wait = _timed_wait
        _watch_meshes()
    _sizes.clear()
    _labels_sent.clear()
    _run = run
    return True


_mesh_init: Any = None  # DeviceMesh.__init__ before it was wrapped


def _watch_meshes() -> None:
    """Name the groups of every DeviceMesh made from now on (``register_mesh``)."""
    global _mesh_init
    mod = sys.modules.get("torch.distributed.device_mesh")
    cls = getattr(mod, "DeviceMesh", None) if mod is not None else None
    if cls is None or _mesh_init is not None or not isinstance(cls, type):
        return
    init = cls.__dict__["__init__"]
    _mesh_init = init

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _run is not None:
            register_mesh(self)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def _unwatch_meshes() -> None:
    global _mesh_init
    mod = sys.modules.get("torch.distributed.device_mesh")
    cls = getattr(mod, "DeviceMesh", None) if mod is not None else None
    if cls is not None and _mesh_init is not None and getattr(cls.__dict__.get("__init__"), "__wrapped__", None) is _mesh_init:
        cls.__init__ = _mesh_init  # type: ignore[misc]
    _mesh_init = None


def uninstall(run: StepMachine | None = None) -> None:
    """Stop recording (for ``run``, or whatever run is recording) and restore torch.distributed."""
    global _run, _orig_wait
    if run is not None and _run is not run:
        return
    _run = None
    _unwatch_meshes()
    for (modname, name), w in list(_patched.items()):
        mod = sys.modules.get(modname)
        if mod is not None and getattr(mod, name, None) is w:
            setattr(mod, name, getattr(w, "__wrapped__", w))
        del _patched[(modname, name)]
    _orig.clear()
    if _orig_wait is not None:
        from torch.distributed import distributed_c10d as c10d

        if getattr(c10d.Work, "wait", None) is _timed_wait:
            c10d.Work.wait = _orig_wait  # type: ignore[method-assign]
        _orig_wait = None
    _works.clear()
    _sizes.clear()


def ddp_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``
    (divide by the group size, all-reduce, return the bucket) with the bucket's issue and completion
    recorded. With no active run it is exactly the default hook.

    Deliberately unannotated: DDP rejects a hook whose ``bucket`` annotation is anything but
    ``dist.GradBucket``, and this module must not import torch to name it."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    n = group.size()
    tensor.div_(n)
    run = _run
    call = None
    if run is not None:
        try:
            call = ddp_issue(run, _group_info(group), int(tensor.nbytes))
        except Exception as e:  # noqa: BLE001
            run._error("ddp_hook", e)
    all_reduce = _orig.get("all_reduce", dist.all_reduce)
    fut = all_reduce(tensor, group=group, async_op=True).get_future()
    if call is None:
        return fut.then(_first_value)

    def _done(f: Any) -> Any:
        try:
            coll_done_async(run, call)
        except Exception:  # noqa: BLE001
            pass
        return f.value()[0]

    return fut.then(_done)


def _first_value(f: Any) -> Any:
    return f.value()[0]
