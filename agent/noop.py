"""The disabled agent: ``NoopRun``, whose every method is a near-free no-op returning one shared
do-nothing context manager (``FLEETSCOPE_DISABLED=1``, ``disabled=True``, or a failed ``init``)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

__all__ = ["NoopRun"]


class _NoopCM:
    """Prebuilt do-nothing context manager (and step) of the disabled agent."""

    __slots__ = ()
    index = None

    def __enter__(self) -> _NoopCM:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def phase(self, name: str) -> _NoopCM:
        return self

    def count(self, tokens: Any = None, padded_tokens: Any = None, samples: Any = None, seq_lens: Any = None) -> None:
        return None


_NOOP = _NoopCM()


class NoopRun:
    """What ``init`` returns when the agent is disabled: every method is a near-free no-op."""

    finished = False
    step_index = 0
    rank = 0
    world_size = 1
    name = ""
    info: dict[str, Any] = {}

    def step(
        self, tokens: Any = None, samples: Any = None, padded_tokens: Any = None, step: Any = None
    ) -> _NoopCM:
        return _NOOP

    def phase(self, name: str) -> _NoopCM:
        return _NOOP

    def count(self, tokens: Any = None, padded_tokens: Any = None, samples: Any = None, seq_lens: Any = None) -> None:
        return None

    def instrument(
        self, model: Any = None, optimizer: Any = None, dataloader: Any = None, *, counts: Any = None
    ) -> Any:
        return dataloader

    def event(self, kind: str, step: Any = None, **data: Any) -> None:
        return None

    def log(self, metrics: Any, step: Any = None) -> None:
        return None

    def pause(self, reason: str, expected_s: Any = None) -> _NoopCM:
        return _NOOP

    def flush(self, timeout: Any = None) -> bool:
        return True

    def finish(self, status: str = "finished", timeout: Any = None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"disabled": True}
