"""Ingest landing: one accepted batch in one transaction — its rank-steps and collectives as ONE
``ingest_fragments`` row (compressed columnar blocks), per-modality tokens by COPY into
``modality_raw``, rank info upserted into ``ranks``, events into ``run_events`` (first copy wins)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine

from ..db import raw_connection

__all__ = ["Fragment", "land_batch"]

#: (n_rank_steps, n_collectives, step_min, step_max, rank-step block, collective block)
Fragment = tuple[int, int, int, int, bytes | None, bytes | None]


def land_batch(engine: Engine, run_id: int, *, fragment: Fragment | None,
               modality_tokens: Mapping[str, Any] | None, ranks: Sequence[Mapping[str, Any]],
               events: Sequence[Mapping[str, Any]], dims: Sequence[tuple[int, str]] = (),
               phases: Mapping[str, Any] | None = None) -> None:
    """Write one validated batch, all or nothing. ``dims``: (code, name) of parallel dimensions its
    collectives name that this process has not stored for the run yet."""
    with raw_connection(engine) as conn, conn.cursor() as cur:
        if dims:
            cur.executemany("INSERT INTO run_dims (run_id, code, name) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                            [(run_id, c, n) for c, n in dims])
        if fragment is not None:
            cur.execute(
                "INSERT INTO ingest_fragments (run_id, n_rank_steps, n_collectives, step_min, step_max, "
                "rank_steps, collectives) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (run_id, *fragment),
            )
        if modality_tokens:
            ms = modality_tokens
            with cur.copy("COPY modality_raw (run_id, step, rank, modality, tokens) FROM STDIN") as cp:
                for s, r, m, t in zip(ms["step"], ms["rank"], ms["modality"], ms["tokens"], strict=True):
                    cp.write_row((run_id, int(s), int(r), m, int(t)))
        if phases:
            ps = phases
            with cur.copy("COPY phase_raw (run_id, step, rank, phase, seconds) FROM STDIN") as cp:
                for s, r, p, t in zip(ps["step"], ps["rank"], ps["phase"], ps["seconds"], strict=True):
                    cp.write_row((run_id, int(s), int(r), p, float(t)))
        if ranks:
            cur.executemany(
                "INSERT INTO ranks (run_id, rank, host, node, local_rank, device) "
                "VALUES (%(run_id)s, %(rank)s, %(host)s, %(node)s, %(local_rank)s, %(device)s) "
                "ON CONFLICT (run_id, rank) DO UPDATE SET host = coalesce(excluded.host, ranks.host), "
                "node = coalesce(excluded.node, ranks.node), "
                "local_rank = coalesce(excluded.local_rank, ranks.local_rank), "
                "device = coalesce(excluded.device, ranks.device)",
                [{"run_id": run_id, **r} for r in ranks],
            )
        if events:
            cur.executemany(
                "INSERT INTO run_events (run_id, rank, seq, kind, ts, step, data) "
                "VALUES (%(run_id)s, %(rank)s, %(seq)s, %(kind)s, %(ts)s, %(step)s, %(data)s::jsonb) "
                "ON CONFLICT (run_id, rank, seq) DO NOTHING",
                [{**e, "run_id": run_id, "data": json.dumps(e["data"])} for e in events],
            )
