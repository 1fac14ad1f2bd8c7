"""Ingest landing: one accepted batch in one transaction — its rank-steps and collectives as ONE
``ingest_fragments`` row (compressed columnar blocks), per-modality tokens by COPY into
``modality_raw``, rank info upserted into ``ranks``, events into ``run_events`` and group descriptions into
``run_groups`` (first copy wins; bounded and counted: ``store.events.land_events``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine

from ..db import raw_connection
from ..groups import Group
from ..limits import MAX_NODES_PER_RUN
from . import bounds
from . import events as events_store

__all__ = ["Fragment", "land_batch"]

#: (n_rank_steps, n_collectives, step_min, step_max, rank-step block, collective block)
Fragment = tuple[int, int, int, int, bytes | None, bytes | None]


def land_batch(engine: Engine, run_id: int, *, fragment: Fragment | None,
               modality_tokens: Mapping[str, Any] | None, ranks: Sequence[Mapping[str, Any]],
               events: Sequence[dict[str, Any]], dims: Sequence[tuple[int, str]] = (),
               phases: Mapping[str, Any] | None = None,
               groups: Sequence[tuple[Group, int]] = ()) -> events_store.Landed:
    """Write one validated batch, all or nothing. ``dims``: (code, name) of parallel dimensions its
    collectives name that this process has not stored for the run yet; ``groups``: the batch's distinct
    ``comm_group`` groups with their descriptions. Returns what of the events and groups was kept."""
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
            ranks = _bound_node_names(cur, run_id, ranks)
            cur.executemany(
                "INSERT INTO ranks (run_id, rank, host, node, local_rank, device) "
                "VALUES (%(run_id)s, %(rank)s, %(host)s, %(node)s, %(local_rank)s, %(device)s) "
                "ON CONFLICT (run_id, rank) DO UPDATE SET host = coalesce(excluded.host, ranks.host), "
                "node = coalesce(excluded.node, ranks.node), "
                "local_rank = coalesce(excluded.local_rank, ranks.local_rank), "
                "device = coalesce(excluded.device, ranks.device)",
                [{"run_id": run_id, **r} for r in ranks],
            )
        # last: it holds the run's event lock until commit (events and groups, bounded and counted there)
        return events_store.land_events(cur, run_id, events, groups)


def _bound_node_names(cur: Any, run_id: int, ranks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ranks with the host / node names beyond the run's ``MAX_NODES_PER_RUN`` distinct names set to
    None (the rest of each rank's record is kept); such ranks are counted (``run_folded`` "node_names").
    Names are admitted in batch order under the run's lock, so the bound holds across concurrent batches
    and server instances."""
    wanted = list(dict.fromkeys(v for r in ranks for k in ("host", "node") if isinstance(v := r.get(k), str)))
    out = [dict(r) for r in ranks]
    if not wanted:
        return out

    def unknown(names: list[str]) -> list[str]:
        known: set[str] = set()
        for i in range(0, len(names), 10_000):
            known |= bounds.kept_names(cur, "node", [run_id], names[i:i + 10_000]).get(run_id, set())
        return [n for n in names if n not in known]

    new = unknown(wanted)  # a kept name stays kept: no lock needed to see it
    if not new:
        return out
    bounds.lock_run_names(cur, run_id)
    new = unknown(new)
    room = max(MAX_NODES_PER_RUN - bounds.count_names(cur, "node", run_id), 0)
    bounds.admit_names(cur, "node", ((run_id, n) for n in new[:room]))
    dropped = set(new[room:])
    if dropped:
        n_ranks = 0
        for r in out:
            hit = False
            for k in ("host", "node"):
                if r.get(k) in dropped:
                    r[k] = None
                    hit = True
            n_ranks += hit
        bounds.add_folded(cur, [(run_id, "node_names", n_ranks)])
    return out
