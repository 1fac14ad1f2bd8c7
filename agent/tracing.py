"""Optional sampled tracing: every K steps, profile a few steps with ``torch.profiler`` and send their
reduced trace (``fleetscope.traces``, HTA-exact figures) as a ``trace_summary`` record.

The training thread only starts and stops the profiler (torch's own cost while it records); between
windows ``on_step_start``/``on_step_end`` are an integer test and an attribute read. Exporting the
trace to a temp file, reducing it and submitting the summary happen on one daemon thread; a window
that would start while the previous one is still being reduced is skipped (counted), so at most one
trace is ever on disk or in memory. Nothing here raises into the training loop.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SampledTracer", "json_safe"]


def json_safe(v: Any) -> Any:
    """A copy with non-finite floats as None (the server refuses NaN/inf in event data)."""
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v

log = logging.getLogger(__name__)

_STOP = object()


class SampledTracer:
    """``SampledTracer(every_k_steps, active_steps, submit, rank)``: call ``on_step_start(step)`` and
    ``on_step_end(step)`` around each training step; ``close()`` at the end of the run."""

    def __init__(
        self,
        every_k_steps: int,
        active_steps: int,
        submit: Callable[[dict[str, Any]], None],
        rank: int,
        *,
        tmp_dir: str | None = None,
        max_gpu_events: int = 2_000_000,
    ) -> None:
        if every_k_steps < 1:
            raise ValueError(f"every_k_steps must be >= 1, got {every_k_steps}")
        if not 1 <= active_steps <= every_k_steps:
            raise ValueError(
                f"active_steps must be in [1, every_k_steps={every_k_steps}], got {active_steps}"
            )
        self.every_k_steps = every_k_steps
        self.active_steps = active_steps
        self.rank = rank
        self._submit = submit
        self._tmp_dir = tmp_dir
        self._max_gpu_events = max_gpu_events
        self._prof: Any = None  # the profiler of the window being recorded (training thread only)
        self._first_step = 0
        self._left = 0
        self._busy = False  # a trace is being reduced
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self.windows = 0
        self.submitted = 0
        self.skipped_busy = 0
        self.errors = 0

    # -- training thread ---------------------------------------------------------------------
    def on_step_start(self, step: int) -> None:
        """Start a profiling window at every K-th step (O(1) otherwise)."""
        if self._prof is not None or step % self.every_k_steps or step == 0 or self._closed:
            return
        if self._busy:
            self.skipped_busy += 1
            return
        try:
            self._start(step)
        except Exception as e:  # noqa: BLE001 - never raise into the training loop
            self._fail("start", e)

    def on_step_end(self, step: int) -> None:
        """Close a step of the window; after its last step, hand the trace to the worker."""
        prof = self._prof
        if prof is None:
            return
        try:
            self._left -= 1
            if self._left > 0:
                prof.step()  # closes ProfilerStep#i, opens ProfilerStep#i+1 (includes the data wait)
                return
            self._prof = None
            prof.stop()
            self._busy = True
            self._idle.clear()
            self._ensure_worker()
            self._jobs.put_nowait((prof, self._first_step))
            self.windows += 1
        except Exception as e:  # noqa: BLE001
            self._prof = None
            self._busy = False
            self._idle.set()
            self._fail("stop", e)

    def _start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # a schedule makes torch mark each step as ProfilerStep#i; always RECORD: we stop it ourselves
        prof = profile(activities=activities, schedule=lambda _s: ProfilerAction.RECORD)
        prof.start()
        self._prof = prof
        self._first_step = step
        self._left = self.active_steps

    # -- worker thread -----------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="fleetscope-tracer", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            prof, first_step = job
            try:
                self._reduce_and_submit(prof, first_step)
            except Exception as e:  # noqa: BLE001 - logged once per kind, counted
                self._fail("reduce", e)
            finally:
                self._busy = False
                self._idle.set()

    def _reduce_and_submit(self, prof: Any, first_step: int) -> None:
        from fleetscope.traces import reduce_trace

        fd, path = tempfile.mkstemp(
            prefix=f"fleetscope-trace-r{self.rank}-", suffix=".json", dir=self._tmp_dir
        )
        os.close(fd)
        try:
            t0 = time.perf_counter()
            prof.export_chrome_trace(path)
            t1 = time.perf_counter()
            size = os.path.getsize(path)
            summary = reduce_trace(
                path, rank=self.rank, include_last_step=True, max_gpu_events=self._max_gpu_events
            )
            t2 = time.perf_counter()
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        for s in summary.get("steps", []):
            if isinstance(s.get("step"), int):
                s["step"] = first_step + s["step"]  # torch numbers the window's steps from 0
        summary["profiler_steps"] = [first_step + i for i in summary.get("profiler_steps", [])]
        summary["source"] = f"sampled@step{first_step}"
        self._submit({
            "kind": "trace_summary",
            "rank": self.rank,
            "step": first_step,
            "first_step": first_step,
            "active_steps": self.active_steps,
            "trace_bytes": size,
            "export_s": round(t1 - t0, 6),
            "reduce_s": round(t2 - t1, 6),
            "summary": summary,
        })  # fmt: skip
        self.submitted += 1

    # -- lifecycle ---------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the pending trace (if any) is reduced and submitted."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Drop an unfinished window, let the pending reduction finish (bounded), stop the worker."""
        self._closed = True
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception as e:  # noqa: BLE001
                self._fail("close", e)
        self.flush(timeout)
        if self._worker is not None and self._worker.is_alive():
            try:
                self._jobs.put(_STOP, timeout=timeout)
            except queue.Full:
                return
            self._worker.join(timeout)

    def stats(self) -> dict[str, int]:
        return {
            "windows": self.windows,
            "submitted": self.submitted,
            "skipped_busy": self.skipped_busy,
            "errors": self.errors,
        }

    def _fail(self, where: str, e: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning(
                "fleetscope sampled tracing: %s failed (%s: %s); further errors are only counted",
                where,
                type(e).__name__,
                e,
            )
