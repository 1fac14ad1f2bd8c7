"""Restarts are attempts of one job: registration by (owner, name, attempt), the attempts in order on
``/health`` with the steps redone after each restore, and the registration's bounds."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from health_util import health, steps_batch


def _register(srv: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/api/v1/runs", json=body, headers={"Authorization": f"Bearer {srv.token}"})


def test_attempts_of_a_job_are_runs_of_their_own_joined_idempotently_with_redone_steps(live_server: Any) -> None:
    srv = live_server
    t0 = time.time() - 600
    body = {"name": "llama-70b-x", "world_size": 2, "job_id": "slurm-4411", "started_at": t0}
    # every rank of attempt 0 registers: one run
    ids0 = {_register(srv, {**body, "attempt": 0}).json()["id"] for _ in range(2)}
    assert len(ids0) == 1
    (a0,) = ids0
    with srv.client() as c:
        c.ingest(steps_batch(a0, 2, range(10), t0=t0 + 10, step_s=1.0))
        srv.compact()
        c.finish_run(a0, "failed", finished_at=t0 + 25)
    # the restart restores the checkpoint of step 5 and runs steps 6..14: steps 6..9 are redone
    r1 = [_register(srv, {**body, "attempt": 1, "started_at": t0 + 40}).json() for _ in range(2)]
    a1 = r1[0]["id"]
    assert r1[1]["id"] == a1 != a0 and r1[0]["attempt"] == 1 and r1[0]["created"] and not r1[1]["created"]
    with srv.client() as c:
        c.ingest(steps_batch(a1, 2, range(6, 15), t0=t0 + 50 - 6, step_s=1.0))
        srv.compact()
        run1 = c.get(f"/api/v1/runs/{a1}")
    assert run1["job_id"] == "slurm-4411" and run1["attempt"] == 1 and run1["name"] == "llama-70b-x"

    for rid in (a0, a1):  # both attempts list the job's attempts in order
        att = health(srv, rid)["attempts"]
        assert [(a["run_id"], a["attempt"]) for a in att] == [(a0, 0), (a1, 1)]
        assert [a["redone_steps"] for a in att] == [0, 4]
        assert [a["steps"] for a in att] == [10, 9]
        assert att[0]["status"] == "failed" and att[0]["ended_at"] is not None
        assert att[1]["gap_s"] == pytest.approx(15.0, abs=0.01)  # ended t0+25, restarted t0+40

    # the job's goodput: the redone steps and the gap between attempts are lost, not productive
    with srv.client() as c:
        g = c.summary(a1)["goodput"]
    assert g["lost"]["redone_steps"] == pytest.approx(4.0)
    assert g["productive_s"] == pytest.approx(5.0)
    job = g["job"]
    assert job["attempts"] == 2 and job["lost"]["restart"] == pytest.approx(15.0, abs=0.01)
    assert job["productive_s"] == pytest.approx(15.0)


def test_a_run_without_job_id_groups_its_attempts_by_name(live_server: Any) -> None:
    a0 = _register(live_server, {"name": "nojob", "world_size": 1}).json()["id"]
    a1 = _register(live_server, {"name": "nojob", "world_size": 1, "attempt": 1}).json()["id"]
    other = _register(live_server, {"name": "other", "world_size": 1, "attempt": 1}).json()["id"]
    assert len({a0, a1, other}) == 3
    assert [a["run_id"] for a in health(live_server, a1)["attempts"]] == [a0, a1]
    assert [a["run_id"] for a in health(live_server, other)["attempts"]] == [other]


@pytest.mark.parametrize(("extra", "field"), [
    ({"attempt": -1}, "attempt"),
    ({"attempt": "1"}, "attempt"),
    ({"attempt": 1.0}, "attempt"),
    ({"attempt": 10_001}, "attempt"),
    ({"job_id": "j" * 129}, "job_id"),
    ({"job_id": ""}, "job_id"),
    ({"job_id": 7}, "job_id"),
])
def test_registration_refuses_bad_attempts_and_job_ids(live_server: Any, extra: dict[str, Any], field: str) -> None:
    r = _register(live_server, {"name": "bad", "world_size": 1, **extra})
    assert r.status_code == 422, r.text
    assert f'"{field}"' in r.text  # the error names the field
