"""``summary.goodput`` on a hand-built run: wall time split into productive steps, init, checkpoint,
eval, data stalls and the rest, and hang / failure time on runs that stopped."""

from __future__ import annotations

from typing import Any

import pytest
from fleetscope.server.analysis.health import goodput_split, pause_category, rank_ranges, redone_steps
from health_util import event, steps_batch


def test_goodput_arithmetic_on_a_hand_built_run(live_server: Any) -> None:
    t0 = 1.7e9
    with live_server.client() as c:
        rid = c.register_run({"name": "gp", "world_size": 2, "started_at": t0})
        # init 10 s; steps 0-4 (1 s each, 0.1 s of it waiting for data) at t0+10..15; a 5 s checkpoint;
        # steps 5-9 at t0+20..25; a 3 s evaluation; finished at t0+30
        c.ingest(steps_batch(rid, 2, range(5), t0=t0 + 10, step_s=1.0, data_s=0.1))
        c.ingest(steps_batch(rid, 2, range(5, 10), t0=t0 + 15, step_s=1.0, data_s=0.1))
        evs = []
        for r in range(2):
            evs += [event(r, "pause", {"reason": "checkpoint_save", "state": "begin", "expected_s": 5.0}, ts=t0 + 15),
                    event(r, "pause", {"reason": "checkpoint_save", "state": "end"}, ts=t0 + 20),
                    event(r, "pause", {"reason": "eval", "state": "begin"}, ts=t0 + 25),
                    event(r, "pause", {"reason": "eval", "state": "end", "duration_s": 3.0}, ts=t0 + 28)]
        c.ingest({"v": 1, "run_id": rid, "events": evs})
        c.ingest({"v": 1, "run_id": rid, "events": evs})  # a re-sent batch is not counted twice
        live_server.compact()
        c.finish_run(rid, "finished", finished_at=t0 + 30)
        g = c.summary(rid)["goodput"]
    assert g["wall_s"] == pytest.approx(30.0)
    assert g["productive_s"] == pytest.approx(9.0)
    assert g["fraction"] == pytest.approx(0.3)
    lost = g["lost"]
    assert lost["init"] == pytest.approx(10.0)
    assert lost["checkpoint"] == pytest.approx(5.0)
    assert lost["eval"] == pytest.approx(3.0)
    assert lost["data_stall"] == pytest.approx(1.0)
    assert lost["hang"] == 0 and lost["failure"] == 0 and lost["redone_steps"] == 0
    assert lost["other"] == pytest.approx(2.0)
    assert g["productive_s"] + sum(lost.values()) == pytest.approx(g["wall_s"])
    assert "job" not in g  # one attempt


def test_time_after_the_first_failure_is_lost_to_it(live_server: Any) -> None:
    t0 = 1.7e9
    with live_server.client() as c:
        rid = c.register_run({"name": "gp-fail", "world_size": 1, "started_at": t0})
        c.ingest(steps_batch(rid, 1, range(4), t0=t0, step_s=2.0))
        c.ingest({"v": 1, "run_id": rid, "events": [
            event(0, "failure", {"source": "exception", "exception": "OSError", "rank": 0}, step=4, ts=t0 + 8)]})
        live_server.compact()
        c.finish_run(rid, "failed", finished_at=t0 + 20)
        g = c.summary(rid)["goodput"]
    assert g["wall_s"] == pytest.approx(20.0) and g["productive_s"] == pytest.approx(8.0)
    assert g["lost"]["failure"] == pytest.approx(12.0) and g["lost"]["other"] == pytest.approx(0.0)


def test_goodput_split_and_helpers() -> None:
    g = goodput_split(wall_s=100, step_s=60, data_s=5, init_s=10, pause_s={"checkpoint_save": 8, "eval_loss": 4,
                      "run.pause": 2}, hang_s=6, failure_s=0, redone_s=3)
    assert g["productive_s"] == 52 and g["fraction"] == pytest.approx(0.52)
    assert g["lost"] == {"init": 10, "checkpoint": 8, "eval": 4, "pause": 2, "data_stall": 5, "hang": 6,
                         "failure": 0, "redone_steps": 3, "other": 10}
    assert [pause_category(r) for r in ("checkpoint_load", "eval", "evaluation", "gc")] == [
        "checkpoint", "eval", "eval", "pause"]
    assert redone_steps(9, 9, 6, 14) == 4 and redone_steps(9, 5, 10, 14) == 0 and redone_steps(None, 5, 0, 4) == 0
    assert rank_ranges([1543, 1536, 1537, 1538, 1539, 1540, 1541, 1542, 7]) == "7, 1536–1543"


def test_fleet_goodput_by_day(live_server: Any) -> None:
    import time

    from fleetscope.server.reports.health import fleet_goodput

    t0 = time.time() - 200
    with live_server.client() as c:
        rid = c.register_run({"name": "fleet-gp", "world_size": 2, "started_at": t0})
        c.ingest(steps_batch(rid, 2, range(10), t0=t0 + 5, step_s=2.0, data_s=0.5))
        live_server.compact()
        c.finish_run(rid, "finished", finished_at=t0 + 100)
        old = c.register_run({"name": "long-ago", "world_size": 1, "started_at": 1.7e9})
        c.ingest(steps_batch(old, 1, range(3), t0=1.7e9, step_s=1.0))
        live_server.compact()
    (day,) = fleet_goodput(live_server.state.engine, days=14)  # the 2023 run is outside the window
    assert day["runs"] == 1 and day["productive_s"] == pytest.approx(15.0) and day["wall_s"] == pytest.approx(100.0)
    assert day["fraction"] == pytest.approx(0.15)
