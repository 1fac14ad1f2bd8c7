"""The run summary's ``memory`` section: the ranks' latest ``memory`` events (``store.memory``) analysed
by ``analysis.memory``, read fresh like ``compile``: the last events land after the steps (at finish)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..analysis.figures import RunFigures
from ..analysis.memory import memory_summary
from ..store.memory import rank_memory
from ..store.rows import RunRow

__all__ = ["run_memory"]


def run_memory(engine: Engine, run: RunRow, fig: RunFigures) -> dict[str, Any] | None:
    """``analysis.memory.memory_summary`` of the run; None when nothing about memory was measured."""
    return memory_summary(rank_memory(engine, run.id), device_type=run.device_type,
                          mem_peak_bytes=fig.mem_peak_bytes, alloc_retries=fig.alloc_retries)
