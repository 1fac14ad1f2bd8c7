"""Read torch's Flight Recorder: the process groups' own ring buffer of collectives (torch ≥ 2.5 for
``_dump_fr_trace`` on NCCL, recent torch on gloo too), read on the sender thread only.

The Flight Recorder sees every collective the process groups run, including the ones the agent's
Python wrappers cannot: collectives issued inside a ``torch.compile``'d graph (functional collectives
lowered to ``_c10d_functional`` ops), and any issued from C++. Each entry carries the group, its
per-group sequence number (``collective_seq_id``), the op (``profiling_name``, e.g. ``nccl:all_reduce``),
the tensor sizes and dtypes, the wall time it was created and, where the backend tracks them, its
state and start/completion times. ``pg_status`` says per group the last collective enqueued, started
and completed: a group whose last enqueued is past its last completed has one in flight.

Two users:

* ``GraphCollectives`` (``Run``'s sender thread): counts, per step, the collectives the Flight
  Recorder saw that the agent's own records did not — "graph collectives" — by (op, dim), with their
  bytes, and sends them as ``graph_collectives`` events (the server shows them in the run's
  ``compile`` summary). No time is claimed for them: gloo records none, and NCCL only with timing on.
* ``position_collective`` (health.py): the collective a rank is blocked in, or issued last, with
  the group's own sequence number — the same number on every rank of the group, so a hang's
  "wavefront" compares ranks exactly.

The buffer must exist before the process group is made: ``enable()`` sets ``TORCH_FR_BUFFER_SIZE``
(default 2,000 entries) when the job has not set it, from ``fleetscope.agent.init`` and zero-code
activation. Reading costs one pickled dump (≈ 0.4 ms for a few entries, a few ms for a full buffer:
``bench/agent_overhead.py`` reports it) on the sender thread, every ``FR_READ_INTERVAL_S`` at most.
Never raises: an unreadable recorder turns the reader off.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "install",
    "enable",
    "available",
    "dump",
    "FREntry",
    "parse",
    "normalize_op",
    "entry_bytes",
    "GraphCollectives",
    "position_collective",
    "BUFFER_ENV",
    "DEFAULT_BUFFER",
    "FR_READ_INTERVAL_S",
]

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # the older name (torch 2.2-2.5, NCCL only)
DEFAULT_BUFFER = 2000
FR_READ_INTERVAL_S = 2.0
MAX_KEYS = 64  # (op, dim) pairs one event carries
_FINISH_KIND = "__finish__"  # transport._FINISH: the queue item that ends a run

_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "ComplexHalf": 4, "UInt16": 2,
    "UInt32": 4, "UInt64": 8, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1,
    "Float8_e5m2fnuz": 1, "Float8_e8m0fnu": 1,
}  # fmt: skip


def enable(environ: MutableMapping[str, str] | None = None) -> bool:
    """Ask torch to keep a Flight Recorder buffer (before the process group exists): sets
    ``TORCH_FR_BUFFER_SIZE`` to DEFAULT_BUFFER unless the job set it or NCCL's older name,
    or ``FLEETSCOPE_FLIGHT_RECORDER=0``. Returns whether a buffer is asked for."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    if _switched_off(env):
        return False
    for name in (BUFFER_ENV, _NCCL_BUFFER_ENV):
        v = env.get(name)
        if v is not None:
            return v.strip() not in ("", "0")
    env[BUFFER_ENV] = str(DEFAULT_BUFFER)  # torch ≥ 2.6's name (older NCCL builds read _NCCL_BUFFER_ENV)
    return True


def _switched_off(env: Any = None) -> bool:
    """``FLEETSCOPE_FLIGHT_RECORDER=0``: the agent neither asks for the buffer nor reads it."""
    v = (os.environ if env is None else env).get("FLEETSCOPE_FLIGHT_RECORDER", "1")
    return str(v).strip().lower() in ("0", "false", "no", "off")


