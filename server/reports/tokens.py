"""Token balance of a run (the summary's ``token_balance``): per-rank tokens and work of the recent steps'
blocks and per-rank modality tokens (``store``), analysed by ``analysis.tokens``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..analysis.tokens import token_balance
from ..store import steps
from ..store.rows import RunRow
from ..store.token_balance import rank_modalities
from . import _cache

__all__ = ["run_token_balance", "BALANCE_STEPS"]

BALANCE_STEPS = 500  # recent steps whose per-rank blocks are read


def run_token_balance(engine: Engine, run: RunRow) -> dict[str, Any] | None:
    """``analysis.tokens.token_balance`` over the run's last ``BALANCE_STEPS`` steps (cached until the run
    changes); None without per-rank token counts."""
    return _cache.cached("token_balance", engine, run, lambda: token_balance(
        steps.recent_blocks(engine, run.id, BALANCE_STEPS), rank_modalities(engine, run.id)))
