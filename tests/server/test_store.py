"""Store internals against real Postgres: migrations, COPY layouts, blocks, rollups."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fleetscope.server.codec import (
    COLL_BLOCK_FIELDS,
    RAW_STEP_FLOATS,
    RAW_STEP_LAYOUT,
    STEP_BLOCK_FIELDS,
    CopyLayout,
    decode_block,
    encode_block,
)
from fleetscope.server.compactor import Compactor, grouped_median
from fleetscope.server.db import upgrade
from fleetscope.server.runs import RunRegistration, register_run
from sqlalchemy import inspect, text


def test_migrations_from_empty_create_every_table_and_are_idempotent(db_url: str, engine: Any) -> None:
    tables = set(inspect(engine).get_table_names())
    for t in ("runs", "ranks", "ingest_fragments", "modality_raw", "steps", "run_collectives", "run_events",
              "benchmark_series", "benchmark_points", "alerts", "api_tokens", "alembic_version"):
        assert t in tables
    upgrade(db_url)  # second time: no-op, no error
    from alembic.script import ScriptDirectory
    from fleetscope.server.db import _alembic_config

    head = ScriptDirectory.from_config(_alembic_config(db_url)).get_current_head()
    with engine.connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
    # run_id leads every key of per-run tables (Citus distribution column)
    insp = inspect(engine)
    for t in ("ranks", "steps", "run_collectives", "run_events", "run_modalities"):
        assert insp.get_pk_constraint(t)["constrained_columns"][0] == "run_id"


def test_block_roundtrip_keeps_values() -> None:
    rng = np.random.default_rng(0)
    n = 257
    cols = {name: rng.random(n) * 10 for name, _ in STEP_BLOCK_FIELDS}
    cols["rank"] = np.arange(n)
    cols["flags"] = rng.integers(0, 2, n)
    cols["mem_peak_bytes"] = rng.integers(0, 80 << 30, n).astype(np.float64)
    cols["ts"] = 1.7e9 + rng.random(n)
    cols["data_s"][5] = np.nan
    blob = encode_block(STEP_BLOCK_FIELDS, cols)
    back = decode_block(STEP_BLOCK_FIELDS, blob)
    assert np.array_equal(back["rank"], cols["rank"])
    assert np.array_equal(back["mem_peak_bytes"], cols["mem_peak_bytes"])  # exact bytes
    assert np.array_equal(back["ts"], cols["ts"])  # float64 kept
    np.testing.assert_allclose(back["step_s"], cols["step_s"], rtol=1e-7)  # float32
    assert np.isnan(back["data_s"][5])
    c = {name: rng.random(3) for name, _ in COLL_BLOCK_FIELDS}
    assert len(decode_block(COLL_BLOCK_FIELDS, encode_block(COLL_BLOCK_FIELDS, c))["rank"]) == 3


def test_grouped_median_matches_numpy_with_nans() -> None:
    rng = np.random.default_rng(1)
    gid = rng.integers(0, 50, 2000)
    v = rng.random(2000)
    v[rng.random(2000) < 0.1] = np.nan
    got = grouped_median(v, gid, 50)
    for g in range(50):
        x = v[gid == g]
        x = x[~np.isnan(x)]
        assert got[g] == pytest.approx(np.median(x)) if x.size else np.isnan(got[g])


def test_binary_copy_layout_roundtrips_through_postgres(engine: Any) -> None:
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE rows_ref (run_id int, step int, rank int, flags int, "
                        + ", ".join(f"{f} float8" for f in RAW_STEP_FLOATS) + ")")
            n = 10
            vals: dict[str, Any] = {"run_id": 7, "step": np.arange(n) // 4, "rank": np.arange(n) % 4, "flags": 0}
            for f in RAW_STEP_FLOATS:
                vals[f] = np.linspace(0, 1, n)
            vals["tokens"] = np.full(n, np.nan)
            layout = CopyLayout("rows_ref", RAW_STEP_LAYOUT.columns)
            with cur.copy(f"COPY {layout.table} ({', '.join(layout.names)}) FROM STDIN (FORMAT BINARY)") as cp:
                cp.write(layout.build(n, vals))
            buf = bytearray()
            with cur.copy(f"COPY (SELECT {', '.join(layout.names)} FROM rows_ref ORDER BY step, rank) "
                          "TO STDOUT (FORMAT BINARY)") as cp:
                for chunk in cp:
                    buf += chunk
        conn.commit()
    finally:
        raw.close()
    back = layout.parse(bytes(buf))
    assert list(back["rank"]) == list(vals["rank"])
    assert np.allclose(back["step_s"], vals["step_s"]) and np.isnan(back["tokens"]).all()


def test_compactor_rollups_equal_numpy_over_the_raw_rows(engine: Any) -> None:
    from fleetscope.server.ingest import IngestService

    from fleetscope.client import columnar
    from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
    from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

    spec = RunSpec(name="roll", family="llm-70b", world_size=16, steps=5, seed=3, straggler={5: 1.4})
    run = register_run(engine, RunRegistration(**{k: v for k, v in spec.run_info().items()}))
    ing = IngestService(engine)
    all_rows = []
    for step, rows in rank_step_rows(spec):
        all_rows += rows
        ing.ingest({"run_id": run["id"], "rank_steps": columnar(rows, RANK_STEP_FIELDS),
                    "collectives": columnar(collective_rows(spec, step, rows), COLLECTIVE_FIELDS)})
    res = Compactor(engine).run_once(force=True)
    assert res.steps == 5 and res.rank_steps == 80 and res.collectives == 320
    names = [f.name for f in RANK_STEP_FIELDS]
    arr = {n: np.array([r[i] for r in all_rows], dtype=float) for i, n in enumerate(names)}
    with engine.connect() as c:
        rows = c.execute(text("SELECT step, step_s, comm_exposed_s, work_s_max, slowest_rank, tokens, n_ranks "
                              "FROM steps ORDER BY step")).fetchall()
    for step, step_s, exposed, work_max, slowest, tokens, n_ranks in rows:
        m = arr["step"] == step
        assert n_ranks == 16
        assert step_s == pytest.approx(np.median(arr["step_s"][m]), rel=1e-6)
        assert exposed == pytest.approx(np.median(arr["comm_exposed_s"][m]), rel=1e-6)
        work = arr["step_s"][m] - arr["comm_exposed_s"][m]
        assert work_max == pytest.approx(work.max(), rel=1e-6)
        assert slowest == 5  # the straggler does the most work
        assert tokens == pytest.approx(arr["tokens"][m].sum())


def test_per_rank_batches_fold_when_every_rank_reported_and_the_rest_waits_whole(engine: Any) -> None:
    """Agents send one rank's steps per batch, so a step's ranks sit in many fragments: a pass folds
    the steps every rank reported and rewrites each fragment's other rows as a fragment of their
    own (nothing lost, nothing folded twice); the late rank's rows complete them in a later pass."""
    from fleetscope.server.ingest import IngestService

    from fleetscope.client import columnar
    from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

    run = register_run(engine, RunRegistration(name="per-rank", world_size=4))
    ing = IngestService(engine)
    names = [f.name for f in RANK_STEP_FIELDS]

    def send(rank: int, steps: range) -> None:
        rows = [tuple({"rank": rank, "step": s, "step_s": 1.0 + rank / 10, "ts": 1.7e9 + s}.get(n) for n in names)
                for s in steps]
        colls = [(rank, s, 0, "all_reduce", 4, 1 << 20, 1, 0.2, 0.1, 1.7e9 + s, "dp") for s in steps]
        ing.ingest({"run_id": run["id"], "rank_steps": columnar(rows, RANK_STEP_FIELDS),
                    "collectives": columnar(colls, COLLECTIVE_FIELDS)})

    for rank in range(3):
        send(rank, range(4))
    send(3, range(2))  # the last rank is behind by two steps
    comp = Compactor(engine, grace_s=3600)
    first = comp.run_once()
    assert (first.steps, first.rank_steps, first.collectives) == (2, 8, 8)
    with engine.connect() as c:
        left = c.execute(text("SELECT n_rank_steps, n_collectives, step_min, step_max FROM ingest_fragments "
                              "ORDER BY id")).fetchall()
    assert sorted(tuple(r) for r in left) == [(2, 2, 2, 3)] * 3  # ranks 0-2's steps 2-3, one fragment each
    send(3, range(2, 4))
    second = comp.run_once()
    assert (second.steps, second.rank_steps, second.collectives) == (2, 8, 8)
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM ingest_fragments")).scalar() == 0
        steps = c.execute(text("SELECT step, n_ranks, step_s_max, coll_records FROM steps ORDER BY step")).fetchall()
        counters = c.execute(text("SELECT rank_steps, collective_records, steps FROM runs WHERE id = :r"),
                             {"r": run["id"]}).one()
    assert [tuple(s) for s in steps] == [(s, 4, pytest.approx(1.3), 4) for s in range(4)]
    assert tuple(counters) == (16, 16, 4)