def _dumpers() -> list[tuple[str, Callable[..., bytes]]]:
    """The recorders this torch can dump: NCCL's own (``_dump_nccl_trace``, CUDA builds: NCCL groups
    record there) and the generic one (``_dump_fr_trace``: gloo and other CPU backends)."""
    import sys

    if "torch" not in sys.modules:
        return []
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        try:
            import torch._C._distributed_c10d  # noqa: F401  # type: ignore[import-not-found,unused-ignore]
        except Exception:  # noqa: BLE001 - a build without distributed
            return []
        c10d = sys.modules.get("torch._C._distributed_c10d")
    out = []
    for src, name in (("nccl", "_dump_nccl_trace"), ("fr", "_dump_fr_trace")):
        fn = getattr(c10d, name, None)
        if fn is not None:
            out.append((src, fn))
    return out


def available() -> bool:
    """Whether this torch can dump a Flight Recorder trace (the buffer may still be off)."""
    return bool(_dumpers())


def dump(only_active: bool = False) -> dict[str, Any] | None:
    """The Flight Recorder's trace (entries without stack traces), or None where there is none.

    NCCL groups record into NCCL's recorder, gloo groups into the generic one: both are read and
    merged. Each entry is tagged with its recorder (``_src``) and ``pg_status`` is keyed
    ``"src:uid"`` (a group with a CPU and a CUDA backend has a status in each)."""
    traces: list[tuple[str, dict[str, Any]]] = []
    for src, fn in _dumpers():
        raw = fn(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
        d = pickle.loads(raw)
        if isinstance(d, dict):
            traces.append((src, d))
    if not traces:
        return None
    out: dict[str, Any] = {"entries": [], "pg_config": {}, "pg_status": {}}
    for src, d in traces:
        for k, v in d.items():
            if k not in out:
                out[k] = v
        for e in d.get("entries") or ():
            if isinstance(e, dict):
                out["entries"].append({**e, "_src": src})
        cfg = d.get("pg_config")
        if isinstance(cfg, dict):
            for k, v in cfg.items():
                out["pg_config"].setdefault(k, v)
        st = d.get("pg_status")
        if isinstance(st, dict):
            for k, v in st.items():
                out["pg_status"][f"{src}:{k}"] = v
    return out


_OPS = (
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"), ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"), ("barrier", "barrier"), ("send", "send"), ("recv", "recv"),
    ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce"),
)  # fmt: skip  # order matters: "reduce_scatter" before "reduce", "allgather" before "gather"


def normalize_op(profiling_name: str) -> str:
    """``nccl:all_reduce`` / ``gloo:_allgather_base`` / ``nccl:send 0->1`` → the wire's op names."""
    name = profiling_name.split(":", 1)[-1].split(" ", 1)[0].lower().lstrip("_")
    for key, op in _OPS:
        if key in name:
            return op
    return "other"


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _tensor_bytes(sizes: Any, dtypes: Any) -> int:
    total = 0
    for i, shape in enumerate(sizes or ()):
        dt = dtypes[i] if dtypes and i < len(dtypes) else "Float"
        total += _numel(shape) * _DTYPE_BYTES.get(str(dt), 4)
    return total


def entry_bytes(op: str, e: dict[str, Any]) -> int:
    """Bytes of one entry by the wire's rule (NCCL-tests' size): all_gather counts its output,
    everything else its input (reduce_scatter and all_to_all: the full per-rank input)."""
    if op == "all_gather":
        return _tensor_bytes(e.get("output_sizes"), e.get("output_dtypes"))
    if op == "barrier":
        return 0
    return _tensor_bytes(e.get("input_sizes"), e.get("input_dtypes"))


@dataclass(frozen=True)
class FREntry:
    record_id: int
    group: str  # the process group's name (its id in pg_config)
    desc: str  # the group's description ("default_pg", "mesh_tp", ...)
    seq: int  # the group's collective (or p2p) sequence number
    op: str
    nbytes: int
    created: float  # wall time, unix seconds
    state: str
    completed: float | None  # wall time, where the backend tracks it
    src: str = ""  # the recorder it came from ("nccl", "fr"; "" for a trace read whole elsewhere)

    @property
    def p2p(self) -> bool:
        return self.op in ("send", "recv")


