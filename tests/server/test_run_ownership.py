"""Runs belong to their owner (the registering token, or its team): over real HTTP into real Postgres.

A token of another owner gets 403 on ingest, trace upload and finish and writes nothing; a token of
the same team and an admin token write; a name registered first by someone else (a squatter) does not
capture the real job, whose 64 ranks register concurrently and land every batch; runs without owner
(auth disabled, or registered before owners existed) stay writable by any ingest token."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from fleetscope.server.auth import create_token
from fleetscope.server.ownership import RunOwners
from fleetscope.server.runs import RunRegistration, register_run
from sqlalchemy import text

from fleetscope.client import columnar
from fleetscope.synthetic import RunSpec, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS, encode_batch

_RANK = [f.name for f in RANK_STEP_FIELDS].index("rank")


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _batch(run_id: int, spec: RunSpec, rank: int | None = None) -> tuple[bytes, dict[str, str], int]:
    """(body, headers, rank-step records) of the spec's rank-steps (one rank's, or all ranks')."""
    rows = [r for _, rs in rank_step_rows(spec) for r in rs if rank is None or r[_RANK] == rank]
    body, headers = encode_batch({"v": 1, "run_id": run_id, "rank_steps": columnar(rows, RANK_STEP_FIELDS)})
    return body, headers, len(rows)


def _ingest(srv: Any, token: str, run_id: int, spec: RunSpec, rank: int | None = None) -> httpx.Response:
    body, headers, _ = _batch(run_id, spec, rank)
    return httpx.post(f"{srv.url}/api/v1/ingest", content=body, headers={**headers, **_h(token)}, timeout=60)


def _traces(srv: Any, token: str, run_id: int, ranks: tuple[int, ...] = (0,)) -> httpx.Response:
    body = {"ranks": {str(r): {"source": f"rank{r}.pt.trace.json", "kernel_time_us": 1.0} for r in ranks}}
    return httpx.post(f"{srv.url}/api/v1/runs/{run_id}/traces", json=body, headers=_h(token), timeout=30)


def _register(srv: Any, token: str, name: str, world_size: int, **extra: Any) -> int:
    r = httpx.post(f"{srv.url}/api/v1/runs", json={"name": name, "model_family": "vla-7b",
                                                   "world_size": world_size, **extra}, headers=_h(token), timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["id"])


def _stored(srv: Any, run_id: int) -> dict[str, int]:
    """What the database holds for the run: rank-steps landed or compacted (one statement, one snapshot:
    the compactor moves them from fragments to the run's counter in one transaction), trace rows."""
    with srv.state.engine.connect() as c:
        row = c.execute(text(
            "SELECT (SELECT coalesce(sum(n_rank_steps), 0) FROM ingest_fragments WHERE run_id = :r) "
            "       + (SELECT rank_steps FROM runs WHERE id = :r), "
            "       (SELECT count(*) FROM trace_summaries WHERE run_id = :r)"), {"r": run_id}).one()
    return {"rank_steps": int(row[0]), "traces": int(row[1])}


def _run(srv: Any, run_id: int) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/api/v1/runs/{run_id}", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_token_of_another_owner_is_refused_and_writes_nothing(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    owner, foreign = create_token(eng, "owner"), create_token(eng, "foreign")
    spec = RunSpec(name="job-a", family="vla-7b", world_size=2, steps=3, seed=1)
    rid = _register(srv, owner, "job-a", 2)
    assert _ingest(srv, owner, rid, spec).status_code == 200
    before = _stored(srv, rid)
    assert before["rank_steps"] == 6

    r = _ingest(srv, foreign, rid, spec)
    assert r.status_code == 403, r.text
    d = r.json()["detail"]
    assert d["where"] == "run_id" and f"run {rid} belongs to another owner" in d["error"]
    r = _traces(srv, foreign, rid)
    assert r.status_code == 403 and f"run {rid} belongs to another owner" in r.json()["detail"]
    assert httpx.post(f"{srv.url}/api/v1/runs/{rid}/finish", json={"status": "failed"}, headers=_h(foreign),
                      timeout=30).status_code == 403
    assert _stored(srv, rid) == before
    assert _run(srv, rid)["status"] == "running"
    # the refusal is counted as such
    metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert 'reason="forbidden"' in metrics

    # the owner and an admin token write it
    assert _traces(srv, owner, rid).status_code == 200
    assert _ingest(srv, srv.token, rid, RunSpec(name="job-a", family="vla-7b", world_size=2, steps=5, seed=2)
                   ).status_code == 200
    assert _traces(srv, srv.token, rid, (1,)).status_code == 200
    after = _stored(srv, rid)
    assert after["traces"] == 4  # rank 0 + its cross-rank row, rank 1 + its cross-rank row (two sources)
    # an unknown run is still "not found" / invalid, not "forbidden"
    assert _traces(srv, foreign, 999_999).status_code == 404
    assert _ingest(srv, foreign, 999_999, spec).status_code == 422


