"""Run health over the real server and Postgres: stalled → hung with the wavefront (the ranks that never
arrived, their nodes and stacks), node lost, the first failure as root cause, declared pauses (no
alert), resume → resolved, Slack payloads at a local receiver, and the bounds on position / failure data."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from analysis_util import Receiver
from fleetscope.server.store import health as health_store
from health_util import (
    FAST,
    alerts,
    event,
    frame,
    health,
    nodes,
    state_is,
    steps_batch,
    stuck,
    wait_for,
    waiting,
)
from sqlalchemy import text


@pytest.fixture
def slack() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def srv(db_url: str, slack: Receiver) -> Iterator[Any]:
    from conftest import start_server

    s = start_server(db_url, slack_webhook_url=slack.url, **FAST)
    yield s
    s.stop()


def _run(c: Any, name: str, world: int, steps: int, t0: float) -> int:
    rid = c.register_run({"name": name, "world_size": world, "started_at": t0})
    c.ingest(steps_batch(rid, world, range(steps), t0=t0, ranks=nodes(world)))
    return rid


def _health_alerts(srv: Any, run_id: int) -> list[dict[str, Any]]:
    return [a for a in alerts(srv) if a["run_id"] == run_id and a["kind"] in ("hang", "node_lost", "failure")]


def test_hang_names_the_rank_that_never_arrived_its_node_and_stack_then_resolves_when_steps_resume(
        srv: Any, slack: Receiver) -> None:
    t0 = time.time() - 60
    with srv.client() as c:
        rid = _run(c, "llama-hang", 8, 5, t0)
        srv.compact()
        assert wait_for(state_is(srv, rid, "running"))["state"] == "running"

        stack = [frame("/ws/train.py", 90, "main"), frame("/ws/data/dataloader.py", 211, "__next__")]

        def positions() -> None:  # each rank's sender thread, every few seconds while the step stays open
            evs = [waiting(r, 5, "all_reduce", 12) for r in range(8) if r != 5]
            evs.append(stuck(5, 5, 11, stack, open_s=35.0))
            c.ingest({"v": 1, "run_id": rid, "events": evs})

        h = wait_for(state_is(srv, rid, "hung"), timeout=30, tick=positions)
    assert h["missing_ranks"] == [5] and h["missing_count"] == 1
    assert h["missing_nodes"] == ["n0001"]
    assert h["collective"] == {"op": "all_reduce", "dim": "dp", "seq": 12}
    assert h["waiting"]["ranks"] == 7 and h["waiting"]["op"] == "all_reduce"
    assert h["stacks"]["5"][-1] == {"file": "/ws/data/dataloader.py", "line": 211, "func": "__next__"}
    assert list(h["stacks"]) == ["5"]
    assert ("run llama-hang hung at step 5: 7 of 8 ranks wait in all_reduce #12 on dim dp; "
            "rank 5 (node n0001) never arrived — stuck in `dataloader.py:211 __next__` for") in h["finding"]
    assert h["since"] is not None
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}").json()["status"] == "hung"

    # one alert for the incident (not one per rank, not one per pass), in Slack with the deep link
    (a,) = wait_for(lambda: _health_alerts(srv, rid))
    assert a["kind"] == "hang" and a["state"] == "firing" and a["url"] == f"https://fleet.example/runs/{rid}"
    assert a["details"]["missing_ranks"] == [5]
    assert [x["id"] for x in alerts(srv, kind="hang")] == [a["id"]]
    msgs = wait_for(lambda: slack.bodies or None)
    assert len(msgs) == 1
    assert "rank 5 (node n0001) never arrived" in msgs[0]["text"] and f"https://fleet.example/runs/{rid}" in msgs[0]["text"]
    assert any(b.get("type") == "actions" and b["elements"][0]["url"] == a["url"] for b in msgs[0]["blocks"])
    time.sleep(1.0)  # several passes later: still one alert, one message
    assert len(_health_alerts(srv, rid)) == 1 and len(slack.bodies) == 1

    # the stuck rank recovers: steps resume -> running, the alert resolves by itself
    with srv.client() as c:
        c.ingest(steps_batch(rid, 8, range(5, 8), t0=time.time() - 2))
    srv.compact()
    h = wait_for(state_is(srv, rid, "running"))
    assert h["missing_ranks"] == [] and h["finding"] is None
    (a,) = wait_for(lambda: [x for x in _health_alerts(srv, rid) if x["state"] == "resolved"] or None)
    assert a["resolved_at"] is not None
    wait_for(lambda: len(slack.bodies) == 2)
    assert "resumed" in slack.bodies[1]["text"]
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}").json()["status"] == "running"
    # the hang's time is kept for goodput
    with srv.state.engine.connect() as conn:
        assert conn.execute(text("SELECT hang_s FROM run_health WHERE run_id = :r"), {"r": rid}).scalar() > 1.0


def test_a_rank_blocked_in_an_earlier_collective_of_the_dimension_is_the_one_that_never_arrived(srv: Any) -> None:
    t0 = time.time() - 60
    with srv.client() as c:
        rid = _run(c, "behind", 4, 3, t0)
        srv.compact()
        wait_for(state_is(srv, rid, "running"))

        def positions() -> None:
            evs = [waiting(r, 3, "reduce_scatter", 40, dim="fsdp") for r in (0, 1, 3)]
            evs.append(waiting(2, 3, "reduce_scatter", 39, dim="fsdp"))  # still in the previous one
            c.ingest({"v": 1, "run_id": rid, "events": evs})

        h = wait_for(state_is(srv, rid, "hung"), tick=positions)
    assert h["missing_ranks"] == [2] and h["collective"] == {"op": "reduce_scatter", "dim": "fsdp", "seq": 40}
    assert "3 of 4 ranks wait in reduce_scatter #40 on dim fsdp; rank 2 (node n0000) never arrived" in h["finding"]


def test_all_ranks_of_a_node_silent_while_others_report_is_node_lost(srv: Any, slack: Receiver) -> None:
    t0 = time.time() - 60
    with srv.client() as c:
        rid = _run(c, "node-loss", 8, 4, t0)
        srv.compact()
        wait_for(state_is(srv, rid, "running"))

        def positions() -> None:  # node n0001 (ranks 4-7) says nothing any more
            c.ingest({"v": 1, "run_id": rid, "events": [waiting(r, 4, "all_reduce", 9) for r in range(4)]})

        h = wait_for(state_is(srv, rid, "hung"), tick=positions)
    assert h["missing_nodes"] == ["n0001"] and h["missing_ranks"] == [4, 5, 6, 7]
    assert "node n0001 lost — all 4 of its ranks (4–7) went silent while 4 others report" in h["finding"]
    (a,) = wait_for(lambda: _health_alerts(srv, rid))
    assert a["kind"] == "node_lost"
    msgs = wait_for(lambda: slack.bodies or None)
    assert "node n0001 lost" in msgs[0]["text"]


@pytest.fixture
def manual(db_url: str, slack: Receiver) -> Iterator[Any]:
    """The server without its background health pass: the test runs each pass itself
    (``srv.state.health.run_once()``), so nothing races what it sends."""
    from conftest import start_server

    s = start_server(db_url, slack_webhook_url=slack.url, **{**FAST, "health_enabled": False})
    yield s
    s.stop()


def test_the_first_failure_by_time_is_the_root_cause_and_the_run_turns_failed(manual: Any, slack: Receiver) -> None:
    srv = manual
    t0 = time.time() - 60
    now = time.time()
    with srv.client() as c:
        rid = _run(c, "crashy", 4, 6, t0)
        srv.compact()
        srv.state.health.run_once()
        assert state_is(srv, rid, "running")() is not None
        # the ranks torn down after the root cause report first, and a pass concludes on them before the
        # root cause lands (the order of arrival must not matter, nor a pass in between)
        torn = [event(r, "failure", {"source": "signal", "signal": "SIGTERM", "exit_code": -15, "rank": r,
                                     "exception": None, "message": None, "frames": [], "phase": "backward"},
                      step=6, ts=now + 2 + r) for r in (0, 1, 3)]
        c.ingest({"v": 1, "run_id": rid, "events": torn})
        srv.state.health.run_once()
        (a,) = _health_alerts(srv, rid)
        assert a["kind"] == "failure" and a["details"]["root_cause"]["rank"] == 0  # the first known so far
        root = event(2, "failure", {
            "source": "exception", "exception": "RuntimeError", "message": "CUDA error: an illegal memory access",
            "frames": [frame("/ws/train.py", 120, "main"), frame("/ws/model/attn.py", 77, "forward")],
            "phase": "forward", "signal": None, "exit_code": 1, "rank": 2}, step=6, ts=now)
        launcher = event(0, "failure", {"source": "launcher", "exit_code": 1, "rank": 2, "message": "exitcode 1"},
                         step=6, ts=now + 5)
        c.ingest({"v": 1, "run_id": rid, "events": [root, launcher, root]})  # a copy of the root: stored once
        # the run ended failed already: the pass assesses it again because failures landed since
        srv.state.health.run_once()
        h = state_is(srv, rid, "failed")()
        assert h is not None
    f0 = h["failures"][0]
    assert (f0["rank"], f0["exception"], f0["step"], f0["source"]) == (2, "RuntimeError", 6, "exception")
    assert f0["frames"][-1]["func"] == "forward" and f0["message"] == "CUDA error: an illegal memory access"
    assert [f["rank"] for f in h["failures"]] == [2, 0, 1, 3, 2] and h["failures_count"] == 5
    assert h["failed_ranks"] == 4
    assert h["finding"] == ("run crashy failed at step 6: rank 2 (node n0000) raised RuntimeError: CUDA error: an "
                            "illegal memory access in `attn.py:77 forward` during forward; 3 other ranks failed after it")
    assert h["cause"] == "failure" and h["lost_nodes"] == [] and h["settling"] is False
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}").json()["status"] == "failed"
    # the same alert, its root cause and finding updated in place: not a new incident, not a new page
    (a2,) = _health_alerts(srv, rid)
    assert a2["id"] == a["id"] and a2["state"] == "firing" and a2["kind"] == "failure"
    assert a2["details"]["root_cause"] == {"cause": "failure", "rank": 2, "exception": "RuntimeError", "signal": None,
                                           "exit_code": 1, "step": 6}
    assert a2["details"]["finding"].startswith("run crashy failed at step 6: rank 2 (node n0000) raised RuntimeError in")
    msgs = wait_for(lambda: slack.bodies or None)
    assert "rank 0 (node n0000) was killed by SIGTERM" in msgs[0]["text"]  # the page as the first pass saw it
    # the exception's message (it may hold a secret) stays in the run's record, out of alerts and Slack
    assert "illegal memory access" not in str(slack.bodies) and "illegal memory access" not in str(a2["details"])
    # passes after it change nothing: one alert, one page; the run is no longer assessed (nothing new landed)
    srv.state.health.run_once()
    srv.state.health.run_once()
    assert rid not in [r.run_id for r in health_store.progress(srv.state.engine)]
    time.sleep(1.0)  # the sinks' delivery loop (every 0.2 s) would have sent a second page by now
    assert len(slack.bodies) == 1 and [x["id"] for x in _health_alerts(srv, rid)] == [a["id"]]


def test_killed_rank_is_named_with_its_signal(srv: Any) -> None:
    with srv.client() as c:
        rid = _run(c, "killed", 2, 2, time.time() - 30)
        c.ingest({"v": 1, "run_id": rid, "events": [event(1, "failure", {
            "source": "signal", "signal": "SIGKILL", "exit_code": -9, "rank": 1})]})
    h = wait_for(state_is(srv, rid, "failed"))
    assert "rank 1 (node n0000) was killed by SIGKILL" in h["finding"]


def test_declared_pause_holds_off_the_detector_then_a_real_stall_alerts(srv: Any, slack: Receiver) -> None:
    t0 = time.time() - 60
    with srv.client() as c:
        rid = _run(c, "ckpt", 2, 4, t0)
        srv.compact()
        wait_for(state_is(srv, rid, "running"))
        c.ingest({"v": 1, "run_id": rid, "events": [
            event(r, "pause", {"reason": "checkpoint_save", "state": "begin", "expected_s": 3.0}, step=4)
            for r in range(2)]})
        h = wait_for(lambda: (x := health(srv, rid))["pause"] and x)
        assert h["state"] == "running" and h["pause"]["reason"] == "checkpoint_save" and h["pause"]["ranks"] == 2
        time.sleep(5.0)  # past the stall threshold (2 s): the declared pause holds it off
        h = health(srv, rid)
        assert h["state"] == "running" and h["pause"] is not None
        assert _health_alerts(srv, rid) == [] and slack.bodies == []
        c.ingest({"v": 1, "run_id": rid, "events": [
            event(r, "pause", {"reason": "checkpoint_save", "state": "end", "duration_s": 5.2}, step=4)
            for r in range(2)]})
        time.sleep(1.0)  # the pause ended, no step yet: the stall clock restarted at its end, not at the last step
        assert health(srv, rid)["state"] == "running" and _health_alerts(srv, rid) == []
        c.ingest(steps_batch(rid, 2, range(4, 6), t0=time.time() - 1))
        srv.compact()
        h = wait_for(state_is(srv, rid, "running"))
        assert h["pause"] is None and _health_alerts(srv, rid) == []
        g = c.summary(rid)["goodput"]
        assert g["lost"]["checkpoint"] == pytest.approx(5.2)
        # now it stops with no pause declared and no positions (an older agent): stalled, and a hang alert
        h = wait_for(state_is(srv, rid, "stalled"), timeout=30)
    assert h["finding"].startswith("run ckpt stalled at step 6: no step finished for")
    assert h["missing_ranks"] == [] and h["collective"] is None
    (a,) = wait_for(lambda: _health_alerts(srv, rid))
    assert a["kind"] == "hang"


def test_finished_run_is_finished_and_an_unknown_run_is_404(srv: Any) -> None:
    with srv.client() as c:
        rid = _run(c, "done", 2, 3, time.time() - 30)
        c.finish_run(rid, "finished")
    h = wait_for(state_is(srv, rid, "finished"))
    assert h["failures"] == [] and h["attempts"][0]["run_id"] == rid
    r = httpx.get(f"{srv.url}/api/v1/runs/999999/health")
    assert r.status_code == 404 and "run 999999 not found" in r.text


@pytest.mark.parametrize(("kind", "data", "where"), [
    ("position", {"state": "flying"}, "data.state"),
    ("position", {"state": "in_step", "open_s": -1}, "data.open_s"),
    ("position", {"state": "in_step", "collective": {"op": "all_reduce", "seq": "12"}}, "data.collective.seq"),
    ("position", {"state": "in_step", "stack": [{"file": "a.py", "line": 1, "func": "f"}] * 13}, "data.stack"),
    ("position", {"state": "in_step", "stack": [{"file": "a.py", "line": "1", "func": "f"}]}, "data.stack[0].line"),
    ("failure", {"source": "meteor"}, "data.source"),
    ("failure", {"source": "exit", "exit_code": 1.5}, "data.exit_code"),
    ("failure", {"source": "exception", "frames": "boom"}, "data.frames"),
    ("failure", {"source": "launcher", "exit_code": 1, "rank": 2}, "data.rank"),  # the run has 2 ranks
    ("pause", {"reason": "checkpoint_save", "state": "middle"}, "data.state"),
    ("pause", {"state": "begin"}, "data.reason"),
])
def test_bad_health_events_are_refused_naming_the_field(live_server: Any, kind: str, data: dict[str, Any],
                                                        where: str) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": f"bad-{kind}", "world_size": 2})
    r = httpx.post(f"{live_server.url}/api/v1/ingest", json={"v": 1, "run_id": rid, "events": [event(0, kind, data)]},
                   headers={"Authorization": f"Bearer {live_server.token}"})
    assert r.status_code == 422, r.text
    assert f'"events[0].{where}' in r.text  # the error names the field (docs/api.md, errors)
    with live_server.state.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM run_positions")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM run_failures")).scalar() == 0


def test_positions_keep_the_latest_per_rank_and_failures_are_bounded(live_server: Any) -> None:
    from fleetscope.server.limits import MAX_FAILURE_MESSAGE_CHARS

    with live_server.client() as c:
        rid = c.register_run({"name": "bounded", "world_size": 4})
        first = waiting(1, 3, "all_reduce", 5)
        later = waiting(1, 4, "all_reduce", 7)
        c.ingest({"v": 1, "run_id": rid, "events": [later, first]})  # the later one wins whatever the order
        c.ingest({"v": 1, "run_id": rid, "events": [first]})  # a re-sent older one changes nothing
        msg = "x" * (MAX_FAILURE_MESSAGE_CHARS + 500)
        c.ingest({"v": 1, "run_id": rid, "events": [
            event(2, "failure", {"source": "exception", "exception": "ValueError", "message": msg, "rank": 2})]})
    eng = live_server.state.engine
    with eng.connect() as conn:
        rows = conn.execute(text("SELECT rank, step, coll_seq FROM run_positions WHERE run_id = :r"), {"r": rid}).fetchall()
        assert [tuple(x) for x in rows] == [(1, 4, 7)]
        m = conn.execute(text("SELECT message FROM run_failures WHERE run_id = :r"), {"r": rid}).scalar()
        assert len(m) == MAX_FAILURE_MESSAGE_CHARS and m.endswith("…")
        folded = conn.execute(text("SELECT folded FROM run_event_counts WHERE run_id = :r AND kind = 'failure'"),
                              {"r": rid}).scalar()
        assert folded == 1
        # positions and failures never land in run_events (capped per kind)
        assert conn.execute(text("SELECT count(*) FROM run_events WHERE run_id = :r"), {"r": rid}).scalar() == 0


def test_simulate_hang_crash_and_restart_scenarios_produce_what_a_real_job_would(srv: Any) -> None:
    """``fleetscope simulate --hang / --crash / --restart`` through the real agent transport."""
    import threading

    from fleetscope.simulate import run_simulation

    common = {"server": srv.url, "token": srv.token, "family": "vla-7b", "ranks": 16, "steps": 8, "step_ms": 200.0,
              "flush_timeout_s": 60.0}
    # held 10 s: the hang is concluded ~2-3 s after the run appears (health pass every 0.2 s, FAST)
    t = threading.Thread(target=run_simulation, kwargs={**common, "run": "sim-hang", "hang": (11, 5), "hold_s": 10.0},
                         daemon=True)
    t.start()
    rid = wait_for(lambda: (r := httpx.get(f"{srv.url}/api/v1/runs", params={"name": "sim-hang"}).json()["runs"])
                   and r[0]["id"])
    h = wait_for(state_is(srv, rid, "hung"), timeout=40)
    assert h["missing_ranks"] == [11] and h["missing_nodes"] == ["node0001"] and h["waiting"]["ranks"] == 15
    assert h["stacks"]["11"][-1]["func"] == "read_shard"

    # the other scenarios run while the hang holds (runs of their own); the hang is joined at the end
    run_simulation(**common, run="sim-crash", crash=(6, 4))
    rid = httpx.get(f"{srv.url}/api/v1/runs", params={"name": "sim-crash"}).json()["runs"][0]["id"]
    h = wait_for(state_is(srv, rid, "failed"))
    assert h["failures"][0]["rank"] == 6 and h["failures"][0]["exception"] == "RuntimeError"
    assert h["failed_ranks"] == 16 and "15 other ranks failed after it" in h["finding"]

    run_simulation(**common, run="sim-restart", restart=6, checkpoint_every=4)
    runs = httpx.get(f"{srv.url}/api/v1/runs", params={"name": "sim-restart"}).json()["runs"]
    assert sorted(r["attempt"] for r in runs) == [0, 1] and {r["job_id"] for r in runs} == {"sim-restart"}
    a1 = next(r["id"] for r in runs if r["attempt"] == 1)
    srv.compact()
    att = health(srv, a1)["attempts"]
    assert [a["attempt"] for a in att] == [0, 1] and att[0]["status"] == "failed"
    assert [a["redone_steps"] for a in att] == [0, 2]  # checkpoint at 4, crashed at 6: steps 4 and 5 redone
    t.join(60)
    assert not t.is_alive(), "the hang simulation did not finish after its hold"


def test_wavefront_victims_in_other_collectives_are_not_blamed_and_ranks_are_listed_as_ranges() -> None:
    """The pure wavefront: 16 ranks, 2 data-parallel groups; rank 9 stuck in the data loader, its tensor-
    parallel peer 8 blocked in a tp collective waiting for it (a victim), everyone else in the dp all_reduce."""
    from dataclasses import dataclass

    from fleetscope.server.analysis.health import HealthParams, evaluate, wavefront

    @dataclass
    class P:
        rank: int
        op: str | None
        dim: str | None
        seq: int | None
        done: bool | None
        state: str = "in_step"
        phase: str | None = "backward"
        step: int | None = 40
        ts: float | None = 1000.0
        open_s: float | None = 100.0
        group: str | None = None
        stack: list[dict[str, Any]] | None = None
        age_s: float = 1.0

    ps = [P(r, "all_reduce", "dp", 77, False) for r in range(16) if r not in (8, 9)]
    ps.append(P(8, "all_gather", "tp", 310, False))
    ps.append(P(9, "all_reduce", "dp", 76, True, phase="data", stack=[frame("/a/loader.py", 5, "next_batch")]))
    nodes = {r: f"n{r // 8}" for r in range(16)}
    wf = wavefront(ps, 16, nodes, silence_s=30)
    assert wf.waiting == {"op": "all_reduce", "dim": "dp", "group": None, "seq": 77, "ranks": 14} and wf.missing == [9]
    v = evaluate(name="mesh", status="running", world_size=16, steps=40, current_step=39, now=1000.0, progress_at=800.0,
                 p99_step_s=1.0, failures=[], n_failed_ranks=0, finished_at=None, pauses=[], positions=ps, nodes=nodes,
                 params=HealthParams())
    assert v.state == "hung" and v.missing_ranks == [9] and v.missing_nodes == ["n1"]
    assert "rank 9 (node n1) never arrived — stuck in `loader.py:5 next_batch` for 2 min" in v.finding
    # a silent block of ranks (8-15 all silent: node n1 lost) is named as a node and a range
    for p in ps:
        if p.rank >= 8:
            p.age_s = 120.0
    v = evaluate(name="mesh", status="running", world_size=16, steps=40, current_step=39, now=1000.0, progress_at=800.0,
                 p99_step_s=1.0, failures=[], n_failed_ranks=0, finished_at=None, pauses=[], positions=ps, nodes=nodes,
                 params=HealthParams())
    assert v.kind == "node_lost" and v.missing_ranks == list(range(8, 16))
    assert "node n1 lost — all 8 of its ranks (8–15) went silent while 8 others report" in v.finding
    # without a mesh dimension the collective is named by its process group
    plain = [P(r, "broadcast", None, 5, False, group="pg1") for r in range(3)] + [P(3, "broadcast", None, 4, True,
                                                                                    group="pg1")]
    v = evaluate(name="plain", status="running", world_size=4, steps=40, current_step=39, now=1000.0,
                 progress_at=800.0, p99_step_s=1.0, failures=[], n_failed_ranks=0, finished_at=None, pauses=[],
                 positions=plain, nodes={}, params=HealthParams())
    assert v.missing_ranks == [3] and "3 of 4 ranks wait in broadcast #5 of group pg1; rank 3 never arrived" in v.finding


def test_health_alerts_in_slack_escape_what_the_job_wrote() -> None:
    from fleetscope.server.notifier import slack_message, webhook_payload

    alert = {"id": 3, "kind": "failure", "state": "firing", "run_id": 7, "metric": "run_state",
             "url": "https://fleet.example/runs/7",
             "details": {"run_name": "r", "finding": "run r failed at step 4: rank 1 raised <!channel> in `a.py:1 <@U1>`"}}
    msg = slack_message(alert, "fired")
    text = str(msg)
    assert "<!channel>" not in text and "<@U1>" not in text and "&lt;!channel&gt;" in msg["text"]
    assert msg["blocks"][0]["text"]["text"] == "Run failed · fleetscope"
    assert any(b.get("type") == "actions" and b["elements"][0]["url"] == alert["url"] for b in msg["blocks"])
    assert webhook_payload(alert, "fired")["summary"] == alert["details"]["finding"]
    assert slack_message(alert, "resolved")["text"].startswith("Resolved: the failure of run r was resolved")
    assert slack_message({**alert, "kind": "hang"}, "resolved")["text"].startswith("Resolved: run r resumed")


def _peer_failure(rank: int, ts: float, *, message: str = "[gloo/transport/tcp/pair.cc:534] Connection closed by "
                  "peer [127.0.0.1]:41027", exception: str = "RuntimeError", source: str = "exception") -> Any:
    from fleetscope.server.store.health import Failure

    return Failure(rank, source, ts, 40, exception, message, [frame("/ws/train.py", 12, "main")], "backward", None, 1)


def _evaluate(failures: list[Any], silent: Any, now: float, n_failed: int = 1) -> Any:
    from fleetscope.server.analysis.health import HealthParams, evaluate

    return evaluate(name="job", status="failed", world_size=8, steps=40, current_step=39, now=now, progress_at=now - 5,
                    p99_step_s=1.0, failures=failures, n_failed_ranks=n_failed, finished_at=now - 1, pauses=[],
                    positions=None, nodes={r: f"n{r // 4}" for r in range(8)}, params=HealthParams(silence_s=30.0),
                    silent=silent)


def test_a_peer_error_with_a_node_that_said_nothing_names_that_node_lost_once_it_had_time_to_report() -> None:
    """The rule (analysis.health._node_lost): the first failure is a rank losing its connection to a peer,
    and a node's ranks sent no failure record, no exit and no live position — once the settle time after
    the failure has passed, that node is lost, the root cause; before it the failure stands, settling."""
    from fleetscope.server.analysis.health import HealthParams, RankSet, SilentNodes, is_peer_error, settle_s
    from fleetscope.server.store.health import Failure

    t = 10_000.0
    silent = SilentNodes(nodes=["n1"], count=1, ranks=RankSet.of([4, 5, 6, 7], 1024),
                         by_node=[{"node": "n1", "ranks": [4, 5, 6, 7], "rank_count": 4}])
    fails = [_peer_failure(0, t), _peer_failure(1, t + 0.1)]
    early = _evaluate(fails, silent, now=t + 1, n_failed=4)
    assert early.state == "failed" and early.cause == "failure"
    assert early.settle_until == t + settle_s(HealthParams(silence_s=30.0)) == t + 32.0
    assert early.finding.startswith("run job failed at step 40: rank 0 (node n0) raised RuntimeError")
    v = _evaluate(fails, silent, now=t + 60, n_failed=4)
    assert v.state == "failed" and v.kind == "failure" and v.cause == "node_lost" and v.settle_until is None
    assert v.missing_nodes == ["n1"] and v.missing_ranks == [4, 5, 6, 7] and v.missing_count == 4
    assert v.lost_nodes == [{"node": "n1", "ranks": [4, 5, 6, 7], "rank_count": 4}]
    assert v.finding == ("run job failed at step 40: node n1 lost — its 4 ranks (4–7) stopped with no failure or "
                         "exit reported; then rank 0 (node n0) lost its connection to it (RuntimeError), 3 other "
                         "ranks after it")
    assert "Connection closed" not in v.alert_finding  # the message stays in the run's record
    assert v.detail()["cause"] == "node_lost" and v.detail()["lost_nodes"] == v.lost_nodes

    # a real failure first (not a lost connection): it is the root cause, whatever node said nothing
    crash = Failure(0, "exception", t, 40, "RuntimeError", "CUDA error: an illegal memory access", [], "forward",
                    None, 1)
    v = _evaluate([crash, _peer_failure(1, t + 1)], silent, now=t + 60)
    assert v.cause == "failure" and v.settle_until is None and v.missing_nodes == []
    # every node reported (nothing silent): the lost connection is the failure as found
    v = _evaluate(fails, SilentNodes(), now=t + 60)
    assert v.cause == "failure" and "raised RuntimeError" in v.finding
    # ranks the server never heard of, on no known node
    v = _evaluate(fails, SilentNodes(unreported=RankSet.of([6, 7], 1024)), now=t + 60)
    assert v.cause == "node_lost" and v.missing_ranks == [6, 7] and v.missing_nodes == []
    assert v.lost_nodes == [{"node": None, "ranks": [6, 7], "rank_count": 2}]
    assert "ranks 6–7 (node unknown) never reported; then rank 0 (node n0) lost its connection" in v.finding
    # what counts as losing a peer
    assert is_peer_error(_peer_failure(0, t, message="Connection reset by peer", exception="DistBackendError"))
    assert is_peer_error(_peer_failure(0, t, message="", exception="DistNetworkError"))
    assert not is_peer_error(crash)
    assert not is_peer_error(Failure(0, "launcher", t, None, None, None, [], None, "SIGKILL", -9))


def test_a_node_that_said_nothing_while_the_others_lost_their_connection_is_lost(manual: Any, slack: Receiver) -> None:
    """Over the real server and Postgres, the pass driven by the test: 8 ranks on 2 nodes; the ranks of
    n0000 fail with gloo's "Connection closed by peer", n0001 says nothing. While the settle time runs the
    run is failed, settling, and not paged; then one failure alert names n0001 lost as the root cause; and
    a rank that never registered is named with its node unknown."""
    srv = manual
    t0 = time.time() - 60
    with srv.client() as c:
        rid = c.register_run({"name": "lost-node", "world_size": 8, "started_at": t0})
        # ranks 0-3 on n0000, 4-6 on n0001; rank 7 never reported anything
        c.ingest(steps_batch(rid, 8, range(4), t0=t0, ranks=nodes(7)))
        srv.compact()
        srv.state.health.run_once()
        gone = time.time()
        c.ingest({"v": 1, "run_id": rid, "events": [event(r, "failure", {
            "source": "exception", "exception": "RuntimeError", "rank": r, "frames": [], "phase": "backward",
            "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                       "[127.0.0.1]:40123"}, step=4, ts=gone + r * 0.01) for r in range(4)]})
        c.finish_run(rid, "failed")
    srv.state.health.run_once()
    h = health(srv, rid)
    assert h["state"] == "failed" and h["settling"] is True and h["cause"] == "failure"
    assert _health_alerts(srv, rid) == []  # held while the silent node may still report
    assert rid in [r.run_id for r in health_store.progress(srv.state.engine)]  # ended, assessed again
    settle = srv.state.health.params.silence_s + 2.0
    time.sleep(max(gone + settle - time.time(), 0.0) + 0.2)  # the settle time passes (the pass is not racing)
    srv.state.health.run_once()
    h = health(srv, rid)
    assert h["state"] == "failed" and h["cause"] == "node_lost" and h["settling"] is False, h
    assert h["missing_nodes"] == ["n0001"] and h["missing_ranks"] == [4, 5, 6, 7] and h["missing_count"] == 4
    assert h["lost_nodes"] == [{"node": "n0001", "ranks": [4, 5, 6], "rank_count": 3},
                               {"node": None, "ranks": [7], "rank_count": 1}]
    assert h["finding"] == ("run lost-node failed at step 4: node n0001 lost — its 3 ranks (4–6) stopped with no "
                            "failure or exit reported; rank 7 (node unknown) never reported; then rank 0 (node "
                            "n0000) lost its connection to it (RuntimeError), 3 other ranks after it")
    (a,) = _health_alerts(srv, rid)
    assert a["kind"] == "failure" and a["details"]["root_cause"] == {
        "cause": "node_lost", "nodes": ["n0001"], "ranks": [4, 5, 6, 7], "rank_count": 4, "step": 4}
    assert a["details"]["missing_nodes"] == ["n0001"]
    msgs = wait_for(lambda: slack.bodies or None)
    assert "node n0001 lost" in msgs[0]["text"] and "Connection closed" not in str(msgs[0])
    srv.state.health.run_once()  # settled: not assessed again, nothing more sent
    assert rid not in [r.run_id for r in health_store.progress(srv.state.engine)]
    time.sleep(1.0)
    assert len(slack.bodies) == 1 and len(_health_alerts(srv, rid)) == 1


def test_the_node_lost_rule_reads_nothing_when_it_cannot_apply_and_a_big_run_once() -> None:
    """When the silent nodes are read (health_pass._silent_nodes): never for a real failure first, nor
    when the run's failure records reached their cap (a node without one proves nothing then); a run of
    more than INLINE_RANKS ranks not while its failure settles (``checked`` False: read once, after)."""
    from fleetscope.server.analysis.health import HealthParams
    from fleetscope.server.health_pass import INLINE_RANKS, _silent_nodes
    from fleetscope.server.limits import MAX_FAILURES_PER_RUN
    from fleetscope.server.store.health import Failure, RunProgress

    def rp(world: int, now: float) -> RunProgress:
        return RunProgress(1, "r", "failed", world, 0.0, now, 10, 9, "failed", 9, 0.0, None, 0.0, {}, now, 2)

    params = HealthParams(silence_s=30.0)
    peer = [_peer_failure(0, 1000.0)]
    crash = [Failure(0, "exception", 1000.0, 4, "ValueError", "bad batch", [], None, None, 1)]
    engine: Any = None  # nothing below may read the database
    assert _silent_nodes(engine, rp(8, 1001.0), params, crash, 1, None) is None
    assert _silent_nodes(engine, rp(8, 1001.0), params, peer, MAX_FAILURES_PER_RUN, None) is None
    s = _silent_nodes(engine, rp(INLINE_RANKS + 1, 1001.0), params, peer, 1, None)
    assert s is not None and s.checked is False
    v = _evaluate(peer, s, now=1001.0)
    assert v.settle_until == 1032.0 and v.cause == "failure"
