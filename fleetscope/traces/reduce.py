"""Reduce a set of per-rank trace files (a directory or files) to per-rank summaries plus the
cross-rank figures (kernel-type totals, late-start stragglers)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from .analysis import CONSECUTIVE_KERNEL_DELAY_US, RankResult, StragglerInput, analyze_rank, np_round
from .errors import TraceError
from .parse import DEFAULT_MAX_GPU_EVENTS, RankTrace, parse_trace
from .stragglers import late_start_stragglers

__all__ = ["find_trace_files", "reduce_traces", "reduce_trace", "TraceSet"]

log = logging.getLogger(__name__)

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def find_trace_files(path: str | os.PathLike[str]) -> list[str]:
    """A file, or the ``.json``/``.json.gz`` files of a directory (not recursive), sorted."""
    p = os.fspath(path)
    if os.path.isdir(p):
        files = sorted(
            os.path.join(p, f)
            for f in os.listdir(p)
            if f.endswith((".json", ".json.gz", ".gz")) and os.path.isfile(os.path.join(p, f))
        )
        if not files:
            raise TraceError(
                os.path.basename(p.rstrip("/")) or p, "no .json or .json.gz trace files in this directory"
            )
        return files
    if not os.path.exists(p):
        raise TraceError(os.path.basename(p) or p, "no such file or directory")
    return [p]


def reduce_trace(
    path: str | os.PathLike[str],
    *,
    rank: int | None = None,
    include_last_step: bool = False,
    num_kernels: int = 10,
    max_gpu_events: int = DEFAULT_MAX_GPU_EVENTS,
) -> dict[str, Any]:
    """One file → its per-rank summary (the agent's path: a single rank, no cross-rank figures)."""
    rt = parse_trace(path, max_gpu_events=max_gpu_events)
    r = rank if rank is not None else (rt.rank if rt.rank is not None and rt.rank >= 0 else 0)
    return analyze_rank(
        rt,
        rank=r,
        filter_on=len(rt.step_names) >= 2,
        include_last_step=include_last_step,
        num_kernels=num_kernels,
    ).summary


def _files(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return find_trace_files(paths)
    return [f for p in paths for f in find_trace_files(p)]


class _Ranks:
    """Rank of each file: ``distributedInfo.rank``, else ``rank<N>`` in the file name, else the
    smallest number not taken yet; two files claiming one rank are an error."""

    def __init__(self) -> None:
        self.claimed: dict[int, str] = {}

    def assign(self, rt: RankTrace) -> int:
        if rt.rank is not None and rt.rank >= 0:
            rank = rt.rank
        elif m := _RANK_IN_NAME.search(rt.source):
            rank = int(m.group(1))
        else:
            rank = 0
            while rank in self.claimed:
                rank += 1
        if rank in self.claimed:
            raise TraceError(rt.source, f"rank {rank} is also claimed by {self.claimed[rank]}")
        self.claimed[rank] = rt.source
        return rank


def reduce_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    include_last_step: bool = False,
    num_kernels: int = 10,
    num_candidates: int = 1,
    consecutive_kernel_delay: float = CONSECUTIVE_KERNEL_DELAY_US,
    max_gpu_events: int = DEFAULT_MAX_GPU_EVENTS,
) -> dict[str, Any]:
    """Per-rank summaries of a directory (or list) of trace files, one file per rank, as HTA's
    ``TraceAnalysis(trace_dir=...)`` sees them, plus kernel-type totals and late-start stragglers.

    Files are parsed one after the other and each rank's columns are dropped once it is analysed,
    so memory holds one rank's columns at a time (plus small per-rank results)."""
    files = _files(paths)
    multi = len(files) > 1
    opts: dict[str, Any] = {
        "include_last_step": include_last_step,
        "num_kernels": num_kernels,
        "consecutive_kernel_delay": consecutive_kernel_delay,
        "with_straggler_input": multi,
    }
    done: dict[int, RankResult] = {}
    deferred: list[tuple[int, RankTrace]] = []
    ranks = _Ranks()
    step_names: set[str] = set()
    for f in files:
        rt = parse_trace(f, with_windows=multi, max_gpu_events=max_gpu_events)
        rank = ranks.assign(rt)
        step_names |= rt.step_names
        if len(rt.step_names) >= 2:
            # HTA filters when its symbol table (all ranks) holds >= 2 ProfilerStep names: settled
            # already, so this rank's columns can go now
            done[rank] = analyze_rank(rt, rank=rank, filter_on=True, **opts)
        else:
            deferred.append((rank, rt))
    for rank, rt in deferred:
        done[rank] = analyze_rank(rt, rank=rank, filter_on=len(step_names) >= 2, **opts)
    return _assemble(done, include_last_step=include_last_step, num_candidates=num_candidates)


class TraceSet:
    """Parsed traces kept in memory, to be analysed several ways (e.g. both last-step modes) without
    parsing twice: ``TraceSet(dir).reduce(include_last_step=True)``."""

    def __init__(
        self,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        max_gpu_events: int = DEFAULT_MAX_GPU_EVENTS,
    ) -> None:
        files = _files(paths)
        ranks = _Ranks()
        self.traces: list[tuple[int, RankTrace]] = []
        for f in files:
            rt = parse_trace(f, with_windows=len(files) > 1, max_gpu_events=max_gpu_events)
            self.traces.append((ranks.assign(rt), rt))
        self.filter_on = len(set().union(*(rt.step_names for _, rt in self.traces))) >= 2

    def reduce(
        self,
        *,
        include_last_step: bool = False,
        num_kernels: int = 10,
        num_candidates: int = 1,
        consecutive_kernel_delay: float = CONSECUTIVE_KERNEL_DELAY_US,
    ) -> dict[str, Any]:
        """Same result as ``reduce_traces`` on the same files."""
        done = {
            rank: analyze_rank(
                rt,
                rank=rank,
                filter_on=self.filter_on,
                include_last_step=include_last_step,
                num_kernels=num_kernels,
                consecutive_kernel_delay=consecutive_kernel_delay,
                with_straggler_input=len(self.traces) > 1,
            )
            for rank, rt in self.traces
        }
        return _assemble(done, include_last_step=include_last_step, num_candidates=num_candidates)


def _assemble(done: dict[int, RankResult], *, include_last_step: bool, num_candidates: int) -> dict[str, Any]:
    ranks = sorted(done)
    totals: dict[str, float] = {}
    for r in ranks:
        for key, v in done[r].kernel_type_us.items():
            totals[key] = totals.get(key, 0) + v
    grand = sum(totals.values())
    kernel_types = [
        {"kernel_type": key, "time_us": v, "percentage": np_round((v / grand) * 100, 1) if grand else None}
        for key, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    result: dict[str, Any] = {
        "include_last_step": include_last_step,
        "files": [{"source": done[r].summary["source"], "rank": r} for r in ranks],
        "ranks": {str(r): done[r].summary for r in ranks},
        "kernel_types": kernel_types,
    }
    inputs: list[StragglerInput] = [s for r in ranks if (s := done[r].straggler) is not None]
    if len(inputs) >= 2:
        result["stragglers"] = {
            "hta": late_start_stragglers(inputs, num_candidates=num_candidates),
            "corrected": late_start_stragglers(inputs, num_candidates=num_candidates, corrected=True),
        }
    else:
        result["stragglers"] = {"error": "late-start straggler detection needs traces of >= 2 ranks"}
    return result
