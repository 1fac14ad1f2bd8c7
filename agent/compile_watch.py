"""torch.compile health: compiles, recompiles (with the guard that failed), graph breaks (with their
reason, deduplicated), compile time and CUDA-graph replays, sent as run events.

``install(run)`` (called by ``init``) watches torch._dynamo from the moment it is imported: at once
when it already is, else through a meta-path finder that waits for ``import torch._dynamo`` (which
``torch.compile`` does on its first call, and so does creating a torch optimizer): the watcher never
pays that ~1 s import itself.
The handle it adds to ``run._hooks`` removes everything at ``run.finish``. What it reads, all on the
compiling thread, only while compiling (nothing on the step path):

* compile start/end: ``torch._dynamo.callback_handler.register_start_callback`` /
  ``register_end_callback`` (one pair per outermost compile; ``CallbackArgs.callback_trigger`` tells a
  Dynamo frame compile from a lazy backward compile or a CUDA-graph recording). Compile time is the
  ``perf_counter`` interval between the two.
* the recompile reason: Dynamo computes the failed guard (``get_and_maybe_log_recompilation_reasons``)
  before the start callback and stores it in its metrics context (``recompile_reason``); it is read
  from there, so nothing is logged (``TORCH_LOGS=recompiles`` is neither needed nor touched).
* the compiled frame: the ``code`` argument of convert_frame's ``compile_inner`` on the stack.
* graph breaks: a pass-through wrapper of ``InstructionTranslatorBase.log_graph_break`` (the graph
  break type, e.g. "Data-dependent branching", and the user line); on a torch without it, the
  ``torch._dynamo.utils.graph_break_reasons`` list is read after each compile. The reason is
  "<type> (<file>:<line>)", deduplicated.
* CUDA-graph replays (GPU only): a counting wrapper of inductor's
  ``CUDAGraphTreeManager.execute_node`` (the replay of a recorded graph), once cudagraph trees are in
  use and CUDA is available.
* ``torch._dynamo.reset()`` clears the callbacks: a wrapper registers them again.

Events (``run.event``, step = the run's current step): ``compile`` per compile
``{"compile_s", "frame", "recompile", "reason", "trigger"}``, ``graph_break`` once per distinct reason
``{"reason", "count": 1}``, and at finish ``compile_summary`` (totals, graph-break counts, what was
dropped) and ``cudagraph`` ``{"replays"}`` when there were any. Bounded: at most ``MAX_REASONS``
distinct graph-break and recompile reasons and ``MAX_COMPILE_EVENTS`` compile events per process;
the rest is counted. Events made off the training thread wait in a bounded queue for it (or finish).

Every hook body is guarded: an error is handed to ``run._error`` (counted, logged once) and the
compile goes on. On a torch without one of these APIs that part is simply absent. Importing this
module imports nothing from torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import CodeType
from typing import Any

from .import_hook import CallbackLoader

__all__ = ["install", "CompileWatch", "MAX_REASONS", "MAX_COMPILE_EVENTS", "MAX_REASON_CHARS", "watching"]

log = logging.getLogger(__name__)

MAX_REASONS = 200
"""Distinct graph-break reasons, and distinct recompile reasons, kept per process."""
MAX_COMPILE_EVENTS = 2000
"""``compile`` events sent per process; later compiles are only counted (``compile_summary``)."""
MAX_REASON_CHARS = 500
_MAX_DEFERRED = 1000
_DYNAMO = "torch._dynamo"
_CUDAGRAPH_TREES = "torch._inductor.cudagraph_trees"
_TRIGGERS = {"DYNAMO": "dynamo", "LAZY_BACKWARD": "lazy_backward", "CUDAGRAPH_RECORDING": "cudagraph_recording",
             "TRITON_AUTOTUNING": "triton_autotuning"}

_lock = threading.Lock()
_handle: _Handle | None = None  # the installed one (one run at a time, like init)


def install(run: Any) -> None:
    """Watch torch.compile for ``run`` (now if torch._dynamo is imported, else once it is); the handle
    added to ``run._hooks`` undoes it at finish. Never raises."""
    global _handle
    try:
        with _lock:
            previous, _handle = _handle, None
        if previous is not None:
            previous.remove()
        h = _Handle(run)
        with _lock:
            _handle = h
        run._hooks.append(h)
        h.start()
    except Exception as e:  # noqa: BLE001 - never into the job
        _fail(run, "install", e)


def watching() -> CompileWatch | None:
    """The watcher installed now, if torch._dynamo is imported and a run is being watched (tests)."""
    h = _handle
    return h.watch if h is not None else None


def _fail(run: Any, where: str, exc: BaseException) -> None:
    err = getattr(run, "_error", None)
    if callable(err):
        try:
            err(f"compile_watch.{where}", exc)
            return
        except Exception:  # noqa: BLE001
            pass
    log.debug("fleetscope compile watch: %s failed: %r", where, exc)


class _Handle:
    """What ``run._hooks`` holds: the pending import watch, then the watcher; ``remove`` ends both."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.watch: CompileWatch | None = None
        self.finder: _DynamoFinder | None = None
        self.removed = False

    def start(self) -> None:
        if _DYNAMO in sys.modules:
            self.on_dynamo_imported()
        else:
            self.finder = _DynamoFinder(self)
            sys.meta_path.insert(0, self.finder)

    def on_dynamo_imported(self) -> None:
        if self.removed or self.watch is not None:
            return
        try:
            w = CompileWatch(self.run)
            w.attach()
            self.watch = w
        except Exception as e:  # noqa: BLE001
            _fail(self.run, "attach", e)

    def remove(self) -> None:
        global _handle
        if self.removed:
            return
        self.removed = True
        f, self.finder = self.finder, None
        if f is not None:
            try:
                sys.meta_path.remove(f)
            except ValueError:
                pass
        w, self.watch = self.watch, None
        if w is not None:
            w.detach()
        with _lock:
            if _handle is self:
                _handle = None


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch._dynamo`` is imported, its real loader is wrapped so the
    watcher attaches once the package has executed."""

    def __init__(self, handle: _Handle) -> None:
        self._handle = handle

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _DYNAMO:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001 - let the import machinery report it as usual
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        handle = self._handle

        def after() -> None:
            handle.finder = None
            handle.on_dynamo_imported()

        spec.loader = CallbackLoader(spec.loader, after)
        return spec


class _Patch:
    """``owner.name`` replaced by ``wrapper``; put back at ``undo`` unless someone wrapped it since
    (then the wrapper stays, passing straight through once the watcher is detached)."""

    __slots__ = ("owner", "name", "original", "wrapper")

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.owner = owner
        self.name = name
        self.original = getattr(owner, name)
        self.wrapper = make(self.original)
        setattr(owner, name, self.wrapper)

    def undo(self) -> None:
        if getattr(self.owner, self.name, None) is self.wrapper:
            setattr(self.owner, self.name, self.original)


def _short_path(path: str) -> str:
    parts = path.replace("\\", "/").rsplit("/", 2)
    return "/".join(parts[-2:])


def _clip(s: str) -> str:
    return s if len(s) <= MAX_REASON_CHARS else s[: MAX_REASON_CHARS - 1] + "…"


class CompileWatch:
    """The hooks of one run in torch._dynamo, and what they counted (see the module docstring)."""

    def __init__(self, run: Any, *, graph_breaks_from: str = "auto", cuda: bool | None = None) -> None:
        self._run = run
        self._live = False
        self._mu = threading.Lock()
        self._patches: list[_Patch] = []
        self._handler: Any = None
        self._metrics_context: Callable[[], Any] | None = None
        self._gb_list: list[Any] | None = None  # torch._dynamo.utils.graph_break_reasons (fallback source)
        self._gb_seen = 0
        self._gb_last: Any = None  # the last item read: tells a cleared-and-refilled list
        self._gb_mode = graph_breaks_from  # "auto": the log_graph_break wrapper when there is one
        self._cuda = cuda  # None: torch.cuda.is_available() decides (tests force it)
        self._cg_patched = False
        # the compile in progress
        self._t0: float | None = None
        self._trigger = "dynamo"
        self._reason: str | None = None
        self._frame: str | None = None
        self._step: int | None = None
        # counts
        self.compiles = 0
        self.recompiles = 0
        self.compile_s = 0.0
        self.other_compiles = 0  # lazy backward compiles, CUDA-graph recordings (their time is in compile_s)
        self.replays = 0
        self.graph_breaks: dict[str, int] = {}
        self.recompile_reasons: dict[str, int] = {}
        self.reasons_dropped = 0
        self.events_dropped = 0
        self._events_sent = 0
        self._frames_seen: set[str] = set()
        self._new_breaks: list[str] = []
        self._deferred: deque[tuple[str, int | None, dict[str, Any]]] = deque()

    # ------------------------------------------------------------------ attach / detach
    def attach(self) -> None:
        """Register the callbacks and wrappers this torch has (each optional)."""
        dyn = sys.modules.get(_DYNAMO)
        if dyn is None:
            return
        self._live = True
        handler = getattr(dyn, "callback_handler", None)
        if handler is None:
            handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
        if handler is not None and hasattr(handler, "register_start_callback"):
            self._handler = handler
            self._register()
        self._guarded("attach.metrics", self._find_metrics_context)
        self._guarded("attach.graph_breaks", self._hook_graph_breaks)
        self._guarded("attach.reset", self._hook_reset)
        self._guarded("attach.cudagraphs", self._maybe_hook_cudagraphs)

    def detach(self) -> None:
        """Remove every hook; send what is still queued and the run's totals. Never raises."""
        if not self._live:
            return
        self._live = False
        h = self._handler
        if h is not None:
            for remove, cb in ((getattr(h, "remove_start_callback", None), self._on_start),
                               (getattr(h, "remove_end_callback", None), self._on_end)):  # fmt: skip
                try:
                    if remove is not None:
                        remove(cb)
                except Exception:  # noqa: BLE001 - already gone (torch._dynamo.reset() cleared it)
                    pass
        for p in reversed(self._patches):
            try:
                p.undo()
            except Exception as e:  # noqa: BLE001
                self._fail("detach", e)
        self._patches = []
        self._guarded("detach.graph_breaks", self._poll_graph_break_list)
        self._guarded("detach.events", self._final_events)

    def _register(self) -> None:
        h = self._handler
        if h is None:
            return
        if self._on_start not in getattr(h, "start_callbacks", ()):
            h.register_start_callback(self._on_start)
        if self._on_end not in getattr(h, "end_callbacks", ()):
            h.register_end_callback(self._on_end)

    def _find_metrics_context(self) -> None:
        utils = sys.modules.get("torch._dynamo.utils")
        fn = getattr(utils, "get_metrics_context", None)
        self._metrics_context = fn if callable(fn) else None

    def _hook_graph_breaks(self) -> None:
        utils = sys.modules.get("torch._dynamo.utils")
        lst = getattr(utils, "graph_break_reasons", None)
        if isinstance(lst, list):
            self._gb_list = lst
            self._gb_seen = len(lst)
            self._gb_last = lst[-1] if lst else None
        if self._gb_mode == "list":
            return
        sc = sys.modules.get("torch._dynamo.symbolic_convert")
        cls = getattr(sc, "InstructionTranslatorBase", None)
        if cls is None or not callable(cls.__dict__.get("log_graph_break")):
            return
        watch = self

        def make(original: Any) -> Any:
            def log_graph_break(tx: Any, *args: Any, **kwargs: Any) -> Any:
                if watch._live:
                    try:
                        watch._graph_break_logged(args, kwargs)
                    except Exception as e:  # noqa: BLE001
                        watch._fail("graph_break", e)
                return original(tx, *args, **kwargs)

            log_graph_break.__wrapped__ = original  # type: ignore[attr-defined]
            log_graph_break.__doc__ = original.__doc__
            return log_graph_break

        self._patches.append(_Patch(cls, "log_graph_break", make))
        self._gb_mode = "wrapper"

    def _hook_reset(self) -> None:
        dyn = sys.modules.get(_DYNAMO)
        if self._handler is None or not callable(getattr(dyn, "reset", None)):
            return
        watch = self

        def make(original: Any) -> Any:
            def reset(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                finally:  # reset() clears every compile callback: ours come back
                    if watch._live:
                        watch._guarded("reset", watch._after_reset)

            reset.__wrapped__ = original  # type: ignore[attr-defined]
            reset.__doc__ = original.__doc__
            return reset

        self._patches.append(_Patch(dyn, "reset", make))

    def _after_reset(self) -> None:
        self._register()
        self._t0 = None
        self._gb_seen = 0  # reset() cleared Dynamo's list of graph-break reasons too

    def _maybe_hook_cudagraphs(self) -> None:
        """Count replays of inductor's CUDA-graph trees, once they are in use and CUDA is there."""
        if self._cg_patched or _CUDAGRAPH_TREES not in sys.modules:
            return
        cuda = self._cuda
        if cuda is None:
            torch = sys.modules.get("torch")
            cuda = bool(torch is not None and torch.cuda.is_available())
        self._cg_patched = True  # one try
        if not cuda:
            return
        cls = getattr(sys.modules[_CUDAGRAPH_TREES], "CUDAGraphTreeManager", None)
        if cls is None or not callable(cls.__dict__.get("execute_node")):
            return
        watch = self

        def make(original: Any) -> Any:
            def execute_node(mgr: Any, *args: Any, **kwargs: Any) -> Any:
                watch.replays += 1
                return original(mgr, *args, **kwargs)

            execute_node.__wrapped__ = original  # type: ignore[attr-defined]
            return execute_node

        self._patches.append(_Patch(cls, "execute_node", make))

    # ------------------------------------------------------------------ callbacks (compiling thread)
    def _on_start(self, args: Any = None, *_: Any) -> None:
        try:
            if not self._live:
                return
            name = getattr(getattr(args, "callback_trigger", None), "name", None)
            trigger = _TRIGGERS.get(name, str(name).lower()) if name else "dynamo"
            self._trigger = trigger
            self._reason = None
            self._frame = None
            self._step = self._step_index()
            if trigger == "dynamo":
                self._reason = self._recompile_reason()
                self._frame = _compiling_frame()
            self._t0 = time.perf_counter()
        except Exception as e:  # noqa: BLE001
            self._t0 = None
            self._fail("compile_start", e)

    def _on_end(self, args: Any = None, *_: Any) -> None:
        try:
            t0 = self._t0
            if t0 is None or not self._live:
                return
            self._t0 = None
            self._compiled(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            self._fail("compile_end", e)

    def _compiled(self, seconds: float) -> None:
        trigger, reason, frame, step = self._trigger, self._reason, self._frame, self._step
        with self._mu:
            self.compile_s += seconds
            if trigger == "dynamo":
                self.compiles += 1
                recompile = reason is not None
                if not recompile and self._metrics_context is None and frame is not None:
                    recompile = frame in self._frames_seen  # no recompile reasons in this torch: the same frame again
                if frame is not None and len(self._frames_seen) < 4 * MAX_REASONS:
                    self._frames_seen.add(frame)
                if recompile:
                    self.recompiles += 1
                    if reason is not None:
                        reason = self._keep(self.recompile_reasons, _clip(reason))
            else:
                self.other_compiles += 1
                recompile = False
            send = self._events_sent < MAX_COMPILE_EVENTS
            if send:
                self._events_sent += 1
            else:
                self.events_dropped += 1
        if self._gb_mode != "wrapper":
            self._poll_graph_break_list()
        if send:
            self._emit("compile", step, {"compile_s": round(seconds, 6), "frame": frame, "recompile": recompile,
                                         "reason": reason, "trigger": trigger})
        self._send_new_breaks(step)
        if not self._cg_patched:
            self._guarded("cudagraphs", self._maybe_hook_cudagraphs)

    def _keep(self, table: dict[str, int], reason: str) -> str | None:
        """Count ``reason`` in ``table`` (caller holds ``_mu``); None when the table is full and it is new."""
        if reason in table:
            table[reason] += 1
            return reason
        if len(table) >= MAX_REASONS:
            self.reasons_dropped += 1
            return None
        table[reason] = 1
        return reason

    def _recompile_reason(self) -> str | None:
        fn = self._metrics_context
        if fn is None:
            return None
        metrics = getattr(fn(), "_metrics", None)
        r = metrics.get("recompile_reason") if isinstance(metrics, dict) else None
        return str(r) if r is not None else None

    # ------------------------------------------------------------------ graph breaks
    def _graph_break_logged(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``log_graph_break(code_options, reason, exc)`` is being called (torch ≥ 2.5 signature; the
        arguments are looked up by name first, by position second)."""
        exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
        if exc is not None and getattr(exc, "logged", False):
            return  # Dynamo logs each graph break once; so do we
        text = kwargs.get("reason", args[1] if len(args) > 1 else None)
        kind = getattr(exc, "gb_type", None) or _first_line(text) or (type(exc).__name__ if exc is not None else None)
        if not kind:
            return
        stack = getattr(exc, "real_stack", None)
        where = None
        if stack:
            fs = stack[-1]
            where = f"{_short_path(str(getattr(fs, 'filename', '?')))}:{getattr(fs, 'lineno', '?')}"
        self._graph_break(str(kind), where)

    def _poll_graph_break_list(self) -> None:
        """Fallback source: the ``GraphCompileReason``s Dynamo appended since the last look."""
        lst = self._gb_list
        if lst is None or self._gb_mode == "wrapper":
            return
        n = len(lst)
        seen = self._gb_seen
        if seen > n or (seen and lst[seen - 1] is not self._gb_last):  # cleared since (torch._dynamo.reset())
            seen = 0
        for r in lst[seen:n]:
            stack = getattr(r, "user_stack", None)
            where = None
            if stack:
                fs = stack[-1]
                where = f"{_short_path(str(getattr(fs, 'filename', '?')))}:{getattr(fs, 'lineno', '?')}"
            kind = _first_line(getattr(r, "reason", None))
            if kind:
                self._graph_break(kind, where)
        self._gb_seen = n
        self._gb_last = lst[n - 1] if n else None

    def _graph_break(self, kind: str, where: str | None) -> None:
        reason = _clip(f"{kind} ({where})" if where else kind)
        with self._mu:
            new = reason not in self.graph_breaks
            kept = self._keep(self.graph_breaks, reason)
            if new and kept is not None:
                self._new_breaks.append(kept)

    def _send_new_breaks(self, step: int | None) -> None:
        with self._mu:
            new, self._new_breaks = self._new_breaks, []
        for reason in new:
            self._emit("graph_break", step, {"reason": reason, "count": 1})

    # ------------------------------------------------------------------ events
    def _step_index(self) -> int | None:
        try:
            return int(self._run.step_index)
        except Exception:  # noqa: BLE001
            return None

    def _emit(self, kind: str, step: int | None, data: dict[str, Any]) -> None:
        """``run.event`` on the training thread; from another thread the event waits for it (bounded)."""
        run = self._run
        tid = getattr(run, "_tid", None)
        if tid is not None and threading.get_ident() != tid:
            if len(self._deferred) < _MAX_DEFERRED:
                self._deferred.append((kind, step, data))
            else:
                with self._mu:
                    self.events_dropped += 1
            return
        self._flush_deferred()
        run.event(kind, step=step, **data)

    def _flush_deferred(self) -> None:
        q = self._deferred
        while q:
            try:
                kind, step, data = q.popleft()
            except IndexError:
                return
            self._run.event(kind, step=step, **data)

    def _final_events(self) -> None:
        self._send_new_breaks(self._step_index())
        self._flush_deferred()
        step = self._step_index()
        with self._mu:
            any_compile = self.compiles or self.other_compiles or self.graph_breaks
            summary = {
                "compiles": self.compiles,
                "recompiles": self.recompiles,
                "compile_s": round(self.compile_s, 6),
                "other_compiles": self.other_compiles,
                "graph_breaks": [{"reason": r, "count": c} for r, c in self.graph_breaks.items()],
                "recompile_reasons": [{"reason": r, "count": c} for r, c in self.recompile_reasons.items()],
                "reasons_dropped": self.reasons_dropped,
                "events_dropped": self.events_dropped,
            }
            replays = self.replays
        if any_compile:
            self._run.event("compile_summary", step=step, **summary)
        if replays > 0:
            self._run.event("cudagraph", step=step, replays=replays)

    # ------------------------------------------------------------------ errors
    def _guarded(self, where: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self._fail(where, e)

    def _fail(self, where: str, exc: BaseException) -> None:
        _fail(self._run, where, exc)


def _first_line(text: Any) -> str | None:
    if not isinstance(text, str):
        return None
    line = text.strip().split("\n", 1)[0].strip()
    return line or None


def _compiling_frame() -> str | None:
    """"file:line function" of the frame Dynamo is compiling: the ``code`` argument of convert_frame's
    ``_compile`` (or of its ``compile_inner``) further up this thread's stack. When that is Dynamo's
    own wrapper of a torch module's forward (``torch.compile(nn.Linear(...))``), the wrapped function."""
    f: Any = sys._getframe(2)
    code: Any = None
    frame_locals: Any = None
    for _ in range(40):
        if f is None:
            break
        co = f.f_code
        if co.co_name in ("compile_inner", "_compile") and co.co_filename.endswith("convert_frame.py"):
            loc = f.f_locals
            code = loc.get("code")
            if co.co_name == "_compile":
                frame_locals = loc.get("locals")
                break
        f = f.f_back
    if not isinstance(code, CodeType):
        return None
    if isinstance(frame_locals, dict) and "/_dynamo/" in code.co_filename.replace("\\", "/"):
        inner = _describe_callable(frame_locals.get("fn"))
        if inner is not None:
            return inner
    return f"{_short_path(code.co_filename)}:{code.co_firstlineno} {code.co_name}"


def _describe_callable(fn: Any) -> str | None:
    if not hasattr(fn, "__code__"):
        owner = getattr(fn, "__self__", fn)  # a module, or its bound __call__ / _call_impl
        if callable(getattr(type(owner), "forward", None)):
            fn = type(owner).forward
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, CodeType):
        return None
    return f"{_short_path(code.co_filename)}:{code.co_firstlineno} {getattr(fn, '__qualname__', code.co_name)}"
