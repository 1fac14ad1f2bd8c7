"""Reduce the event stream of one Kineto / Chrome trace file (``.json`` or ``.json.gz``) to compact columns.

Memory is bounded by what the figures need, not by the file: events arrive one at a time
(``jsonstream``), and only a few numbers of the events that matter are kept, in ``array`` columns:

* GPU events (``stream >= 0 and correlation >= 0``, plus "Event Sync"/"Context Sync"), and any other
  event carrying a stream: ts, dur, stream, correlation, interned name, 3 flag bits (~41 B each);
* CPU events with a correlation id (runtime launches): correlation and ts (16 B each);
* ProfilerStep events, data-loader intervals and, for CPU-only traces, the union of CPU ops.

CPU operators, flow events, ``args`` payloads and metadata are dropped as they stream past.
Timestamps are kept raw (float64) and rounded later, because HTA decides per file whether to round
(``ceil(ts)``, ``floor(ts + dur)``): only when any event's ``ts`` is a float (or missing).
"""

from __future__ import annotations

import logging
import math
import os
from array import array
from dataclasses import dataclass, field
from typing import Any

from . import jsonstream
from .classify import ITER_NAME_RE, STEP_NAME_RE
from .errors import TraceError
from .intervals import IntervalSet

__all__ = ["RankTrace", "StepWindows", "parse_trace", "DEFAULT_MAX_GPU_EVENTS"]

log = logging.getLogger(__name__)

DEFAULT_MAX_GPU_EVENTS = 5_000_000  # ~1.3 GiB at peak (~0.26 KiB each); beyond that the caller opts in

# flag bits of the GPU-event columns
F_KERNEL_CAT = 1  # cat is a kernel/memcpy/memset category (idle-time breakdown; cuda_sync excluded)
F_CPU_CLASS = 2  # HTA classifies it as a CPU event (kept by the ts rule, not by correlation)
F_CPU_OP = 4  # cat == "cpu_op"

_KERNEL_CATS = frozenset(
    ("kernel", "Kernel", "gpu_memset", "Memset", "gpu_memcpy", "Memcpy", "mtia_ccp_events")
)
_SYNC_NAMES = frozenset(("Event Sync", "Context Sync"))
_GPU_LIKE_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
_DATALOADER_PREFIX = "enumerate(DataLoader)"
_CPU_COMM_PREFIXES = ("nccl:", "gloo:", "c10d::", "record_param_comms", "ProcessGroup", "torch.distributed")


class StepWindows:
    """Per ProfilerStep, the earliest start and latest end of the CPU events HTA assigns to it
    (``step.ts <= e.ts < step.end``, last matching step in file order wins), computed online.

    Events that fall in no step seen so far wait in a small buffer until a step claims them. Only the
    straggler analysis uses this (its mean iteration time), and only with several ranks.
    """

    __slots__ = ("steps", "agg", "_buf_ts", "_buf_end", "_last", "overlapping")

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []  # (iteration, ts, end) in file order
        self.agg: list[list[float]] = []  # per step [min_ts, max_end]
        self._buf_ts = array("d")
        self._buf_end = array("d")
        self._last = -1
        self.overlapping = False

    def add_step(self, iteration: int, ts: float, end: float) -> None:
        for _, s, e in self.steps:
            if s < end and ts < e:
                self.overlapping = True  # earlier assignments may be off; reported, not fatal
        self.steps.append((iteration, ts, end))
        agg = [math.inf, -math.inf]
        self.agg.append(agg)
        keep_ts = array("d")
        keep_end = array("d")
        for t, en in zip(self._buf_ts, self._buf_end, strict=True):
            if ts <= t < end:
                if t < agg[0]:
                    agg[0] = t
                if en > agg[1]:
                    agg[1] = en
            else:
                keep_ts.append(t)
                keep_end.append(en)
        self._buf_ts, self._buf_end = keep_ts, keep_end

    def add(self, t: float, end: float) -> None:
        k = self._last
        if k >= 0:
            _, s, e = self.steps[k]
            if not (s <= t < e):
                k = -1
        if k < 0:
            for i in range(len(self.steps) - 1, -1, -1):
                _, s, e = self.steps[i]
                if s <= t < e:
                    k = i
                    break
        if k < 0:
            self._buf_ts.append(t)
            self._buf_end.append(end)
            return
        self._last = k
        agg = self.agg[k]
        if t < agg[0]:
            agg[0] = t
        if end > agg[1]:
            agg[1] = end

    def by_iteration(self) -> dict[int, tuple[float, float]]:
        out: dict[int, tuple[float, float]] = {}
        for (it, _, _), (lo, hi) in zip(self.steps, self.agg, strict=True):
            if lo > hi:
                continue
            if it in out:
                plo, phi = out[it]
                out[it] = (min(plo, lo), max(phi, hi))
            else:
                out[it] = (lo, hi)
        return out


