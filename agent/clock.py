"""Timing marks: the monotonic clock on CPU, CUDA events resolved lazily on GPU.

The training thread only *takes* marks (``mark()``): an int from ``perf_counter_ns`` on CPU, or a
CUDA event recorded on the current stream on GPU. Durations are computed later, off the hot path,
from pairs of marks (``elapsed_ns``). On GPU that happens only once every event of a step reports
``query() == True`` on a later step or at flush: the agent never calls ``Event.synchronize``,
``Stream.synchronize`` or ``torch.cuda.synchronize``, so it adds no device synchronisation.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CpuClock", "CudaClock", "make_clock"]


class CpuClock:
    """Host monotonic clock in nanoseconds; every mark is ready when taken."""

    kind = "cpu"
    mark = staticmethod(time.perf_counter_ns)
    #: a mark taken on a thread other than the training thread (completion callbacks)
    mark_async = staticmethod(time.perf_counter_ns)

    @staticmethod
    def ready(mark: Any) -> bool:
        return True

    @staticmethod
    def elapsed_ns(a: int, b: int) -> int:
        return b - a

    @staticmethod
    def release(marks: Any) -> None:
        return None

    def on_main_stream(self) -> bool:
        return True

    def set_main_stream(self) -> None:
        return None


class CudaClock:
    """CUDA events (``enable_timing=True``) recorded on the current stream, pooled and reused.

    ``mark()`` costs one ``Event.record``. ``ready(ev)`` is ``ev.query()`` (non-blocking).
    ``elapsed_ns`` must only be called once both events are ready; it uses ``Event.elapsed_time``,
    which does not block on completed events.
    """

    kind = "cuda"

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._event = cuda.Event
        self._pool: list[Any] = []
        self._main_stream: Any = None
        self.created = 0
        self.skipped = 0
        capturing = getattr(cuda, "is_current_stream_capturing", None)
        try:
            capturing()  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - a build without CUDA graphs: never capturing
            capturing = None
        self._capturing = capturing or (lambda: False)

    def _new(self) -> Any:
        try:
            return self._pool.pop()
        except IndexError:
            self.created += 1
            return self._event(enable_timing=True)

    def mark(self) -> Any:
        # recording an event while the stream is being captured into a CUDA graph would invalidate
        # the user's capture: no mark (None), and the step is dropped at resolution (counted)
        if self._capturing():
            self.skipped += 1
            return None
        ev = self._new()
        ev.record()
        return ev

    # completion callbacks run where the current stream already waits on the collective's work
    mark_async = mark

    @staticmethod
    def ready(ev: Any) -> bool:
        return ev is None or bool(ev.query())

    @staticmethod
    def elapsed_ns(a: Any, b: Any) -> int:
        return int(round(a.elapsed_time(b) * 1e6))

    def release(self, marks: Any) -> None:
        """Return resolved events to the pool (each event once)."""
        seen: set[int] = set()
        pool = self._pool
        for ev in marks:
            if ev is not None and id(ev) not in seen:
                seen.add(id(ev))
                pool.append(ev)
        if len(pool) > 4096:  # a step with a burst of collectives must not pin events forever
            del pool[4096:]

    def set_main_stream(self) -> None:
        """Remember the stream the training loop computes on (the current one at the first step)."""
        try:
            self._main_stream = self._cuda.current_stream()
        except Exception:  # pragma: no cover
            self._main_stream = None

    def on_main_stream(self) -> bool:
        """Whether the current stream is the training loop's (a stall there is exposed time)."""
        if self._main_stream is None:
            return True
        try:
            return self._cuda.current_stream() == self._main_stream
        except Exception:  # pragma: no cover
            return True


def make_clock(kind: str) -> CpuClock | CudaClock:
    """``"cpu"`` or ``"cuda"``; ``"auto"`` picks CUDA when torch is imported and CUDA is initialised."""
    if kind == "auto":
        import sys

        torch = sys.modules.get("torch")
        kind = "cpu"
        try:
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                kind = "cuda"
        except Exception:  # pragma: no cover
            kind = "cpu"
    return CudaClock() if kind == "cuda" else CpuClock()
