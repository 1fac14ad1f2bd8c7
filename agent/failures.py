"""Why a rank stopped: ``failure`` events for an uncaught exception, ``sys.exit`` with a non-zero
code, SIGTERM, and — in the launcher's own process under ``fleetscope run``, the one that runs torch's
elastic agent (torchrun, ``python -m torch.distributed.run``, ``accelerate launch``) — each worker it saw
die (its exit code or signal, and torchrun's error file when the worker wrote one).

Every hook chains what was there before and never swallows anything: the original
``sys.excepthook``/``threading.excepthook`` still runs, ``sys.exit`` still raises, a SIGTERM still
ends the process with SIGTERM (the job's own handler, when it has one, is left alone). The failure
event is flushed at once with a short timeout (``FLUSH_S``) so it is not lost with the process; the
run then finishes as ``failed``. Event data (docs/agent.md, "When a run stops"):
``{"source", "exception", "message", "frames", "phase", "signal", "exit_code", "rank"}``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType
from typing import Any, NoReturn

from .health import MAX_FRAMES, event, short_path

__all__ = ["install", "record", "failed", "watch_elastic", "is_launcher", "MAX_MESSAGE", "FLUSH_S"]

log = logging.getLogger(__name__)

MAX_MESSAGE = 1_000
"""Characters of an exception's message (or torchrun's error file message) a failure carries."""
FLUSH_S = 2.0
"""How long a failing process waits for its failure event to reach the server."""

_run_getter: Any = None
_installed = False
_failed = False
_reported: set[int] = set()  # ids of the exceptions already reported (excepthook after threading's)
_prev_excepthook: Any = None
_prev_thread_hook: Any = None
_prev_exit: Any = None
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))


def failed() -> bool:
    """Whether this process recorded a failure (its run then finishes as ``failed``)."""
    return _failed


def _frames(tb: TracebackType | None) -> list[dict[str, Any]]:
    """The innermost frames of a traceback (innermost last), the agent's own left out; when the
    innermost frames are library code, the user's frames around them are kept first."""
    out: list[dict[str, Any]] = []
    for fs in traceback.extract_tb(tb, limit=None)[-256:]:
        fn = fs.filename or ""
        if fn.startswith("<fleetscope") or os.path.dirname(os.path.abspath(fn)) == _AGENT_DIR:
            continue
        out.append({"file": short_path(fn)[:256], "line": int(fs.lineno or 0), "func": (fs.name or "")[:128]})
    if len(out) <= MAX_FRAMES:
        return out
    user = [i for i, f in enumerate(out) if not _library(f["file"])]
    if user:  # end at the innermost frames, but keep the innermost user frame in view
        last_user = user[-1]
        start = max(0, min(len(out) - MAX_FRAMES, last_user - MAX_FRAMES // 2))
        return out[start : start + MAX_FRAMES]
    return out[-MAX_FRAMES:]


def _library(short: str) -> bool:
    return short.startswith(("torch/", "numpy/", "transformers/", "lightning/", "accelerate/")) or "/python3" in short


def _phase_and_step(run: Any) -> tuple[str | None, int | None]:
    """The phase and step the run was in: the open step's current state, else the step the
    exception aborted (``Run._abort`` keeps it)."""
    try:
        st = run._step
        if st is not None:
            cur = run._cur
            if cur == 5 and run._stack:
                cur = run._stack[-1]
            names = run._state_names
            name = names[cur] if 0 <= cur < len(names) else None
            return (None if name in (None, "other", "comm") else str(name)), int(st.index)
        ab = getattr(run, "_aborted_at", None)
        if ab is not None:
            return ab[1], int(ab[0])
        return None, int(run._next_index - 1 if run._nsteps else run._next_index)
    except Exception:  # noqa: BLE001
        return None, None


def record(
    run: Any,
    source: str,
    *,
    exc: BaseException | None = None,
    tb: TracebackType | None = None,
    signal_name: str | None = None,
    exit_code: int | None = None,
    frame: FrameType | None = None,
    flush: bool = True,
) -> dict[str, Any] | None:
    """Send one ``failure`` event of ``run`` (flushed within FLUSH_S); returns it. Never raises."""
    global _failed
    _failed = True
    try:
        if run is None or run._closed:
            return None
        phase, step = _phase_and_step(run)
        frames: list[dict[str, Any]] = []
        if tb is not None:
            frames = _frames(tb)
        elif frame is not None:
            from .health import capture_stack

            frames = capture_stack(frame)
        message = None
        if exc is not None:
            try:
                message = str(exc)[:MAX_MESSAGE]
            except Exception:  # noqa: BLE001
                message = None
        data = {
            "source": source,
            "exception": type(exc).__name__ if exc is not None else None,
            "message": message,
            "frames": frames,
            "phase": phase,
            "signal": signal_name,
            "exit_code": exit_code,
            "rank": int(run.rank),
        }
        ev = event(run, "failure", step, data)
        run._tx.submit("event", ev)
        if flush:
            run._tx.flush(timeout=FLUSH_S)
        return ev
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: failure not recorded (%r)", e)
        return None


def _current() -> Any:
    g = _run_getter
    try:
        return g() if g is not None else None
    except Exception:  # noqa: BLE001
        return None


def _excepthook(et: type[BaseException], ev: BaseException, tb: TracebackType | None) -> None:
    try:
        if not issubclass(et, KeyboardInterrupt) and id(ev) not in _reported:
            _reported.add(id(ev))
            record(_current(), "exception", exc=ev, tb=tb)
    except Exception:  # noqa: BLE001
        pass
    prev = _prev_excepthook or sys.__excepthook__
    prev(et, ev, tb)


def _thread_excepthook(args: Any) -> None:
    try:
        run = _current()
        # only a thread that trains (the run's training thread) ends the run; a helper thread's
        # exception is the job's business
        if run is not None and args.thread is not None and args.thread.ident == run._tid and args.exc_value is not None:
            if id(args.exc_value) not in _reported and not isinstance(args.exc_value, SystemExit):
                _reported.add(id(args.exc_value))
                record(run, "exception", exc=args.exc_value, tb=args.exc_traceback)
    except Exception:  # noqa: BLE001
        pass
    prev = _prev_thread_hook or threading.__excepthook__
    prev(args)


def _exit(status: object = None) -> NoReturn:
    """``sys.exit`` that records a non-zero exit first (then raises SystemExit as before)."""
    try:
        code = status if isinstance(status, int) and not isinstance(status, bool) else (0 if status is None else 1)
        if code != 0 and threading.current_thread() is threading.main_thread():
            run = _current()
            if run is not None:
                record(run, "exit", exit_code=code, frame=sys._getframe(1), exc=None)
    except Exception:  # noqa: BLE001
        pass
    prev = _prev_exit
    if prev is not None:
        prev(status)
    raise SystemExit(status)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    try:
        run = _current()
        if run is not None:
            record(run, "signal", signal_name="SIGTERM", frame=frame)
            run.finish("failed", timeout=FLUSH_S)
    except Exception:  # noqa: BLE001
        pass
    # end as SIGTERM would have: the default action, so the parent sees the signal
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def install(run_getter: Any) -> None:
    """Chain the exception hooks, ``sys.exit`` and (when the job has none) SIGTERM; idempotent."""
    global _installed, _run_getter, _prev_excepthook, _prev_thread_hook, _prev_exit
    _run_getter = run_getter
    if _installed:
        return
    _installed = True
    _prev_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    _prev_thread_hook = threading.excepthook
    threading.excepthook = _thread_excepthook
    _prev_exit = sys.exit
    sys.exit = _exit
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass


# ------------------------------------------------- the launcher's own process (torch's elastic agent)


def signal_name(exit_code: int | None) -> str | None:
    """"SIGKILL" for -9 (a worker torchrun saw die of a signal), None for an exit code >= 0."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"SIG{-exit_code}"


_elastic_wrapped = False
_elastic_watched = False
_launcher = False  # this process runs torch's elastic agent: it starts the ranks, trains nothing
_on_launcher: list[Any] = []  # called once when this process turns out to be the launcher


_LEA = "torch.distributed.elastic.agent.server.local_elastic_agent"


def is_launcher() -> bool:
    """Whether this process started workers through torch's elastic agent (``LocalElasticAgent``):
    torchrun's, ``python -m torch.distributed.run``'s, ``accelerate launch``'s own process, or any
    other that calls ``torch.distributed.launcher.api.elastic_launch``."""
    return _launcher


def watch_elastic(on_launcher: Any = None) -> bool:
    """In every process ``fleetscope run`` starts: once torch's elastic agent is imported (now, if it
    already is), report the workers it sees fail (``LocalElasticAgent._monitor_workers``); the process
    whose agent starts workers is the launcher (``is_launcher``; ``on_launcher()`` is then called once).
    Keyed on the agent itself, not on the command's name: torchrun, ``python -m torch.distributed.run``
    and ``accelerate launch`` (which runs torchrun's ``run`` in its own process) alike. Idempotent."""
    global _elastic_watched
    if on_launcher is not None and on_launcher not in _on_launcher:
        _on_launcher.append(on_launcher)
        if _launcher:
            _call_on_launcher()
    if _elastic_wrapped or _elastic_watched:
        return True
    _elastic_watched = True
    if _LEA in sys.modules:
        _wrap_elastic()
    else:
        from .import_hook import AfterImport

        # importing torchrun's agent ourselves, earlier than torchrun does, changes how it sets up its
        # workers' stores: wrap it right after the launcher imports it (a worker never does)
        sys.meta_path.insert(0, AfterImport({_LEA: _wrap_elastic}))
    return True


def _call_on_launcher() -> None:
    for f in _on_launcher:
        try:
            f()
        except Exception as e:  # noqa: BLE001
            log.debug("fleetscope: launcher callback failed (%r)", e)


def _became_launcher() -> None:
    global _launcher
    if not _launcher:
        _launcher = True
        _call_on_launcher()


def _wrap_elastic() -> None:
    global _elastic_wrapped
    if _elastic_wrapped:
        return
    lea = sys.modules.get(_LEA)
    if lea is None:
        return
    cls = lea.LocalElasticAgent
    orig = cls._monitor_workers
    start = cls._start_workers

    def _start_workers(self: Any, worker_group: Any) -> Any:
        try:
            _became_launcher()  # this process starts the ranks
        except Exception:  # noqa: BLE001
            pass
        return start(self, worker_group)

    _start_workers.__wrapped__ = start  # type: ignore[attr-defined]
    cls._start_workers = _start_workers  # type: ignore[method-assign]

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        before = time.time()  # taken before the check looks at the workers
        result = orig(self, worker_group)
        try:
            if result.is_failed() and result.failures:
                _report_workers(self, worker_group, result)
            else:
                # every worker was alive at this time: a worker found dead at a later check died after
                # it (torchrun's own failure timestamps are whole seconds, taken when it noticed)
                self._fleetscope_alive_at = before
        except Exception as e:  # noqa: BLE001
            log.warning("fleetscope: failed workers not reported (%r)", e)
        return result

    _monitor_workers.__wrapped__ = orig  # type: ignore[attr-defined]
    cls._monitor_workers = _monitor_workers  # type: ignore[method-assign]
    _elastic_wrapped = True
    try:  # which workers had failed before torchrun stopped the rest (those are torn down, not causes)
        from torch.distributed.elastic.multiprocessing import api as mp_api

        pc = mp_api.PContext
        close = pc.close

        def close_noting_failures(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                failures = getattr(self, "_failures", None)
                self._fleetscope_failed_first = set(failures) if isinstance(failures, dict) else None
            except Exception:  # noqa: BLE001
                pass
            return close(self, *args, **kwargs)

        close_noting_failures.__wrapped__ = close  # type: ignore[attr-defined]
        pc.close = close_noting_failures  # type: ignore[method-assign]
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: torchrun's process context not watched (%r)", e)


def _error_file(failure: Any) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(exception type, message, frames) from torchrun's error file of a worker, when it wrote one."""
    data = getattr(failure, "error_file_data", None) or {}
    msg = data.get("message") if isinstance(data, dict) else None
    text = None
    frames: list[dict[str, Any]] = []
    if isinstance(msg, dict):
        text = msg.get("message")
        extra = msg.get("extraInfo") or {}
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        if isinstance(stack, str):
            frames = _frames_from_text(stack)
    elif isinstance(msg, str):
        text = msg
    if not isinstance(text, str) or not text or not os.path.isfile(str(getattr(failure, "error_file", "") or "")):
        return None, None, frames
    exc = None
    head = text.split(":", 1)[0].strip()
    if head.isidentifier() and (head.endswith(("Error", "Exception", "Interrupt", "Exit")) or head[:1].isupper()):
        exc = head.rsplit(".", 1)[-1]
    return exc, text[:MAX_MESSAGE], frames


def _frames_from_text(stack: str) -> list[dict[str, Any]]:
    import re

    out = []
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', stack):
        fn = m.group(1)
        if os.path.dirname(os.path.abspath(fn)) == _AGENT_DIR:
            continue
        out.append({"file": short_path(fn)[:256], "line": int(m.group(2)), "func": m.group(3)[:128]})
    return out[-MAX_FRAMES:]


def _report_workers(agent: Any, worker_group: Any, result: Any) -> None:
    """One ``failure`` event (source "launcher") per failed worker, into the run of this attempt;
    the attempt then finishes ``failed``."""
    from .config import AgentConfig
    from .health import MAX_ATTEMPT, job_identity
    from .transport import Transport

    name = os.environ.get("FLEETSCOPE_RUN_NAME")
    cfg = AgentConfig.from_env()
    if not name or cfg.disabled or (cfg.server is None and not cfg.offline):
        return
    spec = worker_group.spec
    attempt = min(max(0, int(spec.max_restarts - agent._remaining_restarts)), MAX_ATTEMPT)
    workers = list(worker_group.workers)
    world = max([int(w.world_size) for w in workers if w.world_size is not None] or [1])
    run_id = None
    try:
        run_id = spec.rdzv_handler.get_run_id()
    except Exception:  # noqa: BLE001
        pass
    # the job id the workers see: torchrun hands them its rendezvous run id as TORCHELASTIC_RUN_ID
    job_id, attempt_env = job_identity({**os.environ, **({"TORCHELASTIC_RUN_ID": run_id} if run_id else {})})
    if os.environ.get("FLEETSCOPE_ATTEMPT"):
        attempt = attempt_env
    run_info: dict[str, Any] = {
        "name": name,
        "world_size": world,
        "job_id": job_id,
        "attempt": attempt,
        "config": {},
        "meta": {},
    }
    by_rank = {int(w.global_rank): w for w in workers}
    first = getattr(getattr(agent, "_pcontext", None), "_fleetscope_failed_first", None)  # local ranks
    now = time.time()
    alive_at = getattr(agent, "_fleetscope_alive_at", None)  # the last check that found all alive
    agent._fleetscope_alive_at = None  # the next attempt starts afresh
    tx = Transport(cfg, run_info)
    try:
        for rank, failure in sorted(result.failures.items(), key=lambda kv: getattr(kv[1], "timestamp", 0)):
            code = getattr(failure, "exitcode", None)
            exc, message, frames = _error_file(failure)
            torn_down = first is not None and getattr(failure, "local_rank", None) not in first
            if message is None and code is not None and code < 0:
                message = f"killed by {signal_name(code)}" + (" (torchrun stopped it after another worker failed)"
                                                              if torn_down else "")
            w = by_rank.get(int(rank))
            data = {
                "source": "launcher",
                "exception": exc,
                "message": message,
                "frames": frames,
                "phase": None,
                "signal": signal_name(code),
                "exit_code": code,
                "rank": int(rank),
                "local_rank": int(getattr(failure, "local_rank", -1)),
                "pid": int(getattr(failure, "pid", 0) or 0),
            }
            if w is not None:
                data["host"] = os.uname().nodename[:128]
            ts = getattr(failure, "timestamp", None)
            if torn_down:
                data["torn_down"] = True  # not a cause: stopped by torchrun after the first failure
                ts = now
            elif code is not None and code < 0 and isinstance(alive_at, float):
                # killed by a signal (it could say nothing itself): it died after the last check that
                # saw it alive, so that time is when it failed at the earliest — what its death caused
                # elsewhere (a peer's "connection closed" error) comes after it, never before
                ts = alive_at + 1e-3
            else:
                # it exited (its own failure record has the exact time) or no earlier check: noticed now
                ts = now
            tx.submit("event", {
                "rank": int(rank), "seq": _next(), "kind": "failure",
                "ts": float(ts) if isinstance(ts, (int, float)) and ts > 0 else now,
                "step": None, "data": data,
            })
        tx.finish_run("failed")
    finally:
        tx.close(timeout=cfg.exit_timeout_s)


def _next() -> int:
    from .health import next_seq

    return next_seq()