def parse(trace: dict[str, Any]) -> list[FREntry]:
    """The trace's entries, oldest first (malformed ones skipped)."""
    out: list[FREntry] = []
    for e in trace.get("entries") or ():
        try:
            pg = e.get("process_group") or ("", "")
            op = normalize_op(str(e.get("profiling_name", "")))
            seq = int(e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id") or 0)
            done = e.get("time_discovered_completed_ns")
            out.append(FREntry(int(e.get("record_id", 0)), str(pg[0]), str(pg[1]), seq, op, entry_bytes(op, e),
                               int(e.get("time_created_ns") or 0) / 1e9, str(e.get("state", "")),
                               None if done is None else int(done) / 1e9, str(e.get("_src", ""))))
        except (TypeError, ValueError, AttributeError, IndexError):
            continue
    if len({x.src for x in out}) > 1:  # two recorders, each numbering its own records: by creation time
        out.sort(key=lambda x: (x.created, x.src, x.record_id))
    else:
        out.sort(key=lambda x: x.record_id)
    return out


def _group_dims() -> dict[str, str]:
    """Process-group name → the dimension label the agent's own records use (collectives.py)."""
    try:
        from . import collectives

        return dict(collectives._mesh_dims)
    except Exception:  # noqa: BLE001
        return {}


def dim_of(entry_group: str, desc: str, ranks: str | None, dims: dict[str, str], world: int | None) -> str:
    """The dimension label of an entry's group, as ``collectives.group_label`` names it."""
    dim = dims.get(entry_group)
    if dim:
        return dim
    if desc.startswith("mesh_") and desc != "mesh_default":
        return desc[5:][:48]
    if desc == "default_pg":
        return "world"
    try:
        rs = sorted(int(r) for r in str(ranks).strip("[]").split(",") if r.strip()) if ranks else []
    except ValueError:
        rs = []
    if rs and world is not None and len(rs) == world:
        return "world"
    if len(rs) > 1:
        stride = rs[1] - rs[0]
        if all(b - a == stride for a, b in zip(rs, rs[1:], strict=False)):
            return f"g{len(rs)}s{stride}"
        return f"g{len(rs)}"
    return f"g{len(rs)}"


class GraphCollectives:
    """Per step, the collectives the Flight Recorder saw beyond the agent's own records.

    Fed on the sender thread: ``observe(items)`` with the records each cycle takes (rank_step records
    give each step's wall-time window, collective records the agent's own calls per step), then
    ``poll(now)`` reads the recorder (at most every ``interval_s``) and returns the event to send, if
    any. A step is settled once its record was seen and the recorder was read after its end: its
    recorder entries (by creation time within the step's window) are counted per (op, dim, bytes)
    and the agent's own calls of the same (op, dim, bytes) are subtracted; what remains are
    collectives only the recorder saw."""

    def __init__(self, world_size: int | None = None, interval_s: float = FR_READ_INTERVAL_S,
                 dump_fn: Callable[[], dict[str, Any] | None] = dump) -> None:
        self.world = world_size
        self.interval_s = interval_s
        self._dump = dump_fn
        self._next = 0.0
        self._last_id: dict[str, int] = {}  # per recorder: the newest record id read
        self._entries: list[FREntry] = []  # read, not yet assigned to a step
        self._steps: dict[int, tuple[float, float]] = {}  # step -> (start, end) wall time
        self._own: dict[int, dict[tuple[str, str, int], int]] = {}  # step -> (op, dim, bytes) -> calls
        self._dims: dict[str, str] = {}
        self._cfg: dict[str, Any] = {}
        self._read_wall = 0.0
        self._prev_end: float | None = None  # end of the last settled step
        self.off = False
        self.reads = 0
        self.read_s = 0.0
        self.entries_seen = 0

    def observe(self, items: list[tuple[str, Any]]) -> None:
        """Step windows and the agent's own calls from the records a cycle took."""
        if self.off:
            return
        for kind, rec in items:
            if kind == "rank_step":
                # wire.RANK_STEP_FIELDS: rank, step, step_s, ts, ...
                step, step_s, ts = int(rec[1]), float(rec[2]), float(rec[3])
                if len(self._steps) < 4096:
                    self._steps[step] = (ts, ts + step_s)
            elif kind == "collective":
                # wire.COLLECTIVE_FIELDS: rank, step, seq, op, group_size, bytes, calls, total_s, exposed_s, ts, dim
                step, op, nbytes, calls, dim = int(rec[1]), str(rec[3]), int(rec[5] or 0), int(rec[6] or 1), str(rec[10])
                own = self._own.setdefault(step, {})
                if len(own) < 1024:
                    key = (op, dim, nbytes)
                    own[key] = own.get(key, 0) + calls

    def _read(self) -> None:
        self._read_wall = time.time()  # every entry created before this is in the dump
        t0 = time.perf_counter()
        trace = self._dump()
        self.reads += 1
        self.read_s += time.perf_counter() - t0
        if trace is None:  # no torch.distributed (yet): nothing to read
            return
        self._cfg = trace.get("pg_config") or {}
        self._dims = _group_dims()
        for e in parse(trace):
            if e.record_id > self._last_id.get(e.src, -1):
                self._last_id[e.src] = e.record_id
                self.entries_seen += 1
                if len(self._entries) < 100_000:
                    self._entries.append(e)

    def poll(self, now: float | None = None, force: bool = False) -> dict[str, Any] | None:
        """Read the recorder when due; the ``graph_collectives`` event data of the steps it settled
        ({"steps": [first, last], "calls": n, "by": [{"op", "dim", "calls", "bytes"}]}), or None."""
        if self.off:
            return None
        t = time.monotonic() if now is None else now
        if t < self._next and not force:
            return None
        self._next = t + self.interval_s
        try:
            self._read()
        except Exception as e:  # noqa: BLE001 - an unreadable recorder: off, the agent's own records stay
            log.debug("fleetscope: flight recorder unreadable (%r)", e)
            self.off = True
            return None
        if self.off or not self._steps:
            return None
        return self._settle()

    def _settle(self) -> dict[str, Any] | None:
        ready = sorted(s for s, (_, end) in self._steps.items() if end <= self._read_wall)
        if not ready:
            return None
        by: dict[tuple[str, str], list[int]] = {}
        keep: list[FREntry] = []
        # a step's window runs from the previous step's end to its own end: a collective between two
        # steps belongs to the next one, as the agent's own records put it (collective_marks.gap_call)
        windows = []
        for s in ready:
            start, end = self._steps[s]
            lo = start if self._prev_end is None else min(start, self._prev_end)
            windows.append((lo, end, s))
            self._prev_end = end
        last_end = max(w[1] for w in windows)
        per_step: dict[int, dict[tuple[str, str, int], int]] = {}
        for e in self._entries:
            if e.created > last_end:
                keep.append(e)
                continue
            for start, end, s in windows:
                if start < e.created <= end or (start == e.created and s == windows[0][2]):
                    cfg = self._cfg.get(e.group) or {}
                    dim = dim_of(e.group, e.desc or str(cfg.get("desc", "")), cfg.get("ranks"), self._dims, self.world)
                    d = per_step.setdefault(s, {})
                    key = (e.op, dim, e.nbytes)
                    d[key] = d.get(key, 0) + 1
                    break
        self._entries = keep
        total = 0
        for s in ready:
            own = self._own.pop(s, {})
            for key, n in per_step.get(s, {}).items():
                extra = n - own.get(key, 0)
                if extra > 0:
                    op, dim, nbytes = key
                    if (op, dim) in by or len(by) < MAX_KEYS:
                        acc = by.setdefault((op, dim), [0, 0])
                        acc[0] += extra
                        acc[1] += extra * nbytes
                    total += extra
            del self._steps[s]
        for s in [s for s in self._own if s < ready[0]]:  # calls of steps never seen (aborted)
            del self._own[s]
        if not total:
            return None
        return {"steps": [ready[0], ready[-1]], "calls": total,
                "by": [{"op": op, "dim": dim, "calls": c, "bytes": b} for (op, dim), (c, b) in sorted(by.items())]}


def position_collective(run: Any = None) -> dict[str, Any] | None:
    """The collective this rank is blocked in (a group whose last enqueued collective is past its
    last completed one; the oldest such), else the last one it issued: ``{"op", "dim", "group",
    "seq", "bytes", "since_s", "done"}`` with the group's own sequence number. None without a
    recorder or entries."""
    if _switched_off():
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None  # the recorder outlives destroyed groups: no group now, no position in one
    trace = dump()
    if not trace:
        return None
    entries = parse(trace)
    if not entries:
        return None
    status = trace.get("pg_status") or {}
    cfg = trace.get("pg_config") or {}
    dims = _group_dims()
    world = getattr(run, "world_size", None)
    now = time.time()
    newest: dict[tuple[str, str], FREntry] = {}
    for x in entries:
        if not x.p2p:
            newest[(x.src, x.group)] = x
    pending: FREntry | None = None
    for key, st in status.items():
        src, _, name = str(key).rpartition(":")  # dump() keys "src:uid"
        try:
            enq = int(st.get("last_enqueued_collective", -1))
            comp = int(st.get("last_completed_collective", -1))
        except (TypeError, ValueError, AttributeError):
            continue
        last = newest.get((src, name))
        if last is None or last.seq != enq:
            # the status of a destroyed group: the recorder keys status by a uid that a re-created group
            # does not reuse, while its entries reuse the name (a job that re-initialises its groups)
            continue
        if enq > comp:
            # the newest entry with that number: a destroyed group of the same name left older ones
            cand = [e for e in entries if e.src == src and e.group == name and not e.p2p and e.seq == comp + 1]
            if cand and (pending is None or cand[-1].created < pending.created):
                pending = cand[-1]
    e = pending or entries[-1]
    c = cfg.get(e.group) or {}
    return {"op": e.op, "dim": dim_of(e.group, e.desc or str(c.get("desc", "")), c.get("ranks"), dims, world),
            "group": e.group, "seq": e.seq, "bytes": e.nbytes,
            "since_s": max(0.0, now - e.created) if e.created else 0.0, "done": pending is None}


def install(run: Any, transport: Any, make_event: Callable[..., dict[str, Any]]) -> GraphCollectives | None:
    """Count ``run``'s graph collectives on ``transport``'s sender thread: chained after whatever
    ``transport.observe`` already does (health.py), a ``graph_collectives`` event per settled batch of
    steps, made by ``make_event(run, kind, step, data)`` (health.event: a seq off the training thread's). None where the transport has no sender-thread hook or the recorder is switched off."""
    if not hasattr(transport, "observe") or _switched_off():
        return None
    gc = GraphCollectives(getattr(run, "world_size", None))
    prev = transport.observe

    def observe(items: list[tuple[str, Any]]) -> None:
        if prev is not None:
            prev(items)
        if gc.off:
            return
        try:
            gc.observe(items)
            stop = getattr(transport, "_stop", None)
            closing = stop is not None and stop.is_set()  # the last cycles: settle every step seen
            data = gc.poll(force=closing)
            if data is not None:
                # into the records this cycle delivers (before a finish marker, which ends a batch)
                rec = ("event", make_event(run, "graph_collectives", int(data["steps"][1]), data))
                at = len(items) - 1 if items and items[-1][0] == _FINISH_KIND else len(items)
                items.insert(at, rec)
        except Exception as e:  # noqa: BLE001 - the recorder is an extra: off, never in the way
            log.debug("fleetscope: graph collectives off (%r)", e)
            gc.off = True

    transport.observe = observe
    return gc
