"""Where this rank is, told from the sender thread: ``position`` events while a step has been open
longer than usual (or the rank has been outside any step for long), with the phase, the collective
the rank is blocked in or last issued, and — past a threshold — the training thread's Python stack.

Nothing here runs on the training thread. ``Watch.tick`` is called by the transport's sender thread
once per cycle (transport.py ``watch``) and ``Watch.observe`` sees every record the sender takes from
the queue (``observe``): the step times and the per-dimension collective counts come from the records
the training thread submits anyway, and the open step, phase and in-flight collective are read from
the state it keeps already (``run._step``, ``run._cur``, ``run._in_coll``, the step's call records).

Per-dimension sequence numbers: every collective this rank issued on a parallel dimension (the
``collective`` records and the open step's call records) is counted, so the n-th collective of a
group has number n on every rank of that group, and the ranks a group waits for are those whose
number is behind. Where torch's Flight Recorder is available (``flight_recorder.py``), its own
per-group sequence numbers and states are used instead (``source`` "flight_recorder").

Events the agent sends from threads other than the training thread (positions, failures, pauses)
take their ``seq`` from ``next_seq``: one range of their own, above the transport's, so they never
collide with the training thread's numbering. See docs/agent.md, "When a run stops".
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from statistics import median
from types import FrameType
from typing import Any

__all__ = ["Watch", "job_identity", "next_seq", "event", "capture_stack", "short_path", "HEALTH_EVENT_SEQ_BASE", "MAX_FRAMES"]

log = logging.getLogger(__name__)

HEALTH_EVENT_SEQ_BASE = 3 << 29
"""seq of the events sent off the training thread: [1.5·2**30, 2**31), growing with wall time (seconds
since 2023-11-14) so that a restarted process never reuses one; the transport's own events use
[2**30, 1.5·2**30) and the training thread's events stay below 2**30."""
_SEQ_EPOCH = 1_700_000_000
MAX_FRAMES = 12
"""Frames of a stack (position) or a traceback (failure) sent at most: the innermost ones."""
MAX_ATTEMPT = 10_000
"""The highest attempt number a registration carries (the server's bound)."""
MIN_STUCK_S = 1.0
"""A step is reported once open longer than max(2 × the rank's median step, this)."""
STEP_HISTORY = 32

_seq_lock = threading.Lock()
_seq_last = 0
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))


def next_seq() -> int:
    """A fresh event seq for events sent off the training thread (thread-safe)."""
    global _seq_last
    with _seq_lock:
        _seq_last = max(_seq_last + 1, HEALTH_EVENT_SEQ_BASE + int(time.time()) - _SEQ_EPOCH)
        return _seq_last


def event(run: Any, kind: str, step: int | None, data: dict[str, Any], ts: float | None = None) -> dict[str, Any]:
    """An event record of ``run``'s rank with a seq from ``next_seq``."""
    return {
        "rank": int(run.rank),
        "seq": next_seq(),
        "kind": kind,
        "ts": time.time() if ts is None else ts,
        "step": step,
        "data": data,
    }


