"""The transport's report of what it dropped: an ``agent_drops`` event with the cumulative counts by
reason, queued whenever they changed (docs/agent-transport.md, "Drops are data"), under this
process's rank and last step as the batches it sent show them."""

from __future__ import annotations

import os
import time
from typing import Any

from .batching import Batch

__all__ = ["DropReport", "AGENT_EVENT_SEQ_BASE"]

AGENT_EVENT_SEQ_BASE = 1 << 30
"""The agent's own events (``agent_drops``) use seq in [2**30, 2**31): the server keys events by
(run, rank, seq) as int32, and instrumentation numbers its events from 0. The offset grows with wall
time (seconds since 2023-11-14), so a restarted process never reuses one."""
_SEQ_EPOCH = 1_700_000_000


class DropReport:
    """One process's ``agent_drops`` events (a forked child gets a new one)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.last_step: int | None = None
        self._seq = 0
        self._reported: dict[str, int] = {}

    def learn(self, batch: Batch) -> None:
        """Remember this process's rank and last step from a batch it is about to send."""
        rs = batch.get("rank_steps")
        if rs:
            if self.rank is None:
                self.rank = rs["rank"][0]
            self.last_step = rs["step"][-1]
        elif self.rank is None:
            for key in ("collectives", "modality_tokens"):
                sec = batch.get(key)
                if sec:
                    self.rank = sec["rank"][0]
                    break
            else:
                for r in batch.get("ranks", ()):
                    if isinstance(r.get("rank"), int):
                        self.rank = r["rank"]
                        break

    def event(self, counts: dict[str, int]) -> dict[str, Any] | None:
        """An ``agent_drops`` event with the cumulative ``counts``, when they changed since the last one."""
        if counts == self._reported:
            return None
        self._reported = counts
        seq = max(self._seq + 1, AGENT_EVENT_SEQ_BASE + int(time.time()) - _SEQ_EPOCH)
        self._seq = seq
        rank = self.rank if self.rank is not None else _env_rank()
        return {
            "rank": rank,
            "seq": seq,
            "kind": "agent_drops",
            "ts": time.time(),
            "step": self.last_step,
            "data": dict(counts),
        }


def _env_rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 0