@dataclass
class RankTrace:
    """What one trace file contributes: compact columns plus a few small sets (see module doc)."""

    source: str
    path: str
    rank: int | None = None
    world_size: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    kept_events: int = 0
    round_ts: bool = False
    # GPU events and other events with a stream
    g_ts: array = field(default_factory=lambda: array("d"))
    g_dur: array = field(default_factory=lambda: array("d"))
    g_stream: array = field(default_factory=lambda: array("q"))
    g_corr: array = field(default_factory=lambda: array("q"))
    g_name: array = field(default_factory=lambda: array("i"))
    g_flags: array = field(default_factory=lambda: array("B"))
    names: list[str] = field(default_factory=list)
    # CPU events with a correlation id
    c_corr: array = field(default_factory=lambda: array("q"))
    c_ts: array = field(default_factory=lambda: array("d"))
    c_iter_ok: array = field(default_factory=lambda: array("B"))  # its iteration comes from its ts
    # ProfilerStep events: (name, ts, dur, cpu_classified)
    steps: list[tuple[str, float, float, bool]] = field(default_factory=list)
    step_names: set[str] = field(default_factory=set)
    cpu_count: int = 0
    cpu_min_ts: float = math.inf  # over CPU-classified events (rounded)
    cpu_max_end: float = -math.inf
    cpu_nocorr_min_ts: float = math.inf  # CPU events with correlation -1 (they "match" sync events)
    first_event_ts: float | None = None  # ts of raw event #0 if HTA keeps it (its index_correlation quirk)
    gpu_like_without_stream: int = 0
    dataloader: IntervalSet = field(default_factory=IntervalSet)
    cpu_ops: IntervalSet | None = field(default_factory=IntervalSet)  # dropped once a GPU event shows up
    cpu_comm: IntervalSet = field(default_factory=IntervalSet)
    windows: StepWindows | None = None

    @property
    def gpu_events(self) -> int:
        return len(self.g_ts)


def _as_int(v: Any, default: int) -> int:
    """pandas ``to_numeric(errors="coerce")`` then ``astype(int)`` on one value."""
    if type(v) is int:
        return v
    if v is None or isinstance(v, bool):
        return default if v is None else int(v)
    if isinstance(v, float):
        return int(v) if math.isfinite(v) else default
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return default
        return int(f) if math.isfinite(f) else default
    try:
        return int(v)  # Decimal
    except (TypeError, ValueError):
        return default


def parse_trace(
    path: str | os.PathLike[str],
    *,
    source: str | None = None,
    with_windows: bool = False,
    max_gpu_events: int = DEFAULT_MAX_GPU_EVENTS,
) -> RankTrace:
    """Stream one trace file into a ``RankTrace``; raises ``TraceError`` naming the file and the problem."""
    path = os.fspath(path)
    source = source or os.path.basename(path)
    rt = RankTrace(source=source, path=path)
    if with_windows:
        rt.windows = StepWindows()
    meta = jsonstream.stream_events(path, source, lambda events: _consume(rt, events, max_gpu_events))
    rt.meta = meta
    rank = meta.get("distributedInfo.rank")
    rt.rank = _as_int(rank, -1) if rank is not None else None
    ws = meta.get("distributedInfo.world_size")
    rt.world_size = _as_int(ws, -1) if ws is not None else None
    if rt.kept_events == 0:
        raise TraceError(source, f"no trace events with 'cat' and 'dur' among {rt.events} events")
    if rt.gpu_like_without_stream and not rt.g_ts:
        raise TraceError(
            source,
            f"{rt.gpu_like_without_stream} GPU events (cat kernel/gpu_memcpy/gpu_memset) and none has "
            "args.stream: they cannot be placed on a GPU stream",
        )
    return rt