def job_identity(environ: Any = None) -> tuple[str | None, int]:
    """(job id, attempt) of this process: the job id from ``env.job_id`` — FLEETSCOPE_JOB_ID, else
    TORCHELASTIC_RUN_ID (unless empty or "none"), else SLURM_JOB_ID[.SLURM_STEP_ID], else the Kubeflow
    job's, else the MPI job's, else FLEETSCOPE_LAUNCH_ID (at most 128 characters; None without any);
    the attempt from FLEETSCOPE_ATTEMPT, else TORCHELASTIC_RESTART_COUNT, else SLURM_RESTART_COUNT, else 0."""
    from .env import job_id

    env = os.environ if environ is None else environ
    job = job_id(env)[0]
    attempt = 0
    for var in ("FLEETSCOPE_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        v = str(env.get(var) or "").strip()
        if v:
            try:
                attempt = min(max(0, int(v)), MAX_ATTEMPT)
            except ValueError:
                continue
            break
    return job, attempt


def short_path(path: str) -> str:
    """A frame's file as it is shown: relative to the working directory when under it, the part
    after ``site-packages/`` for installed packages, else the base name."""
    try:
        cwd = os.getcwd()
        if path.startswith(cwd + os.sep):
            return path[len(cwd) + 1 :]
    except OSError:
        pass
    i = path.rfind("site-packages" + os.sep)
    if i >= 0:
        return path[i + len("site-packages") + 1 :]
    return os.path.basename(path)


def _agent_frame(code_file: str) -> bool:
    return code_file.startswith("<fleetscope") or os.path.dirname(code_file) == _AGENT_DIR


def capture_stack(frame: FrameType | None, limit: int = MAX_FRAMES) -> list[dict[str, Any]]:
    """The innermost ``limit`` frames from ``frame`` outwards, innermost LAST, the agent's own frames
    left out: ``[{"file", "line", "func"}]`` (no locals)."""
    out: list[dict[str, Any]] = []
    f = frame
    depth = 0
    while f is not None and len(out) < limit and depth < 512:
        code = f.f_code
        if not _agent_frame(code.co_filename):
            out.append({"file": short_path(code.co_filename)[:256], "line": int(f.f_lineno or 0), "func": code.co_name[:128]})
        f = f.f_back
        depth += 1
    out.reverse()
    return out


# call record layout (collective_stats.C_*), repeated to keep this module free of the step machine
_C_OP, _C_N, _C_BYTES, _C_ISSUE, _C_DONE, _C_KIND = 0, 1, 2, 3, 4, 6
_K_HOST = 4


class Watch:
    """The position tracker of one run (one per process), driven by the transport's sender thread."""

    def __init__(self, run: Any, *, heartbeat_s: float, stack_after_s: float) -> None:
        import weakref

        self._run = weakref.ref(run)
        self.heartbeat_s = max(0.05, float(heartbeat_s))
        self.stack_after_s = max(0.0, float(stack_after_s))
        self._pid = os.getpid()
        self._steps: deque[float] = deque(maxlen=STEP_HISTORY)  # recent step_s of this rank
        self._last_end: float | None = None  # wall time the last submitted step ended
        self._counts: dict[str, int] = {}  # collectives submitted so far, per dimension
        self._last_coll: tuple[str, str, int] | None = None  # (op, dim, bytes) of the last submitted one
        self._last_sent = -1e18  # monotonic time of the last position
        self._first_seen: dict[Any, float] = {}  # in-flight call -> wall time first seen (non-host clocks)
        self._born = time.time()
        self.sent = 0
        self.errors = 0
        self.cost_ns = 0  # time spent building positions (bench/heartbeat.py)
        self.fr: Any = None  # flight_recorder reader, when available
        self._fr_tried = False

    # -- what the sender thread takes from the queue ----------------------------------------------
    def observe(self, items: list[tuple[str, Any]]) -> None:
        """Learn step times and collective counts from the records the sender is about to send."""
        try:
            self._observe(items)
        except Exception as e:  # noqa: BLE001
            self.errors += 1
            log.debug("fleetscope: observe failed (%r)", e)

    def _observe(self, items: list[tuple[str, Any]]) -> None:
        for kind, rec in items:
            if kind == "rank_step":
                try:
                    s = float(rec[2])
                    self._steps.append(s)
                    self._last_end = float(rec[3]) + s
                except (TypeError, ValueError, IndexError):
                    pass
            elif kind == "collective":
                try:
                    dim = str(rec[10])
                    self._counts[dim] = self._counts.get(dim, 0) + int(rec[6])
                    self._last_coll = (str(rec[3]), dim, int(rec[5]))
                except (TypeError, ValueError, IndexError):
                    pass

    # -- one sender cycle ----------------------------------------------------------------------------
    def threshold_s(self) -> float:
        """How long a step may be open before it is reported: max(2 × median step, 1 s); before a
        step completed, the heartbeat (the first step may compile for minutes: the server decides)."""
        if not self._steps:
            return max(self.heartbeat_s, MIN_STUCK_S)
        return max(2.0 * median(self._steps), MIN_STUCK_S)

    def tick(self, now_mono: float | None = None) -> dict[str, Any] | None:
        """The position event to send now, or None (never more than one per heartbeat)."""
        run = self._run()
        if run is None or run._finished or os.getpid() != self._pid:
            return None
        mono = time.monotonic() if now_mono is None else now_mono
        if mono - self._last_sent < self.heartbeat_s:
            return None
        t0 = time.perf_counter_ns()
        try:
            ev = self._position(run)
        except Exception as e:  # noqa: BLE001 - the sender thread goes on
            self.errors += 1
            log.debug("fleetscope: position failed (%r)", e)
            return None
        if ev is not None:
            self._last_sent = mono
            self.sent += 1
            self.cost_ns += time.perf_counter_ns() - t0
        return ev

    def _position(self, run: Any, force: bool = False) -> dict[str, Any] | None:
        now = time.time()
        st = run._step
        if st is not None:
            state = "in_step"
            step = int(st.index)
            open_s = now - float(st.ts)
            if not force and open_s < self.threshold_s():
                return None
        else:
            state = "between_steps"
            step = int(run._next_index - 1 if run._nsteps else run._next_index)
            since = self._last_end if self._last_end is not None else self._born
            open_s = now - since
            if not force and open_s < max(self.heartbeat_s, self.threshold_s()):
                return None
        data: dict[str, Any] = {
            "state": state,
            "phase": self._phase(run) if st is not None else None,
            "open_s": round(max(0.0, open_s), 3),
            "collective": None,
            "stack": None,
            "source": "agent",
        }
        frame = sys._current_frames().get(run._tid) if open_s >= self.stack_after_s or run._in_coll else None
        coll = self._fr_collective(run)
        if coll is not None:
            data["source"] = "flight_recorder"
        else:
            coll = self._collective(run, st, frame, now)
        data["collective"] = coll
        if frame is not None and open_s >= self.stack_after_s:
            data["stack"] = capture_stack(frame)
        return event(run, "position", step, data, ts=now)

    @staticmethod
    def _phase(run: Any) -> str | None:
        cur = run._cur
        names = run._state_names
        if cur == 5 and run._stack:  # COMM: blocked in a collective inside the phase below it
            cur = run._stack[-1]
        name = names[cur] if 0 <= cur < len(names) else None
        return None if name in (None, "other", "comm") else str(name)[:64]

    # -- the collective --------------------------------------------------------------------------
    def _fr_collective(self, run: Any) -> dict[str, Any] | None:
        """The Flight Recorder's view, when torch has one and flight_recorder.py reads it."""
        if not self._fr_tried:
            self._fr_tried = True
            if os.environ.get("FLEETSCOPE_FLIGHT_RECORDER", "1").strip().lower() in ("0", "false", "no", "off"):
                return None
            try:
                from . import flight_recorder  # type: ignore[attr-defined]

                reader = getattr(flight_recorder, "position_collective", None)
                self.fr = reader if callable(reader) else None
            except Exception:  # noqa: BLE001 - absent or unusable: the agent's own records
                self.fr = None
        if self.fr is None:
            return None
        try:
            c = self.fr(run)
            return c if isinstance(c, dict) and c.get("op") else None
        except Exception as e:  # noqa: BLE001
            log.debug("fleetscope: flight recorder unreadable (%r)", e)
            self.fr = None
            return None

    def _collective(self, run: Any, st: Any, frame: FrameType | None, now: float) -> dict[str, Any] | None:
        counts = dict(self._counts)
        pending: list[Any] = []
        if st is not None:
            pending.extend(st.pre_calls)
            pending.extend(st.calls)
        else:
            pending.extend(run._gap)
        best: dict[str, Any] | None = None
        for c in pending:
            try:
                dim = str(c[_C_N][1])
            except (TypeError, IndexError):
                continue
            counts[dim] = counts.get(dim, 0) + 1
            done = c[_C_DONE] is not None
            if best is None or not done or best["done"]:
                best = {"op": str(c[_C_OP]), "dim": dim, "group": None, "seq": counts[dim],
                        "bytes": int(c[_C_BYTES] or 0), "since_s": self._since(run, c, now), "done": done}
        inflight = _wrapper_call(frame) if run._in_coll and frame is not None else None
        if inflight is not None:
            op, n, nbytes, t0, group = inflight
            dim = str(n[1]) if isinstance(n, tuple) and len(n) > 1 else "world"
            counts[dim] = counts.get(dim, 0) + 1
            since = (time.perf_counter_ns() - t0) / 1e9 if run._cpu and isinstance(t0, int) else self._seen(("fast", dim, counts[dim]), now)
            return {"op": op, "dim": dim, "group": group, "seq": counts[dim], "bytes": nbytes,
                    "since_s": round(max(0.0, since), 3), "done": False}
        if best is not None and not best["done"]:
            return best
        if best is None and self._last_coll is not None:
            op, dim, nbytes = self._last_coll
            return {"op": op, "dim": dim, "group": None, "seq": counts.get(dim), "bytes": nbytes,
                    "since_s": round(max(0.0, now - self._last_end), 3) if self._last_end is not None else None,
                    "done": True}
        return best

    def _since(self, run: Any, c: Any, now: float) -> float:
        issue = c[_C_ISSUE]
        if (run._cpu or c[_C_KIND] & _K_HOST) and isinstance(issue, int):
            return round(max(0.0, (time.perf_counter_ns() - issue) / 1e9), 3)
        return round(self._seen(id(c), now), 3)

    def _seen(self, key: Any, now: float) -> float:
        if len(self._first_seen) > 256:
            self._first_seen.clear()
        first = self._first_seen.setdefault(key, now)
        return max(0.0, now - first)


def _wrapper_call(frame: FrameType | None) -> tuple[str, Any, int | None, Any, str | None] | None:
    """The blocking collective the training thread is inside, from the collective wrapper's frame
    (collectives.py's generated fast path: its ``_fs_*`` values; the generic wrapper's call record)."""
    from .collectives import WRAPPED  # imported only once torch.distributed is (run._in_coll)

    f = frame
    depth = 0
    while f is not None and depth < 64:
        code = f.f_code
        if code.co_filename.startswith("<fleetscope wrapper of "):
            loc = f.f_locals
            if "_fs_t0" not in loc:  # handed to the generic wrapper: its call record is in the step
                return None
            op = WRAPPED.get(code.co_name, (code.co_name,))[0]
            group = loc.get("group")
            gname = None
            if group is not None:
                try:
                    gname = str(group.group_name)[:64]
                except Exception:  # noqa: BLE001
                    gname = None
            b = loc.get("_fs_bytes")
            return op, loc.get("_fs_n"), int(b) if isinstance(b, int) else None, loc.get("_fs_t0"), gname
        f = f.f_back
        depth += 1
    return None


def install(run: Any, transport: Any) -> Watch | None:
    """Attach a position tracker of ``run`` to ``transport``'s sender thread (transport.py ``watch``)."""
    if not hasattr(transport, "watch"):
        return None
    cfg = run.config
    w = Watch(run, heartbeat_s=cfg.heartbeat_s, stack_after_s=cfg.stack_after_s)
    prev = getattr(transport, "observe", None)
    if prev is None:
        transport.observe = w.observe
    else:  # chained after what is there already

        def observe(items: list[tuple[str, Any]]) -> None:
            prev(items)
            w.observe(items)

        transport.observe = observe
    transport.watch = w.tick
    return w
