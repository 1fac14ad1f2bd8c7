"""Ingest over real HTTP into real Postgres: formats, validation, auth, idempotency, backpressure."""

from __future__ import annotations

import gzip
import json
import threading
from typing import Any

import httpx
import msgpack
import pytest
from sqlalchemy import text

from fleetscope.client import ApiError, columnar
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS, encode_batch


def _spec(name: str = "r1", ranks: int = 4, steps: int = 6) -> RunSpec:
    return RunSpec(name=name, family="vla-7b", world_size=ranks, steps=steps, seed=1)


def _batch(run_id: int, spec: RunSpec, lo: int = 0, hi: int | None = None) -> dict[str, Any]:
    rows, colls = [], []
    for step, rs in rank_step_rows(spec, lo, hi):
        rows += rs
        colls += collective_rows(spec, step, rs)
    return {"v": 1, "run_id": run_id, "rank_steps": columnar(rows, RANK_STEP_FIELDS),
            "collectives": columnar(colls, COLLECTIVE_FIELDS)}


def _counts(engine: Any) -> dict[str, int]:
    with engine.connect() as c:
        return {
            t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
            for t in ("ingest_fragments", "modality_raw", "steps", "run_events", "ranks")
        }


def _post(srv: Any, body: bytes, headers: dict[str, str], token: str | None = "default") -> httpx.Response:
    h = dict(headers)
    if token:
        h["Authorization"] = f"Bearer {srv.token if token == 'default' else token}"
    return httpx.post(f"{srv.url}/api/v1/ingest", content=body, headers=h, timeout=30)


def _register(srv: Any, spec: RunSpec) -> int:
    with srv.client() as c:
        return c.register_run(spec.run_info())


def test_msgpack_gzip_batch_is_stored_and_compacted(db_url: str) -> None:
    from conftest import start_server

    # no background compactor (it folds complete steps every 0.2 s): the pass below is the one that folds
    live_server = start_server(db_url, compact_interval_s=3600.0)
    try:
        spec = _spec()
        rid = _register(live_server, spec)
        body, headers = encode_batch(_batch(rid, spec))
        r = _post(live_server, body, headers)
        assert r.status_code == 200, r.text
        assert r.json()["accepted"]["rank_steps"] == 24
        assert r.json()["accepted"]["collectives"] == 96
        res = live_server.compact()
        assert res.rank_steps == 24 and res.steps == 6
        c = _counts(live_server.state.engine)
        assert c["ingest_fragments"] == 0 and c["steps"] == 6
        with live_server.client() as cl:
            s = cl.summary(rid)
        assert s["rank_steps"] == 24 and s["collective_records"] == 96 and s["steps"] == 6
    finally:
        live_server.stop()


def test_zstd_batch_is_stored_like_gzip_and_registration_offers_it(live_server: Any) -> None:
    spec = _spec()
    r = httpx.post(f"{live_server.url}/api/v1/runs", json=spec.run_info(),
                   headers={"Authorization": f"Bearer {live_server.token}"}, timeout=30)
    assert r.status_code == 200 and set(r.json()["ingest_encodings"]) == {"gzip", "zstd"}
    rid = r.json()["id"]
    batch = _batch(rid, spec)
    zbody, zheaders = encode_batch(batch, encoding="zstd")
    gbody, _ = encode_batch(batch)
    assert zheaders["Content-Encoding"] == "zstd" and zbody != gbody
    r = _post(live_server, zbody, zheaders)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"]["rank_steps"] == 24 and r.json()["accepted"]["collectives"] == 96
    live_server.compact()  # folds what the background compactor (every 0.2 s) has not folded yet
    with live_server.client() as cl:
        assert cl.summary(rid)["rank_steps"] == 24


def test_zstd_bodies_are_bounded_and_checked(db_url: str) -> None:
    import zstandard
    from conftest import start_server

    srv = start_server(db_url)
    try:
        srv.state.settings.max_decoded_bytes = 10_000
        payload = b"[" + b"0," * 100_000 + b"0]"
        for content_size in (True, False):  # with and without the frame's declared size
            bomb = zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(payload)
            r = _post(srv, bomb, {"Content-Type": "application/json", "Content-Encoding": "zstd"})
            assert r.status_code == 413, r.text
        good = zstandard.ZstdCompressor().compress(b"[1, 2]")
        for bad in (b"not zstd at all", good[:-2]):
            r = _post(srv, bad, {"Content-Type": "application/json", "Content-Encoding": "zstd"})
            assert r.status_code == 400 and "zstd" in r.json()["detail"]["error"], r.text
        assert set(_counts(srv.state.engine).values()) == {0}
    finally:
        srv.stop()


