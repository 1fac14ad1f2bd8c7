"""Per-step memory samples: the CUDA caching allocator's counters on GPU, resident set size on CPU.

One sample per step, taken at the step's end on the training thread, from host-side counters only
(no device synchronisation). The sample is the 4-tuple of the rank-step columns
``(mem_allocated_bytes, mem_reserved_bytes, mem_peak_bytes, alloc_retries)``; ``None`` = not measured.
"""

from __future__ import annotations

import os
from typing import Any

from .protocols import MemSample

__all__ = ["RssSampler", "CudaMemorySampler", "NullSampler", "make_sampler"]

_NONE4: MemSample = (None, None, None, None)


class NullSampler:
    """Memory not sampled."""

    min_interval_ns = 0

    def sample(self) -> MemSample:
        return _NONE4

    def close(self) -> None:
        return None


class RssSampler:
    """Resident set size from ``/proc/self/statm`` through one ``pread`` on a kept descriptor.

    A read is a 2-4 µs syscall on a VM, more than the rest of a step's bookkeeping, and RSS moves
    slowly: the caller reads at most once per ``min_interval_ns`` (default 100 ms) and reports the last
    reading in between (``Run._end`` compares the step's end mark, so the check costs no clock read).
    psutil is not needed. The descriptor is reopened after ``fork`` (``/proc/self`` was resolved to the
    parent's pid at open). Where ``/proc`` does not exist (macOS) RSS is not measured.
    """

    def __init__(self, min_interval_s: float = 0.1) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._fd: int | None = None
        self._pid = -1
        self.min_interval_ns = int(min_interval_s * 1e9)

    def _open(self) -> int | None:
        self.close()
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._pid = os.getpid()
        return self._fd

    def sample(self) -> MemSample:
        fd = self._fd
        if fd is None or self._pid != os.getpid():
            fd = self._open()
            if fd is None:
                return _NONE4
        try:
            raw = os.pread(fd, 128, 0)
            return (int(raw.split(None, 2)[1]) * self._page, None, None, None)
        except (OSError, ValueError, IndexError):
            return _NONE4

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class CudaMemorySampler:
    """Caching-allocator counters of the current CUDA device, peak reset every sample.

    ``mem_peak_bytes`` is the allocator's peak since the previous sample (``reset_peak_memory_stats``
    after reading it); ``alloc_retries`` is the delta of ``num_alloc_retries`` since then.
    """

    min_interval_ns = 0  # every step (memory_every_steps thins it)

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._last_retries: int | None = None
        try:  # baseline at the first step's start: step 0 then reports its own peak and retries
            self._last_retries = cuda.memory_stats().get("num_alloc_retries")
            cuda.reset_peak_memory_stats()
        except Exception:  # noqa: BLE001 - no allocator stats: the first sample is the baseline
            pass

    def sample(self) -> MemSample:
        cuda = self._cuda
        stats = cuda.memory_stats()
        allocated = stats.get("allocated_bytes.all.current")
        reserved = stats.get("reserved_bytes.all.current")
        peak = stats.get("allocated_bytes.all.peak")
        retries = stats.get("num_alloc_retries")
        cuda.reset_peak_memory_stats()
        delta = None
        if retries is not None:
            delta = retries - self._last_retries if self._last_retries is not None else retries
            if delta < 0:  # the script reset the allocator's counters: unknown for this step
                delta = None
            self._last_retries = retries
        return (allocated, reserved, peak, delta)

    def close(self) -> None:
        return None


def make_sampler(kind: str) -> NullSampler | RssSampler | CudaMemorySampler:
    """``"cuda"``, ``"cpu"`` (RSS) or ``"none"``."""
    if kind == "cuda":
        return CudaMemorySampler()
    if kind == "cpu":
        return RssSampler()
    return NullSampler()