def _consume(rt: RankTrace, events: Any, max_gpu_events: int) -> None:  # noqa: C901 - the hot loop, kept flat
    source = rt.source
    ceil, floor = math.ceil, math.floor
    g_ts, g_dur, g_stream, g_corr, g_name, g_flags = (
        rt.g_ts,
        rt.g_dur,
        rt.g_stream,
        rt.g_corr,
        rt.g_name,
        rt.g_flags,
    )
    c_corr, c_ts, c_iter_ok = rt.c_corr, rt.c_ts, rt.c_iter_ok
    name_ids: dict[str, int] = {}
    names = rt.names
    windows = rt.windows
    dataloader = rt.dataloader
    cpu_comm = rt.cpu_comm
    cpu_ops = rt.cpu_ops
    kernel_cats, sync_names, gpu_like = _KERNEL_CATS, _SYNC_NAMES, _GPU_LIKE_CATS
    step_match = STEP_NAME_RE.match
    comm_prefixes = _CPU_COMM_PREFIXES
    round_ts = False
    n = 0
    kept = 0
    cpu_count = 0
    cpu_min = math.inf
    cpu_max = -math.inf
    nocorr_min = math.inf
    no_stream = 0
    for e in events:
        n += 1
        if type(e) is not dict:
            raise TraceError(source, f"traceEvents[{n - 1}] is a {type(e).__name__}, not an object")
        ts: Any = e.get("ts")
        tts = type(ts)
        if tts is float:
            round_ts = True
        elif ts is None:
            round_ts = True  # pandas turns the column into float64 (NaN): HTA rounds the file
        dur = e.get("dur")
        cat = e.get("cat")
        if dur is None or cat is None:
            if dur is None and e.get("ph") == "X":
                raise TraceError(
                    source, f"traceEvents[{n - 1}] ({e.get('name')!r}) is a complete event without 'dur'"
                )
            continue  # metadata, flow and instant events: HTA drops them too
        if cat == "Trace":
            continue
        tdur = type(dur)
        if (tts is not int and tts is not float) or (tdur is not int and tdur is not float):
            if ts is None:
                raise TraceError(source, f"traceEvents[{n - 1}] ({e.get('name')!r}) has 'dur' but no 'ts'")
            raise TraceError(
                source,
                f"traceEvents[{n - 1}] ({e.get('name')!r}) has non-numeric ts/dur: {ts!r}/{dur!r}",
            )
        kept += 1
        name = e.get("name")
        if type(name) is not str:
            name = "" if name is None else str(name)
        args = e.get("args")
        if type(args) is dict:
            stream = args.get("stream", -1)
            if type(stream) is not int:
                stream = _as_int(stream, -1)
            corr = args.get("correlation", -1)
            if type(corr) is not int:
                corr = _as_int(corr, -1)
        else:
            stream = -1
            corr = -1
        if n == 1:
            rt.first_event_ts = float(ts)  # rounded later if needed
        gpu = (stream >= 0 and corr >= 0) or (name.endswith(" Sync") and name in sync_names)
        if gpu or stream != -1:
            if len(g_ts) >= max_gpu_events:
                raise TraceError(
                    source,
                    f"more than {max_gpu_events:,} GPU events: too large for the configured bound "
                    "(pass a larger max_gpu_events; each costs ~0.26 KiB at peak)",
                )
            g_ts.append(ts)
            g_dur.append(dur)
            g_stream.append(stream)
            g_corr.append(corr)
            nid = name_ids.get(name)
            if nid is None:
                nid = name_ids[name] = len(names)
                names.append(name)
            g_name.append(nid)
            flags = (F_KERNEL_CAT if cat in kernel_cats else 0) | (0 if gpu else F_CPU_CLASS)
            if cat == "cpu_op":
                flags |= F_CPU_OP
            g_flags.append(flags)
            if cpu_ops is not None and gpu and stream >= 0:
                cpu_ops = rt.cpu_ops = None  # a GPU trace: the CPU-timeline decomposition is not needed
            if gpu:
                if name.startswith("ProfilerStep") and step_match(name):
                    rt.step_names.add(name)  # in HTA's symbol table all the same
                continue
        elif cat in gpu_like:
            no_stream += 1
        # a CPU event (HTA's CPUOperatorFilter)
        cpu_count += 1
        if tts is float:
            t0 = ceil(ts)
            t1 = floor(ts + dur)
        else:
            t0 = ts
            t1 = ts + dur
        if t0 < cpu_min:
            cpu_min = t0
        if t1 > cpu_max:
            cpu_max = t1
        if corr != -1:
            c_corr.append(corr)
            c_ts.append(ts)
            c_iter_ok.append(1 if stream < 0 or (stream == 0 and cat == "cpu_op") else 0)
        elif t0 < nocorr_min:
            nocorr_min = t0
        if name.startswith("ProfilerStep") and step_match(name):
            rt.steps.append((name, float(ts), float(dur), True))
            rt.step_names.add(name)
            if windows is not None:
                m = ITER_NAME_RE.match(name)
                if m:
                    windows.add_step(int(m.group(1)), t0, t1)
        if windows is not None and (stream < 0 or (stream == 0 and cat == "cpu_op")):
            windows.add(t0, t1)
        if cat == "cpu_op":
            if cpu_ops is not None:
                cpu_ops.add(t0, t1)
            if name.startswith(comm_prefixes):
                cpu_comm.add(t0, t1)
        elif cat == "user_annotation":
            if name.startswith(_DATALOADER_PREFIX):
                dataloader.add(t0, t1)
            elif name.startswith(comm_prefixes):
                cpu_comm.add(t0, t1)
    if n == 0:
        raise TraceError(source, "the traceEvents array is empty")
    rt.events = n
    rt.kept_events = kept
    rt.round_ts = round_ts
    rt.cpu_count = cpu_count
    rt.cpu_min_ts = cpu_min
    rt.cpu_max_end = cpu_max
    rt.cpu_nocorr_min_ts = nocorr_min
    rt.gpu_like_without_stream = no_stream