def test_json_and_row_form_are_accepted(live_server: Any) -> None:
    spec = _spec(ranks=2, steps=2)
    rid = _register(live_server, spec)
    names = [f.name for f in RANK_STEP_FIELDS]
    records = [{"kind": "rank_step", **dict(zip(names, row, strict=True))} for _, rows in rank_step_rows(spec) for row in rows]
    records.append({"kind": "rank", "rank": 1, "host": "h1", "node": "n1", "local_rank": 1, "device": "cpu"})
    records.append({"kind": "event", "event": "checkpoint", "rank": 0, "seq": 1, "ts": 1.0, "step": 0, "data": {"s": 2}})
    body = json.dumps({"v": 1, "run_id": rid, "records": records}).encode()
    r = _post(live_server, body, {"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == {"rank_steps": 4, "collectives": 0, "modality_tokens": 0, "phases": 0, "ranks": 1, "events": 1}
    c = _counts(live_server.state.engine)
    assert c["ingest_fragments"] == 1 and c["ranks"] == 1 and c["run_events"] == 1


BAD_CASES = [
    # (mutation, expected status, text that must appear in the error)
    (lambda b: b["rank_steps"]["step_s"].__setitem__(3, float("nan")), 422, "rank_steps.step_s[3]"),
    (lambda b: b["rank_steps"]["data_s"].__setitem__(5, float("inf")), 422, "rank_steps.data_s[5]"),
    (lambda b: b["rank_steps"]["compute_s"].__setitem__(2, -0.5), 422, "rank_steps.compute_s[2]"),
    (lambda b: b["rank_steps"]["tokens"].__setitem__(1, "many"), 422, "rank_steps.tokens[1]"),
    (lambda b: b["rank_steps"]["tokens"].__setitem__(4, 1.5), 422, "rank_steps.tokens[4]"),
    (lambda b: b["rank_steps"]["rank"].__setitem__(0, 99), 422, "rank_steps.rank[0]"),
    (lambda b: b["rank_steps"]["step_s"].__setitem__(6, None), 422, "rank_steps.step_s[6]"),
    (lambda b: b["rank_steps"].__setitem__("bogus", [1] * 24), 422, "rank_steps.bogus"),
    (lambda b: b["rank_steps"]["step"].pop(), 422, "rank_steps.step"),
    (lambda b: b["collectives"]["op"].__setitem__(7, "allreduce_typo"), 422, "collectives.op[7]"),
    (lambda b: b["collectives"]["exposed_s"].__setitem__(9, 1e6), 422, "collectives.exposed_s[9]"),
    (lambda b: b.__setitem__("run_id", 424242), 422, "run_id"),
    (lambda b: b.__setitem__("run_id", "one"), 422, "run_id"),
    (lambda b: b.__setitem__("extra", 1), 422, "extra"),
    (lambda b: b.__setitem__("v", 99), 422, "v"),
    (lambda b: b.__setitem__("events", [{"rank": 0, "seq": 1, "kind": "x", "data": {"a": float("nan")}}]), 422, "events[0].data.a"),
    (lambda b: b.__setitem__("ranks", [{"rank": 0, "host": 5}]), 422, "ranks[0].host"),
]


@pytest.mark.parametrize("mutate,status,where", BAD_CASES, ids=[c[2] for c in BAD_CASES])
def test_bad_batch_is_rejected_naming_record_and_field_and_nothing_is_written(
    live_server: Any, mutate: Any, status: int, where: str
) -> None:
    spec = _spec()
    rid = _register(live_server, spec)
    batch = _batch(rid, spec)
    mutate(batch)
    body, headers = encode_batch(batch)
    r = _post(live_server, body, headers)
    assert r.status_code == status, r.text
    assert where in r.json()["detail"]["error"], r.json()
    assert set(_counts(live_server.state.engine).values()) == {0}


def test_row_form_errors_name_the_record_index(live_server: Any) -> None:
    spec = _spec(ranks=2, steps=2)
    rid = _register(live_server, spec)
    recs = [{"kind": "rank_step", "rank": 0, "step": i, "step_s": 1.0} for i in range(3)]
    recs.append({"kind": "gpu_temperature", "rank": 0})
    r = _post(live_server, json.dumps({"run_id": rid, "records": recs}).encode(), {"Content-Type": "application/json"})
    assert r.status_code == 422 and "records[3].kind" in r.json()["detail"]["error"]
    recs[3] = {"kind": "rank_step", "rank": 0, "step": 3, "step_s": -1.0}
    r = _post(live_server, json.dumps({"run_id": rid, "records": recs}).encode(), {"Content-Type": "application/json"})
    assert r.status_code == 422 and "records[3].step_s" in r.json()["detail"]["error"]
    assert set(_counts(live_server.state.engine).values()) == {0}


@pytest.mark.parametrize(
    "body,headers,status",
    [
        (b"\x1f\x8b\x08garbage", {"Content-Type": "application/msgpack", "Content-Encoding": "gzip"}, 400),
        (b"\xc1\xc1\xc1", {"Content-Type": "application/msgpack"}, 400),
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b"<xml/>", {"Content-Type": "text/xml"}, 415),
        (b"{}", {"Content-Type": "application/json", "Content-Encoding": "br"}, 415),
        (msgpack.packb([1, 2, 3]), {"Content-Type": "application/msgpack"}, 422),
    ],
    ids=["bad-gzip", "bad-msgpack", "bad-json", "xml", "brotli", "not-an-object"],
)
def test_malformed_bodies_get_4xx(live_server: Any, body: bytes, headers: dict[str, str], status: int) -> None:
    r = _post(live_server, body, headers)
    assert r.status_code == status, r.text
    assert r.json()["detail"]


def test_missing_or_wrong_token_is_401_and_writes_nothing(live_server: Any) -> None:
    spec = _spec()
    rid = _register(live_server, spec)
    body, headers = encode_batch(_batch(rid, spec))
    assert _post(live_server, body, headers, token=None).status_code == 401
    assert _post(live_server, body, headers, token="fs_wrong").status_code == 401
    r = httpx.post(f"{live_server.url}/api/v1/ingest", content=body, headers={**headers, "Authorization": "Basic abc"})
    assert r.status_code == 401
    assert set(_counts(live_server.state.engine).values()) == {0}
    # registration needs a token too
    r = httpx.post(f"{live_server.url}/api/v1/runs", json={"name": "x"})
    assert r.status_code == 401


def test_tokens_are_stored_only_as_hashes(live_server: Any) -> None:
    with live_server.state.engine.connect() as c:
        rows = c.execute(text("SELECT * FROM api_tokens")).fetchall()
    dump = json.dumps([[str(v) for v in r] for r in rows])
    assert live_server.token not in dump
    assert live_server.token[10:30] not in dump


def test_oversized_body_is_413_and_writes_nothing(db_url: str) -> None:
    from conftest import start_server

    srv = start_server(db_url, max_body_bytes=2000)
    try:
        spec = _spec()
        rid = _register(srv, spec)
        body, headers = encode_batch(_batch(rid, spec), compress=False)
        assert len(body) > 2000
        r = _post(srv, body, headers)
        assert r.status_code == 413
        # a gzip bomb: small on the wire, huge decompressed
        srv.state.settings.max_body_bytes = 1 << 20
        srv.state.settings.max_decoded_bytes = 10_000
        bomb = gzip.compress(b"[" + b"0," * 100_000 + b"0]")
        r = _post(srv, bomb, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert r.status_code == 413
        assert set(_counts(srv.state.engine).values()) == {0}
    finally:
        srv.stop()


def test_retried_batch_is_not_duplicated(live_server: Any) -> None:
    spec = _spec()
    rid = _register(live_server, spec)
    with live_server.client() as c:
        b = _batch(rid, spec)
        c.ingest(b)
        c.ingest(b)  # a retry of the same batch
        assert c.summary(rid)["rank_steps"] == 24  # deduplicated before compaction too
        live_server.compact()
        c.ingest(b)  # a retry after compaction
        s = c.summary(rid)
        assert s["rank_steps"] == 24 and s["collective_records"] == 96
        live_server.compact()
        s = c.summary(rid)
        assert s["rank_steps"] == 24 and s["collective_records"] == 96 and s["steps"] == 6
    with live_server.state.engine.connect() as conn:
        assert conn.execute(text("SELECT sum(records) FROM run_collectives")).scalar_one() == 96


def test_overlapping_batches_after_partial_failure_are_not_duplicated(live_server: Any) -> None:
    spec = _spec(steps=10)
    rid = _register(live_server, spec)
    with live_server.client() as c:
        c.ingest(_batch(rid, spec, 0, 4))
        live_server.compact()
        c.ingest(_batch(rid, spec, 2, 7))  # re-sent 2..3 plus new 4..6
        c.ingest(_batch(rid, spec, 5, 10))
        live_server.compact()
        s = c.summary(rid)
    assert s["rank_steps"] == 40 and s["steps"] == 10 and s["collective_records"] == 160
    with live_server.state.engine.connect() as conn:
        assert conn.execute(text("SELECT sum(n_ranks) FROM steps")).scalar_one() == 40


def test_concurrent_senders_of_the_same_data_store_it_once(live_server: Any) -> None:
    spec = _spec(ranks=8, steps=8)
    rid = _register(live_server, spec)
    # each rank sends its own rows (as the agent does), twice, from 8 threads at once
    per_rank: dict[int, list[tuple]] = {}
    for _, rows in rank_step_rows(spec):
        for row in rows:
            per_rank.setdefault(row[0], []).append(row)
    errors: list[BaseException] = []

    def send(rank: int) -> None:
        try:
            with live_server.client() as c:
                for _ in range(2):
                    c.ingest_rows(rid, per_rank[rank])
                    live_server.state.compactor.run_once()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    live_server.compact()
    with live_server.client() as c:
        s = c.summary(rid)
    assert s["rank_steps"] == 64 and s["steps"] == 8


def test_late_rank_is_merged_into_the_compacted_step(live_server: Any) -> None:
    spec = _spec(ranks=4, steps=1)
    rid = _register(live_server, spec)
    (_, rows), = list(rank_step_rows(spec))
    with live_server.client() as c:
        c.ingest_rows(rid, rows[:3])
        live_server.compact()  # forced: step 0 compacted with 3 ranks
        c.ingest_rows(rid, rows[3:])
        live_server.state.compactor.run_once()  # not forced: merged because the block exists
        s = c.summary(rid)
    assert s["rank_steps"] == 4 and s["steps"] == 1
    with live_server.state.engine.connect() as conn:
        n, ranks = conn.execute(text("SELECT n_ranks, ranks::text FROM steps")).one()
    assert n == 4 and ranks == "1111"


def test_overload_answers_503_with_retry_after(live_server: Any) -> None:
    from fleetscope.server.ingest import Admission

    spec = _spec()
    rid = _register(live_server, spec)
    live_server.state.ingest.admission = Admission(concurrency=1, queue=0)
    adm = live_server.state.ingest.admission
    body, headers = encode_batch(_batch(rid, spec))
    adm._sem.acquire()  # the only writer is busy
    adm.waiting = 0
    try:
        r = _post(live_server, body, headers)
    finally:
        adm._sem.release()
    assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
    live_server.state.ingest.backlog_max_rows = -1  # any backlog is too much
    r = _post(live_server, body, headers)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    live_server.state.ingest.backlog_max_rows = 10**9
    assert _post(live_server, body, headers).status_code == 200


def test_client_retries_after_overload(live_server: Any) -> None:
    spec = _spec()
    rid = _register(live_server, spec)
    live_server.state.ingest.backlog_max_rows = -1

    def clear() -> None:
        live_server.state.ingest.backlog_max_rows = 10**9

    threading.Timer(1.5, clear).start()
    with live_server.client() as c:
        assert c.ingest(_batch(rid, spec))["accepted"]["rank_steps"] == 24
    with pytest.raises(ApiError):
        with live_server.client(token="nope") as c:
            c.ingest(_batch(rid, spec))


def test_server_restart_keeps_data(db_url: str) -> None:
    from conftest import start_server

    srv = start_server(db_url)
    spec = _spec()
    try:
        rid = _register(srv, spec)
        with srv.client() as c:
            c.ingest(_batch(rid, spec, 0, 3))
    finally:
        srv.stop()  # shutdown compacts what landed
    srv = start_server(db_url)
    try:
        with srv.client() as c:
            c.ingest(_batch(rid, spec, 3, 6))
            srv.compact()
            s = c.summary(rid)
        assert s["rank_steps"] == 24 and s["steps"] == 6
    finally:
        srv.stop()


def test_steps_known_only_from_collectives_compact(live_server: Any) -> None:
    """A job that dies inside its first step sends the collectives it issued but no rank_step: the
    compactor folds them (it failed on such a pass: the per-step medians of no rank-step rows) and the
    run's reads answer."""
    spec = _spec(name="died-in-step-0", ranks=2, steps=1)
    rid = _register(live_server, spec)
    names = [f.name for f in COLLECTIVE_FIELDS]
    rows = [(rank, 0, seq, "all_reduce", 2, 4096, 1, 0.002, 0.002, 1_800_000_000.0 + seq, "world")
            for rank in (0, 1) for seq in range(3)]
    records = [{"kind": "collective", **dict(zip(names, row, strict=True))} for row in rows]
    r = _post(live_server, json.dumps({"v": 1, "run_id": rid, "records": records}).encode(),
              {"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    res = live_server.compact()  # raised IndexError before
    assert res.collectives == 6 and res.rank_steps == 0
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/collectives", timeout=10).json()["collectives"]
    assert [(c["op"], c["calls"], c["bytes"]) for c in colls] == [("all_reduce", 6, 6 * 4096.0)]
    s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary", timeout=30)
    assert s.status_code == 200 and s.json()["rank_steps"] == 0, s.text