@pytest.mark.parametrize("bits", ["", "1", "10110011", "101100111", "0" * 63 + "1" * 66])
def test_steps_copied_fresh_equal_steps_upserted(engine: Any, bits: str) -> None:
    """The compactor's two ways to write ``steps`` rows (straight binary COPY for steps with no row
    yet; staging table + upsert otherwise) store the same values, the ``ranks`` bit string included."""
    from fleetscope.server.db import raw_connection
    from fleetscope.server.store import compaction as store

    run = register_run(engine, RunRegistration(name=f"w{len(bits)}", world_size=max(len(bits), 1)))

    def row(step: int) -> tuple[Any, ...]:
        vals: list[Any] = []
        for name, t in zip(store.STEP_COLUMNS, store._STEP_COPY_TYPES, strict=True):
            if name == "run_id":
                vals.append(run["id"])
            elif name == "step":
                vals.append(step)
            elif name == "ranks":
                vals.append(bits)
            elif name == "coll_block":
                vals.append(None)
            elif t == "bytea":
                vals.append(bytes(range(7)) * 3)
            elif t == "int4":
                vals.append(len(name))
            else:
                vals.append(None if name == "tokens" else 1.0 / len(name))
        return tuple(vals)

    with raw_connection(engine) as conn, conn.cursor() as cur:
        store.write_steps(cur, [row(1)], fresh=True)
        store.write_steps(cur, [row(2)])
    with engine.connect() as c:
        got = c.execute(text(f"SELECT {', '.join(store.STEP_COLUMNS[2:])}, ranks::text FROM steps "
                             "WHERE run_id = :r ORDER BY step"), {"r": run["id"]}).fetchall()
    assert len(got) == 2 and tuple(got[0]) == tuple(got[1])
    assert got[0][-1] == bits
