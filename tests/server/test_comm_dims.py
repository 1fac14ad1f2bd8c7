"""Communication by parallel dimension through ingest and compaction, with known answers: per-step
cross-rank medians per dim, a rank arriving late (the step is recomputed, not double counted), a
sender that names no dimension, and the pipeline bubble from send/recv waits and stage events."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

N_STEP = len(RANK_STEP_FIELDS)


def _step(rank: int, step: int, step_s: float, exposed: float) -> tuple:
    row: list[Any] = [None] * N_STEP
    names = [f.name for f in RANK_STEP_FIELDS]
    row[0], row[1] = rank, step
    row[names.index("step_s")] = step_s
    row[names.index("ts")] = 1.7e9 + step
    row[names.index("compute_s")] = step_s - exposed
    row[names.index("comm_exposed_s")] = exposed
    row[names.index("other_s")] = 0.0
    return tuple(row)


def _coll(rank: int, step: int, seq: int, op: str, n: int, nbytes: int, total: float, exposed: float,
          dim: str | None) -> tuple:
    return (rank, step, seq, op, n, nbytes, 1, total, exposed, 1.7e9 + step, dim)


def _run(c: Any, name: str, ws: int) -> int:
    return c.register_run({"name": name, "model_family": "f", "world_size": ws})


def test_comm_by_dim_is_the_median_over_steps_of_the_cross_rank_median(live_server: Any) -> None:
    with live_server.client() as c:
        rid = _run(c, "dims", 4)
        steps, colls = [], []
        for s in range(5):
            for r in range(4):
                tp_exp = 0.001 * (r + 1)  # ranks differ: the cross-rank median of 1,2,3,4 ms is 2.5 ms
                steps.append(_step(r, s, 0.1, tp_exp + 0.004))
                colls.append(_coll(r, s, 0, "all_reduce", 2, 1024, 0.002 * (r + 1), tp_exp, "tp"))
                colls.append(_coll(r, s, 1, "all_gather", 2, 4096, 0.003, 0.002, "dp"))
                colls.append(_coll(r, s, 2, "reduce_scatter", 2, 4096, 0.003, 0.002, "dp"))
        c.ingest_rows(rid, steps[:-1], colls[:-3])  # rank 3 of the last step arrives later
        live_server.compact()
        c.ingest_rows(rid, steps[-1:], colls[-3:])
        live_server.compact()
        s = c.summary(rid)
        rows = c.get(f"/api/v1/runs/{rid}/collectives")["collectives"]
    by = s["comm_by_dim"]
    assert set(by) == {"tp", "dp"}
    assert by["tp"]["calls"] == 1 and by["tp"]["bytes"] == 1024
    assert by["tp"]["exposed_s"] == pytest.approx(0.0025) and by["tp"]["total_s"] == pytest.approx(0.005)
    assert by["dp"]["calls"] == 2 and by["dp"]["bytes"] == 8192 and by["dp"]["exposed_s"] == pytest.approx(0.004)
    # the late rank was folded once: every byte of the rollup, by dimension
    tot = {}
    for r in rows:
        tot[r["dim"]] = tot.get(r["dim"], 0) + r["bytes"]
    assert tot == {"tp": 1024 * 20, "dp": 8192 * 20}
    assert list(by)[0] == "tp" or by["dp"]["exposed_s"] >= by["tp"]["exposed_s"]  # most exposed first


def test_a_sender_that_names_no_dimension_is_labelled_by_group_size(live_server: Any) -> None:
    with live_server.client() as c:
        rid = _run(c, "legacy", 4)
        rows = [_step(r, 0, 0.1, 0.01) for r in range(4)]
        old = [(r, 0, 0, "all_reduce", 4, 512, 1, 0.01, 0.01, 1.7e9) for r in range(4)]  # 10 fields: an old client
        old += [(r, 0, 1, "all_reduce", 2, 256, 1, 0.001, 0.0, 1.7e9) for r in range(4)]
        c.ingest_rows(rid, rows, old)
        live_server.compact()
        got = {(x["dim"], x["group_size"]) for x in c.get(f"/api/v1/runs/{rid}/collectives")["collectives"]}
        s = c.summary(rid)
    assert got == {("world", 4), ("g2", 2)}
    assert set(s["comm_by_dim"]) == {"unknown"}  # per step they cannot be told apart
    assert s["pipeline"] is None


def test_pipeline_bubble_stages_and_finding(live_server: Any) -> None:
    with live_server.client() as c:
        rid = _run(c, "pp", 4)
        steps, colls, events = [], [], []
        for s in range(6):
            for r in range(4):
                stage = r // 2  # 2 stages x 2 data-parallel ranks
                wait = 0.030 if stage == 1 else 0.010  # stage 0 is busier: stage 1 waits for it
                steps.append(_step(r, s, 0.100, wait))
                op = "send" if stage == 0 else "recv"
                colls.append(_coll(r, s, 0, op, 4, 8192, wait + 0.001, wait, "pp"))
        for r in range(4):
            events.append({"rank": r, "seq": 0, "kind": "pp_stage", "ts": 1.7e9, "step": 0,
                           "data": {"stage": r // 2, "num_stages": 2}})
            events.append({"rank": r, "seq": 1, "kind": "pp_schedule", "ts": 1.7e9, "step": 0,
                           "data": {"schedule": "ScheduleGPipe", "n_microbatches": 4}})
        c.ingest_rows(rid, steps, colls, events=events)
        live_server.compact()
        s = c.summary(rid)
    p = s["pipeline"]
    assert p["stages"] == 2 and p["microbatches"] == 4 and p["schedule"] == "ScheduleGPipe"
    assert p["bubble_s"] == pytest.approx(0.020)  # cross-rank median of 10, 10, 30, 30 ms
    assert p["bubble_fraction"] == pytest.approx(0.2, rel=1e-3)
    assert p["slowest_stage"] == 0
    per = {x["stage"]: x for x in p["per_stage"]}
    assert per[0]["bubble_s"] == pytest.approx(0.010) and per[1]["bubble_s"] == pytest.approx(0.030)
    texts = [f["finding"] for f in s["parallel_findings"] if f["dim"] == "pp"]
    assert any("bubble 20 % with 2 stages and 4 micro-batches" in t and "stage 0 is the slowest" in t for t in texts), texts


def test_dim_names_are_checked(live_server: Any) -> None:
    with live_server.client() as c:
        rid = _run(c, "baddim", 1)
        from fleetscope.wire import columns_from_rows

        batch = {"v": 1, "run_id": rid,
                 "collectives": columns_from_rows([(0, 0, 0, "all_reduce", 1, 4, 1, 0.1, 0.1, 1.7e9, "tp\x00x")],
                                                  COLLECTIVE_FIELDS, binary=False)}
        r = httpx.post(f"{live_server.url}/api/v1/ingest", json=batch,
                       headers={"Authorization": f"Bearer {live_server.token}"})
    assert r.status_code == 422 and "collectives.dim[0]" in r.text
