"""Pinned regression baselines (migration 0020): one run per (owner namespace, family, config signature)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text

__all__ = ["pin", "pinned_run", "list_pins"]


def pin(engine: Engine, *, owner_key: str, family: str, signature: str, run_id: int, by: str | None) -> None:
    """Pin ``run_id`` as the baseline of its namespace, family and signature (replacing an earlier pin)."""
    with engine.begin() as c:
        c.execute(text(
            "INSERT INTO baselines (owner_key, model_family, config_signature, run_id, pinned_by) "
            "VALUES (:o, :f, :s, :r, :b) ON CONFLICT (owner_key, model_family, config_signature) "
            # excluded.pinned_at: its default, now() — Citus refuses now() itself in DO UPDATE
            "DO UPDATE SET run_id = excluded.run_id, pinned_at = excluded.pinned_at, pinned_by = excluded.pinned_by"),
            {"o": owner_key, "f": family, "s": signature, "r": run_id, "b": (by or "")[:128] or None})


def pinned_run(engine: Engine, *, owner_key: str, family: str, signature: str) -> int | None:
    with engine.connect() as c:
        v = c.execute(text("SELECT run_id FROM baselines WHERE owner_key = :o AND model_family = :f "
                           "AND config_signature = :s"), {"o": owner_key, "f": family, "s": signature}).scalar()
    return int(v) if v is not None else None


def list_pins(engine: Engine, owners: list[str] | None = None) -> list[dict[str, Any]]:
    """Every pin (of the ``owners`` namespaces when given), newest first."""
    where = "" if owners is None else "WHERE owner_key = ANY(:o) "
    with engine.connect() as c:
        rows = c.execute(text("SELECT owner_key, model_family, config_signature, run_id, pinned_at, pinned_by "
                              f"FROM baselines {where}ORDER BY pinned_at DESC LIMIT 1000"),
                         {} if owners is None else {"o": owners}).fetchall()
    return [{"model_family": r.model_family, "config_signature": r.config_signature, "run_id": r.run_id,
             "pinned_at": r.pinned_at.isoformat() if r.pinned_at else None, "pinned_by": r.pinned_by} for r in rows]