def test_tokens_of_one_team_share_their_runs(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    a, b = create_token(eng, "vision-a", team="vision"), create_token(eng, "vision-b", team="vision")
    outsider = create_token(eng, "audio", team="audio")
    spec = RunSpec(name="shared", family="vla-7b", world_size=2, steps=2, seed=1)
    rid = _register(srv, a, "shared", 1)
    # a teammate joins the same run by name (and may grow it), writes batches and traces, finishes it
    assert _register(srv, b, "shared", 2, meta={"by": "b"}) == rid
    assert _run(srv, rid)["world_size"] == 2
    assert _ingest(srv, b, rid, spec).status_code == 200
    assert _traces(srv, b, rid, (0, 1)).status_code == 200
    # another team's token: its own run of that name, and 403 on the team's run
    other = _register(srv, outsider, "shared", 8)
    assert other != rid
    before = _stored(srv, rid)
    assert _ingest(srv, outsider, rid, spec).status_code == 403
    assert _traces(srv, outsider, rid).status_code == 403
    assert _stored(srv, rid) == before
    assert httpx.post(f"{srv.url}/api/v1/runs/{rid}/finish", json={"status": "finished"}, headers=_h(b),
                      timeout=30).status_code == 200
    run = _run(srv, rid)
    assert run["status"] == "finished" and run["world_size"] == 2 and run["meta"].get("by") == "b"
    assert _run(srv, other)["world_size"] == 8


def test_a_squatted_name_does_not_capture_the_real_job_of_64_ranks(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    attacker, victim = create_token(eng, "squatter"), create_token(eng, "trainer")
    squat = _register(srv, attacker, "llm-pretrain-7", 1, meta={"squat": True})

    ranks = 64
    spec = RunSpec(name="llm-pretrain-7", family="vla-7b", world_size=ranks, steps=2, seed=3)

    def rank_job(rank: int) -> tuple[int, int, int]:
        with httpx.Client(base_url=srv.url, headers=_h(victim), timeout=120) as c:
            r = c.post("/api/v1/runs", json={"name": "llm-pretrain-7", "model_family": "vla-7b",
                                             "world_size": ranks})
            assert r.status_code == 200, r.text
            rid = int(r.json()["id"])
            body, headers, n = _batch(rid, spec, rank)
            for _ in range(60):  # like the agent: 64 batches at once may meet admission (503 + Retry-After)
                r = c.post("/api/v1/ingest", content=body, headers=headers)
                if r.status_code not in (429, 503):
                    break
                time.sleep(min(float(r.headers["retry-after"]), 1.0))
            return rid, r.status_code, n

    with ThreadPoolExecutor(ranks) as pool:
        results = list(pool.map(rank_job, range(ranks)))
    ids = {rid for rid, _, _ in results}
    assert len(ids) == 1 and squat not in ids, (ids, squat)
    rid = ids.pop()
    assert [code for _, code, _ in results] == [200] * ranks
    expected = sum(n for _, _, n in results)
    assert expected == ranks * spec.steps

    deadline = time.monotonic() + 60
    while _run(srv, rid)["rank_steps"] != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    job = _run(srv, rid)
    assert job["rank_steps"] == expected and job["world_size"] == ranks
    # the squatter's run is untouched: world size 1, its meta, nothing written into it
    s = _run(srv, squat)
    assert s["world_size"] == 1 and s["meta"] == {"squat": True} and s["rank_steps"] == 0
    assert _stored(srv, squat) == {"rank_steps": 0, "traces": 0}

    # registering the name again gets the squatter its own run back, never the job's; it cannot write the job
    assert _register(srv, attacker, "llm-pretrain-7", 262_144, meta={"owned": 1}) == squat
    assert _ingest(srv, attacker, rid, spec, 0).status_code == 403
    job2 = _run(srv, rid)
    assert job2["world_size"] == ranks and "owned" not in job2["meta"] and job2["rank_steps"] == expected


def test_registering_another_owners_name_later_changes_nothing_of_its_run(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    victim, attacker = create_token(eng, "trainer"), create_token(eng, "late-squatter")
    rid = _register(srv, victim, "finetune", 4, meta={"lr": 1})
    assert httpx.post(f"{srv.url}/api/v1/runs/{rid}/finish", json={"status": "finished"}, headers=_h(victim),
                      timeout=30).status_code == 200
    before = _run(srv, rid)
    mine = _register(srv, attacker, "finetune", 100_000, meta={"lr": 666, "x": 1}, config={"evil": True})
    assert mine != rid
    after = _run(srv, rid)
    for k in ("world_size", "status", "meta", "config", "finished_at", "name"):
        assert after[k] == before[k], k
    assert after["status"] == "finished" and after["world_size"] == 4
    # both runs are listed under the name, newest first
    listed = httpx.get(f"{srv.url}/api/v1/runs", params={"name": "finetune"}, timeout=30).json()["runs"]
    assert [r["id"] for r in listed] == [mine, rid]


def test_a_run_without_owner_stays_writable_by_any_ingest_token(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    # registered with auth disabled (or before migration 0005): owner_key ''
    legacy = int(register_run(eng, RunRegistration(name="legacy", model_family="vla-7b", world_size=2))["id"])
    with eng.connect() as c:
        assert c.execute(text("SELECT owner_key FROM runs WHERE id = :r"), {"r": legacy}).scalar_one() == ""
    tok = create_token(eng, "any-agent")
    spec = RunSpec(name="legacy", family="vla-7b", world_size=2, steps=2, seed=1)
    assert _ingest(srv, tok, legacy, spec).status_code == 200
    assert _traces(srv, tok, legacy).status_code == 200
    stored = _stored(srv, legacy)
    assert stored == {"rank_steps": 4, "traces": 2}
    # registering the name with a token opens a run in the token's namespace (it does not join '')
    assert _register(srv, tok, "legacy", 2) != legacy
    assert httpx.post(f"{srv.url}/api/v1/runs/{legacy}/finish", json={"status": "finished"}, headers=_h(tok),
                      timeout=30).status_code == 200


def test_a_trace_rank_outside_the_world_size_is_422_naming_it(live_server: Any) -> None:
    srv = live_server
    rid = _register(srv, srv.token, "small", 2)
    r = _traces(srv, srv.token, rid, (0, 2))
    assert r.status_code == 422 and r.json()["detail"].startswith("ranks.2:") and "world size 2" in r.json()["detail"]
    assert _stored(srv, rid)["traces"] == 0
    assert _traces(srv, srv.token, rid, (0, 1)).status_code == 200


def test_the_owner_cache_is_bounded_and_forgets_deleted_runs(live_server: Any) -> None:
    srv = live_server
    eng = srv.state.engine
    tok = create_token(eng, "cache")
    ids = [_register(srv, tok, f"c{i}", 1) for i in range(5)]
    owners = RunOwners(eng, max_entries=3)
    assert [owners.owner_key(i) for i in ids] == ["token:" + str(_token_id(eng, "cache"))] * 5
    assert len(owners) == 3
    assert owners.owner_key(999_999) is None and len(owners) == 3  # unknown runs are not cached
    # deleting a run over the API makes the server forget it: its id then reads as unknown (422), not 403/200
    spec = RunSpec(name="c4", family="vla-7b", world_size=1, steps=1, seed=1)
    assert _ingest(srv, tok, ids[4], spec).status_code == 200
    assert httpx.delete(f"{srv.url}/api/v1/runs/{ids[4]}", headers=_h(srv.token), timeout=30).status_code == 200
    r = _ingest(srv, tok, ids[4], spec)
    assert r.status_code == 422, r.text


def _token_id(engine: Any, name: str) -> int:
    with engine.connect() as c:
        return int(c.execute(text("SELECT id FROM api_tokens WHERE name = :n"), {"n": name}).scalar_one())
