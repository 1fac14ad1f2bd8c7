"""Per-run rollups of communication and tokens: ``run_collectives`` (additive, by op × group size ×
message-size bucket) and ``run_modalities`` (tokens per modality per step)."""

from __future__ import annotations

from sqlalchemy import Engine, text

from fleetscope.wire import COLLECTIVE_OPS

from ..limits import MAX_PHASE_NAMES_PER_RUN
from .bounds import OVERFLOW_PHASE
from .rows import P2P, CollectiveRow, StepCommRow

__all__ = ["CollectiveRow", "StepCommRow", "P2P", "run_collectives", "step_comm", "run_modalities", "custom_phases"]


def run_collectives(engine: Engine, run_id: int) -> list[CollectiveRow]:
    """The run's collective rollup, most total time first (``dim`` None: the sender did not say)."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT c.op, c.group_size, c.size_bucket, c.records, c.calls, c.bytes, c.total_s, c.exposed_s, d.name "
                "FROM run_collectives c LEFT JOIN run_dims d ON d.run_id = c.run_id AND d.code = c.dim "
                "WHERE c.run_id = :id ORDER BY c.total_s DESC"
            ),
            {"id": run_id},
        ).fetchall()
    return [CollectiveRow(COLLECTIVE_OPS[op] if 0 <= op < len(COLLECTIVE_OPS) else "other", int(n), int(b), int(rec),
                          int(calls), float(nbytes), float(tot), float(exp), dim)
            for op, n, b, rec, calls, nbytes, tot, exp, dim in rows]


def step_comm(engine: Engine, run_id: int) -> list[StepCommRow]:
    """Per (step, dimension) cross-rank medians of communication (``step_comm``), in step order;
    ``dim`` is the name, None for collectives that named none, ``"<p2p>"`` for the send/recv row."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT s.step, s.dim, d.name, s.calls, s.bytes, s.total_s, s.exposed_s FROM step_comm s "
                "LEFT JOIN run_dims d ON d.run_id = s.run_id AND d.code = s.dim WHERE s.run_id = :id ORDER BY s.step"
            ),
            {"id": run_id},
        ).fetchall()
    return [StepCommRow(int(step), P2P if code == -1 else name, float(calls), float(b), float(tot), float(exp))
            for step, code, name, calls, b, tot, exp in rows]


def run_modalities(engine: Engine, run_id: int) -> list[tuple[int, str, int]]:
    """(step, modality, tokens summed over ranks) of the run, in step order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, modality, tokens FROM run_modalities WHERE run_id = :id ORDER BY step"), {"id": run_id}
        ).fetchall()
    return [(int(s), m, int(t)) for s, m, t in rows]


def custom_phases(engine: Engine, run_id: int) -> dict[str, float]:
    """{phase: median over steps of the cross-rank mean seconds} of the run's custom phases, biggest
    first: at most ``MAX_PHASE_NAMES_PER_RUN`` names plus the overflow phase, whatever is stored (the
    compactor folds later names; a run stored before it did shows its biggest ones)."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT phase, v FROM (SELECT phase, percentile_cont(0.5) WITHIN GROUP "
                 "(ORDER BY seconds / greatest(bit_count(ranks), 1)) AS v FROM run_phases WHERE run_id = :id "
                 "GROUP BY phase) t ORDER BY phase = :other DESC, v DESC, phase LIMIT :k"),
            {"id": run_id, "other": OVERFLOW_PHASE, "k": MAX_PHASE_NAMES_PER_RUN + 1},
        ).fetchall()
    return {p: float(v) for p, v in sorted(rows, key=lambda r: -float(r[1]))}
