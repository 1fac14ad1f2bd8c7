"""The agent's seams as structural types: what a run needs from its transport, clock and memory sampler.

``Run`` depends on these protocols only. The real implementations (``transport.Transport``,
``clock.CpuClock``/``clock.CudaClock``, ``memory.*Sampler``) and the tests' fakes
(``tests/agent/agent_testutil.FakeTransport``, the scripted clocks) satisfy them structurally; nothing
inherits from them. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from .config import AgentConfig

__all__ = [
    "Transport", "TransportFactory", "Record", "Clock", "Mark", "MemorySampler", "MemSample", "StepTracer",
    "HookHandle",
]  # fmt: skip

Mark = Any
"""A timing mark: an ``int`` of ``perf_counter_ns`` on the host clock, a recorded ``torch.cuda.Event``
(or None, skipped inside a CUDA-graph capture) on the CUDA clock. Only its clock interprets it."""

Record = tuple[Any, ...] | dict[str, Any]
"""What a run submits: a ``rank_step``/``collective``/``modality_tokens`` tuple in ``fleetscope.wire``
field order, or a ``rank``/``event`` dict."""

MemSample = tuple[int | None, int | None, int | None, int | None]
"""``(mem_allocated_bytes, mem_reserved_bytes, mem_peak_bytes, alloc_retries)``; None = not measured."""


@runtime_checkable
class Transport(Protocol):
    """Where a run's records go. ``submit`` is on the training thread's hot path: O(1), it never
    blocks and never raises. Records: ``rank_step``/``collective``/``modality_tokens`` tuples in
    ``fleetscope.wire`` field order, ``rank`` and ``event`` dicts (docs/agent-transport.md)."""

    def submit(self, kind: str, record: Record) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...

    def finish_run(self, status: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...


TransportFactory = Callable[[AgentConfig, dict[str, Any]], Transport]
"""``init(transport=...)``: builds the run's transport from the configuration and ``run_info``."""


@runtime_checkable
class Clock(Protocol):
    """Takes marks on the training thread; turns pairs of completed marks into nanoseconds later."""

    @property
    def kind(self) -> str:
        """``"cpu"`` (host clock, every mark ready when taken) or ``"cuda"`` (events)."""
        ...

    def mark(self) -> Mark: ...

    def mark_async(self) -> Mark:
        """A mark taken on another thread (completion callbacks)."""
        ...

    def ready(self, mark: Mark) -> bool: ...

    def elapsed_ns(self, a: Mark, b: Mark) -> int: ...

    def release(self, marks: Iterable[Mark]) -> None: ...

    def on_main_stream(self) -> bool: ...

    def set_main_stream(self) -> None: ...


@runtime_checkable
class MemorySampler(Protocol):
    """One memory sample per step, from host-side counters (memory.py)."""

    @property
    def min_interval_ns(self) -> int:
        """Read at most once per this many ns of the step clock (0: every sampled step)."""
        ...

    def sample(self) -> MemSample: ...

    def close(self) -> None: ...


@runtime_checkable
class StepTracer(Protocol):
    """Sampled tracing around steps (tracing.SampledTracer): O(1) between its windows."""

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


class HookHandle(Protocol):
    """What ``register_*_hook`` returns (torch's ``RemovableHandle``): removed at finish."""

    def remove(self) -> None: ...
