"""Training scalars (``run.log``) through the real server: an agent job's ``run.log`` values arrive at
``GET /api/v1/runs/{id}/scalars`` by step (rank 0's per step), stored in ``run_scalars`` not
``run_events``; a re-sent batch stores nothing twice; bad scalars are a 422 naming them; names and
points beyond a run's bounds are dropped and counted; long series are min/max-downsampled with the
spike kept; deleting a run deletes its scalars."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fleetscope.server.store.scalars as scalars_store
import pytest
from sqlalchemy import text

JOB = r'''
import math
import fleetscope.agent as fs
run = fs.init("scalars-e2e", model_family="toy")
for i in range(30):
    with run.step(tokens=100):
        pass
    run.log({"loss": 4.0 / (i + 1), "lr": 1e-3 * (i + 1), "bad": float("nan"), "note": "x"})
run.log({"eval/acc": 0.5}, step=7)
stats = run.stats()
run.finish()
assert stats["scalars_dropped_values"] == 60, stats
print("ok", stats["scalars_logged"])
'''


def _q(srv: Any, sql: str, **params: Any) -> Any:
    with srv.app.state.fs.engine.connect() as c:
        return c.execute(text(sql), params).fetchall()


def _ev(rank: int, seq: int, step: int | None, data: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "kind": "scalars", "ts": 1.7e9, "step": step, "data": data}


def test_run_log_of_an_agent_job_arrives_by_step_through_the_real_server(live_server: Any, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_SERVER=live_server.url, FLEETSCOPE_TOKEN=live_server.token, OMP_NUM_THREADS="1",
               FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    p = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "ok 61", (p.stdout, p.stderr[-2000:])
    with live_server.client() as c:
        (run,) = c.run_list(name="scalars-e2e")
        body = c.get(f"/api/v1/runs/{run['id']}/scalars")
    sc = body["scalars"]
    assert sorted(sc) == ["eval/acc", "loss", "lr"] == body["names"]
    # run.log after each step belongs to the step just finished: steps 0..29
    assert sc["loss"]["step"] == list(range(30))
    assert sc["loss"]["value"] == pytest.approx([4.0 / (i + 1) for i in range(30)])
    assert sc["lr"]["value"][-1] == pytest.approx(0.03)
    assert sc["eval/acc"] == {"step": [7], "value": [0.5], "points": 1, "reduced": False}
    # stored in run_scalars, not run_events; counted
    assert _q(live_server, "SELECT count(*) FROM run_events WHERE run_id = :r AND kind = 'scalars'", r=run["id"])[0][0] == 0
    assert _q(live_server, "SELECT stored, dropped FROM run_event_counts WHERE run_id = :r AND kind = 'scalars'",
              r=run["id"]) == [(61, 0)]
    # names= picks some
    with live_server.client() as c:
        only = c.get(f"/api/v1/runs/{run['id']}/scalars", names="lr")["scalars"]
        assert list(only) == ["lr"]
        r = c.http.get("/api/v1/runs/999999/scalars")
        assert r.status_code == 404


def test_rank_zero_wins_per_step_resends_store_nothing_twice_and_delete_removes_them(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "sc-ranks", "world_size": 2})
        batch = {"v": 1, "run_id": rid, "events": [_ev(1, 0, 3, {"loss": 9.0}), _ev(0, 0, 3, {"loss": 1.0}),
                                                   _ev(1, 1, 4, {"loss": 8.0})]}
        out = c.ingest(batch, fmt="json")
        assert out["accepted"]["events"] == 3
        again = c.ingest(batch, fmt="json")  # the agent re-sends after a lost answer
        assert again["accepted"]["events"] == 3 and not again.get("dropped")
        sc = c.get(f"/api/v1/runs/{rid}/scalars")["scalars"]
        # step 3: rank 0's value; step 4: only rank 1 logged
        assert sc["loss"]["step"] == [3, 4] and sc["loss"]["value"] == [1.0, 8.0]
        assert _q(live_server, "SELECT count(*) FROM run_scalars WHERE run_id = :r", r=rid)[0][0] == 3
        # the per-name summary the run filters sort by: last = the lowest rank at the highest step, min over all
        assert _q(live_server, "SELECT last_step, last_rank, last_value, min_value FROM run_scalar_names "
                               "WHERE run_id = :r", r=rid) == [(4, 1, 8.0, 1.0)]
        c.ingest({"v": 1, "run_id": rid, "events": [_ev(0, 5, 4, {"loss": 0.5})]}, fmt="json")  # rank 0 at step 4
        assert _q(live_server, "SELECT last_step, last_rank, last_value, min_value FROM run_scalar_names "
                               "WHERE run_id = :r", r=rid) == [(4, 0, 0.5, 0.5)]
        c.ingest({"v": 1, "run_id": rid, "events": [_ev(1, 6, 2, {"loss": 7.0})]}, fmt="json")  # an older step
        assert _q(live_server, "SELECT last_step, last_rank, last_value, min_value FROM run_scalar_names "
                               "WHERE run_id = :r", r=rid) == [(4, 0, 0.5, 0.5)]
        assert _q(live_server, "SELECT stored FROM run_event_counts WHERE run_id = :r AND kind = 'scalars'", r=rid) == [(5,)]
        admin = c.http.delete(f"/api/v1/runs/{rid}")
        assert admin.status_code == 200 and admin.json()["deleted"]["run_scalars"] == 5
        assert admin.json()["deleted"]["run_scalar_names"] == 1


@pytest.mark.parametrize(("data", "step", "where", "says"), [
    ({"loss": "high"}, 1, "events[0].data.loss", "finite number"),
    ({"loss": True}, 1, "events[0].data.loss", "finite number"),
    ({"x" * 129: 1.0}, 1, "events[0].data", "MAX_SCALAR_NAME_CHARS"),
    ({}, 1, "events[0].data", "at least one"),
    ({"loss": 1.0}, None, "events[0].step", "required"),
])
def test_bad_scalars_are_a_422_naming_them_and_nothing_of_the_batch_lands(
        live_server: Any, data: dict[str, Any], step: int | None, where: str, says: str) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "sc-bad", "world_size": 1})
        r = c.http.post("/api/v1/ingest", json={"v": 1, "run_id": rid, "events": [_ev(0, 0, step, data)]})
    assert r.status_code == 422, r.text
    assert where in r.text and says in r.text
    assert _q(live_server, "SELECT count(*) FROM run_scalars WHERE run_id = :r", r=rid)[0][0] == 0


def test_json_nan_is_refused_too(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "sc-nan", "world_size": 1})
        r = c.http.post("/api/v1/ingest", content=b'{"v":1,"run_id":%d,"events":[{"rank":0,"seq":0,"kind":"scalars",'
                        b'"ts":1.7e9,"step":0,"data":{"loss":NaN}}]}' % rid, headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 422), r.text


def test_names_and_points_beyond_the_bounds_are_dropped_and_counted(live_server: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scalars_store, "MAX_SCALAR_NAMES_PER_RUN", 3)
    monkeypatch.setattr(scalars_store, "MAX_SCALAR_POINTS_PER_RUN", 10)
    with live_server.client() as c:
        rid = c.register_run({"name": "sc-bounds", "world_size": 1})
        c.ingest({"v": 1, "run_id": rid, "events": [_ev(0, 0, 0, {"a": 1.0, "b": 2.0}),
                                                    _ev(0, 1, 1, {"c": 3.0, "d": 4.0, "e": 5.0})]}, fmt="json")
        # d and e: beyond 3 names
        assert _q(live_server, "SELECT stored, dropped FROM run_event_counts WHERE run_id = :r AND kind = 'scalars'",
                  r=rid) == [(3, 2)]
        evs = [_ev(0, 2 + i, 2 + i, {"a": float(i)}) for i in range(9)]
        c.ingest({"v": 1, "run_id": rid, "events": evs}, fmt="json")  # 3 stored + 7 = 10 points; 2 more dropped
        summary = c.summary(rid)
        names = c.get(f"/api/v1/runs/{rid}/scalars")["names"]
    assert names == ["a", "b", "c"]
    assert _q(live_server, "SELECT count(*) FROM run_scalars WHERE run_id = :r", r=rid)[0][0] == 10
    assert _q(live_server, "SELECT stored, dropped FROM run_event_counts WHERE run_id = :r AND kind = 'scalars'",
              r=rid) == [(10, 4)]
    assert summary["folded"]["events_dropped"]["scalars"] == 4


def test_a_long_series_is_downsampled_to_max_points_keeping_the_spike(live_server: Any) -> None:
    n = 5_000
    with live_server.client() as c:
        rid = c.register_run({"name": "sc-long", "world_size": 1})
        for lo in range(0, n, 1000):
            evs = [_ev(0, i, i, {"loss": 100.0 if i == 3_333 else 1.0 + math.sin(i / 50)}) for i in range(lo, lo + 1000)]
            c.ingest({"v": 1, "run_id": rid, "events": evs})
        body = c.get(f"/api/v1/runs/{rid}/scalars", max_points=200)["scalars"]["loss"]
        full = c.get(f"/api/v1/runs/{rid}/scalars", max_points=20_000)["scalars"]["loss"]
        too_many = c.http.get(f"/api/v1/runs/{rid}/scalars", params={"max_points": 20_001})
    assert body["reduced"] and body["points"] == n and len(body["step"]) <= 200
    assert 100.0 in body["value"] and body["step"][body["value"].index(100.0)] == 3_333
    assert body["step"] == sorted(body["step"]) and body["step"][0] == 0 and body["step"][-1] == n - 1
    assert not full["reduced"] and len(full["step"]) == n
    assert too_many.status_code == 422
