"""Per-step memory samples: the CUDA caching allocator's counters on GPU, resident set size on CPU.

One sample per step, taken at the step's end on the training thread, from host-side counters only
(no device synchronisation). The sample is the 4-tuple of the rank-step columns
``(mem_allocated_bytes, mem_reserved_bytes, mem_peak_bytes, alloc_retries)``; ``None`` = not measured.

The job's own counters are never reset: a script that reads ``torch.cuda.max_memory_allocated()``
(or calls ``reset_peak_memory_stats`` itself) sees exactly what it would see without the agent. The
peak of a step is the allocator's cumulative high-water mark as the job sees it (``PeakTracker``):
exact on a step during which the mark rose, otherwise an upper bound of the step's own peak. Each
sampler also keeps the rank's figures for the whole run (peaks, allocator retries, OOMs) and hands
them, rarely, to ``emit`` as the data of a ``memory`` event (docs/agent.md, "Memory").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .protocols import MemSample

__all__ = ["RssSampler", "CudaMemorySampler", "NullSampler", "PeakTracker", "make_sampler", "FIRST_LOOK", "EMIT_EVERY"]

_NONE4: MemSample = (None, None, None, None)

FIRST_LOOK = 10
"""The sample at which the rank's run figures are first looked at (past the first steps' warm-up)."""
EMIT_EVERY = 640
"""Samples between two looks at whether the rank's ``memory`` event changed, after a doubling start
(samples 10, 20, 40, … 640, then every 640); an event is sent only when a peak grew by more than 1 %
or retries/OOMs rose (the first look always sends), and once more at finish when anything changed."""

Emit = Callable[[dict[str, Any]], None]


class NullSampler:
    """Memory not sampled."""

    min_interval_ns = 0

    def sample(self) -> MemSample:
        return _NONE4

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


class PeakTracker:
    """The peak of each window between two samples, from a cumulative high-water mark that is never
    reset (the allocator's ``allocated_bytes.all.peak`` = ``torch.cuda.max_memory_allocated()``, the
    process's ``ru_maxrss``).

    ``window(mark, current)`` returns ``(peak, exact)``. The peak is the mark as read: when the mark rose
    since the previous sample, the window's own peak *is* the mark (``exact``); otherwise the window's
    peak lies between the larger ``current`` at its two ends and the mark, and the mark is returned, an
    upper bound — equal to the window's peak in a steady loop whose steps peak alike, sticky after a
    one-off spike (a lower bound would miss every steady step's activations: it sees only the step's
    ends). A job that resets the mark itself is followed (the mark went down: the peak since its reset).
    Without a mark (an allocator without the stat) the larger current of the two ends, a lower bound.
    ``run_peak`` is the largest peak; ``run_exact``: the mark rose during the run (else the run's peak
    may be one set before the run, when the sampler was made).
    """

    __slots__ = ("mark", "current", "run_peak", "run_exact")

    def __init__(self, mark: int | None, current: int | None) -> None:
        self.mark = mark
        self.current = current
        self.run_peak: int | None = None
        self.run_exact = False

    def window(self, mark: int | None, current: int | None) -> tuple[int | None, bool]:
        prev_mark, prev_cur = self.mark, self.current
        self.mark, self.current = mark, current
        exact = False
        peak: int | None
        if mark is not None:
            # never below the current value (the kernel's RSS counters drift by a few pages between the two)
            peak = mark if current is None or mark >= current else current
            exact = prev_mark is not None and mark > prev_mark
        else:
            peak = None
            for v in (prev_cur, current):
                if v is not None and (peak is None or v > peak):
                    peak = v
        if peak is not None and (self.run_peak is None or peak > self.run_peak):
            self.run_peak = peak
        self.run_exact = self.run_exact or exact
        return peak, exact


class _RunFigures:
    """When to hand the rank's run figures to ``emit``: at doubling sample counts from ``FIRST_LOOK``,
    then every ``EMIT_EVERY``, and only when they changed enough; at ``finish`` when anything changed."""

    __slots__ = ("emit", "n", "next_look", "sent")

    def __init__(self, emit: Emit | None) -> None:
        self.emit = emit
        self.n = 0
        self.next_look = FIRST_LOOK
        self.sent: dict[str, Any] | None = None

    def tick(self, data: Callable[[], dict[str, Any]]) -> None:
        self.n += 1
        if self.emit is None or self.n < self.next_look:
            return
        self.next_look = self.n + min(self.n, EMIT_EVERY)
        self._send(data(), final=False)

    def finish(self, data: Callable[[], dict[str, Any]]) -> None:
        if self.emit is not None and self.n:
            self._send(data(), final=True)

    def _send(self, d: dict[str, Any], final: bool) -> None:
        old = self.sent
        if old is not None and not _changed(old, d) and not (final and old.get("samples") != d.get("samples")):
            return
        self.sent = d
        assert self.emit is not None
        self.emit(d)


def _changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
        a, b = old.get(k), new.get(k)
        if b is not None and (a is None or b > a * 1.01):
            return True
    return any((new.get(k) or 0) > (old.get(k) or 0) for k in ("alloc_retries", "ooms"))


def _maxrss_bytes() -> int | None:
    """The process's peak resident set size (``getrusage``; KiB on Linux), None where unavailable."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # noqa: BLE001 - no resource module (Windows)
        return None


class RssSampler:
    """Resident set size from ``/proc/self/statm`` through one ``pread`` on a kept descriptor.

    A read is a 2-4 µs syscall on a VM, more than the rest of a step's bookkeeping, and RSS moves
    slowly: the caller reads at most once per ``min_interval_ns`` (default 100 ms) and reports the last
    reading in between (``Run._end`` compares the step's end mark, so the check costs no clock read).
    psutil is not needed. The descriptor is reopened after ``fork`` (``/proc/self`` was resolved to the
    parent's pid at open). Where ``/proc`` does not exist (macOS) RSS is not measured.

    ``mem_peak_bytes`` is the process's peak RSS (``ru_maxrss``, ``PeakTracker``): the peak since the
    previous reading when it rose since then (exact to the KiB), else an upper bound of it.
    Reserved memory and allocator retries do not exist here (``None``).
    """

    def __init__(self, min_interval_s: float = 0.1, emit: Emit | None = None) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._fd: int | None = None
        self._pid = -1
        self.min_interval_ns = int(min_interval_s * 1e9)
        self._peak = PeakTracker(_maxrss_bytes(), None)
        self._run = _RunFigures(emit)
        self._last: int | None = None

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
            rss = int(raw.split(None, 2)[1]) * self._page
        except (OSError, ValueError, IndexError):
            return _NONE4
        peak, _exact = self._peak.window(_maxrss_bytes(), rss)
        self._last = rss
        self._run.tick(self._figures)
        return (rss, None, peak, None)

    def _figures(self) -> dict[str, Any]:
        p = self._peak
        return {"source": "rss", "samples": self._run.n, "peak_allocated_bytes": p.run_peak,
                "peak_exact": p.run_exact, "allocated_bytes": self._last}

    def finish(self) -> None:
        """Hand the run figures over one last time (when they changed since the last event)."""
        self._run.finish(self._figures)

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


_ALLOC = "allocated_bytes.all.current"
_ALLOC_PEAK = "allocated_bytes.all.peak"
_RES = "reserved_bytes.all.current"
_RES_PEAK = "reserved_bytes.all.peak"


class CudaMemorySampler:
    """Caching-allocator counters of the current CUDA device, read with ``memory_stats()`` only.

    Nothing is reset (no ``reset_peak_memory_stats``, no ``reset_accumulated_memory_stats``): the job's
    ``max_memory_allocated()`` stays the job's. ``mem_peak_bytes`` is ``allocated_bytes.all.peak`` as
    read at the step's end (``PeakTracker``): the step's own peak when that high-water mark rose during
    the step, else an upper bound of it;
    ``alloc_retries`` is the delta of ``num_alloc_retries`` since the previous sample. The run figures
    (``memory`` event) add the rank's peak reserved (``reserved_bytes.all.peak``, same rule), the
    fragmentation ``peak reserved − peak allocated`` and the ``num_ooms`` and retries since the baseline
    read when the sampler is made (the first step's start). Stats absent from an old or non-CUDA
    allocator stay ``None``.
    """

    min_interval_ns = 0  # every step (memory_every_steps thins it)

    def __init__(self, cuda: Any = None, emit: Emit | None = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._run = _RunFigures(emit)
        stats: dict[str, Any] | None
        try:  # baseline at the first step's start: step 0 then reports its own peak and retries
            stats = dict(cuda.memory_stats())
        except Exception:  # noqa: BLE001 - no allocator stats: the first sample is the baseline
            stats = None
        # an allocator not yet initialised has no stats at all: nothing was allocated before the run
        zero = 0 if stats == {} else None
        s = stats or {}
        self._alloc = PeakTracker(s.get(_ALLOC_PEAK, zero), s.get(_ALLOC, zero))
        self._res = PeakTracker(s.get(_RES_PEAK, zero), s.get(_RES, zero))
        self._last_retries: int | None = s.get("num_alloc_retries", zero)
        self._last_ooms: int | None = s.get("num_ooms", zero)
        self._retries = 0
        self._ooms: int | None = None
        self._now: tuple[int | None, int | None] = (None, None)

    def sample(self) -> MemSample:
        stats = self._cuda.memory_stats()
        allocated = stats.get(_ALLOC)
        reserved = stats.get(_RES)
        peak, _exact = self._alloc.window(stats.get(_ALLOC_PEAK), allocated)
        self._res.window(stats.get(_RES_PEAK), reserved)
        self._now = (allocated, reserved)
        retries = stats.get("num_alloc_retries")
        delta = None
        if retries is not None:
            delta = retries - self._last_retries if self._last_retries is not None else retries
            if delta < 0:  # the script reset the allocator's counters: unknown for this step
                delta = None
            else:
                self._retries += delta
            self._last_retries = retries
        ooms = stats.get("num_ooms")
        if ooms is not None:
            d = ooms - self._last_ooms if self._last_ooms is not None else ooms
            self._ooms = (self._ooms or 0) + max(0, d)
            self._last_ooms = ooms
        try:
            self._run.tick(self._figures)
        except Exception:  # noqa: BLE001 - the event is best effort; the step's sample is not lost
            pass
        return (allocated, reserved, peak, delta)

    def _figures(self) -> dict[str, Any]:
        pa, pr = self._alloc.run_peak, self._res.run_peak
        d: dict[str, Any] = {"source": "cuda", "samples": self._run.n, "peak_allocated_bytes": pa,
                             "peak_exact": self._alloc.run_exact, "peak_reserved_bytes": pr,
                             "allocated_bytes": self._now[0], "reserved_bytes": self._now[1],
                             "alloc_retries": self._retries, "ooms": self._ooms}
        if pa is not None and pr is not None:
            d["fragmentation_bytes"] = max(0, pr - pa)
        return d

    def finish(self) -> None:
        """A last read (an OOM that ended the job is counted) and the run figures, when they changed."""
        if self._run.n:
            self.sample()
        self._run.finish(self._figures)

    def close(self) -> None:
        return None


def make_sampler(kind: str, emit: Emit | None = None) -> NullSampler | RssSampler | CudaMemorySampler:
    """``"cuda"``, ``"cpu"`` (RSS) or ``"none"``; ``emit`` receives the rank's run figures (``memory`` event)."""
    if kind == "cuda":
        return CudaMemorySampler(emit=emit)
    if kind == "cpu":
        return RssSampler(emit=emit)
    return NullSampler()
