"""The agent transport against a loopback receiver: delivery, retries, spool + replay, drops, fork, exit."""

from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fleetscope.agent.config import AgentConfig
from fleetscope.agent.spool import SEALED_SUFFIX, Spool
from fleetscope.agent.transport import AGENT_EVENT_SEQ_BASE, Transport, build_batch

from fleetscope.upload import upload
from fleetscope.wire import COLLECTIVE_FIELDS, MODALITY_FIELDS, RANK_STEP_FIELDS

try:
    from ._receiver import Receiver
except ImportError:  # tests/agent is not a package
    from _receiver import Receiver

pytestmark = pytest.mark.timeout(60)

RUN = {
    "name": "exp-42",
    "model_family": "vla-7b",
    "config": {"lr": 3e-4},
    "world_size": 8,
    "device_type": "cpu",
}


def cfg(tmp_path: Path, server: str | None, **kw: Any) -> AgentConfig:
    base: dict[str, Any] = dict(
        server=server,
        token="s3cret-token",
        spool_dir=str(tmp_path / "spool"),
        flush_interval_s=0.05,
        batch_max_records=500,
        queue_max_records=50_000,
        request_timeout_s=2.0,
        retry_deadline_s=2.0,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        exit_timeout_s=3.0,
    )
    base.update(kw)
    return AgentConfig(**base)


def step(rank: int, i: int, **values: Any) -> tuple[Any, ...]:
    """A rank_step tuple in RANK_STEP_FIELDS order (unset fields: None, "not measured")."""
    row: dict[str, Any] = {"rank": rank, "step": i, "step_s": 0.1 + i * 1e-6, "ts": 1.7e9 + i, **values}
    return tuple(row.get(f.name) for f in RANK_STEP_FIELDS)


def spool_files(tmp_path: Path) -> list[Path]:
    d = tmp_path / "spool"
    return sorted(p for p in d.iterdir() if p.suffix in (SEALED_SUFFIX, ".part")) if d.exists() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def steps_of(rows: list[dict[str, Any]], rank: int | None = None) -> list[int]:
    return [r["step"] for r in rows if rank is None or r["rank"] == rank]


# -- delivery ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offer,takes_zstd,expect", [
    (["gzip", "zstd"], True, {"zstd"}),  # a server that lists zstd gets zstd
    (None, True, {"gzip"}),  # an older server lists nothing: gzip, which every server takes
    (["gzip", "zstd"], False, {"zstd", "gzip"}),  # listed, then 415 (an older instance behind the address)
], ids=["zstd", "not-offered", "415-falls-back"])
def test_ingest_body_encoding_follows_what_the_server_takes(tmp_path, receiver, offer, takes_zstd, expect):
    receiver.offer_encodings = offer
    receiver.takes_zstd = takes_zstd
    t = Transport(cfg(tmp_path, receiver.url), RUN)
    for i in range(1_200):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=20)
    t.close()
    assert steps_of(receiver.rows("rank_steps")) == list(range(1_200))  # all once, in order, whatever the encoding
    assert set(receiver.encodings) == expect
    if not takes_zstd:
        assert receiver.encodings[0] == "zstd" and set(receiver.encodings[1:]) == {"gzip"}  # one refusal, then gzip
    assert t.stats()["dropped"] == {} and t.stats()["spooled"] == 0


def test_all_records_arrive_once_in_order_preserving_columnar_batches(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url), RUN)
    n = 3_000
    for i in range(n):
        t.submit("rank_step", step(3, i, tokens=4096))
        t.submit("collective", (3, i, 0, "all_reduce", 8, 1 << 20, 1, 0.002, None, None))
    t.submit("modality_tokens", (3, 0, "image", 256))
    t.submit("rank", {"rank": 3, "host": "n1", "node": "n1", "local_rank": 3, "device": "cpu"})
    t.submit(
        "event", {"rank": 3, "seq": 0, "kind": "checkpoint", "ts": 1.7e9, "step": 10, "data": {"path": "x"}}
    )
    assert t.flush(timeout=20)
    t.close()

    rows = receiver.rows("rank_steps")
    assert steps_of(rows) == list(range(n))  # every record exactly once, in submission order
    assert steps_of(receiver.rows("collectives")) == list(range(n))
    assert receiver.rows("modality_tokens") == [{"rank": 3, "step": 0, "modality": "image", "tokens": 256}]
    assert [r["host"] for b in receiver.batches for r in b.get("ranks", [])] == ["n1"]
    assert [e["kind"] for e in receiver.events()] == ["checkpoint"]
    assert len(receiver.batches) >= (2 * n) // 500  # batched by size
    for b in receiver.batches:
        assert b["v"] == 1 and b["run_id"] == receiver.runs["exp-42"]
        for section in ("rank_steps", "collectives"):
            if section in b:
                assert len({len(col) for col in b[section].values()}) == 1  # columnar, equal lengths
        if "rank_steps" in b:
            cols = b["rank_steps"]
            assert {"rank", "step", "step_s", "ts", "tokens"} == set(cols)  # all-None columns omitted
    assert receiver.run_posts[0] == RUN
    st = t.stats()
    assert st["sent"] == 2 * n + 3 and st["submitted"] == 2 * n + 3
    assert st["spooled"] == 0 and st["dropped"] == {}
    assert spool_files(tmp_path) == []


def test_build_batch_omits_unmeasured_columns_and_keeps_bad_rows_out():
    items = [
        ("rank_step", step(0, 1, data_s=float("nan"))),
        ("rank_step", step(0, 2, data_s=0.01)),
        ("rank_step", (0, 3)),  # wrong width
        ("rank_step", step(0, 4, step_s=None)),  # required value missing
        ("collective", (0, 1, 0, "all_gather", 4, 10, 1, 0.1, None, None)),
        ("modality_tokens", tuple(["image"] * len(MODALITY_FIELDS))),
        ("nonsense", 1),
        ("event", "not a dict"),
    ]
    batch, n, dropped = build_batch(items)
    assert batch["rank_steps"]["step"] == [1, 2]
    assert batch["rank_steps"]["data_s"] == [None, 0.01]  # NaN means "not measured"
    assert "forward_s" not in batch["rank_steps"]
    assert set(batch["collectives"]) == {f.name for f in COLLECTIVE_FIELDS if f.required}
    assert n == 4 and batch["run_id"] is None
    assert dropped == {"malformed": 3, "unknown_kind": 1}


def test_finish_run_is_sent_after_the_data(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url), RUN)
    for i in range(10):
        t.submit("rank_step", step(0, i))
    t.finish_run("finished")
    t.close()
    assert steps_of(receiver.rows()) == list(range(10))
    assert receiver.finishes == [(receiver.runs["exp-42"], "finished")]
    assert [p for p, _ in receiver.log][-1].endswith("/finish")


# -- failures of the server ---------------------------------------------------------------------------


def test_retryable_answers_are_retried_until_delivered_once(tmp_path, receiver):
    receiver.plan.extend([500, ("status", 503, 0), "garbage", "close", ("status", 429, 0), 502, 504])
    t = Transport(cfg(tmp_path, receiver.url, retry_deadline_s=10.0), RUN)
    for i in range(100):
        t.submit("rank_step", step(1, i))
    assert t.flush(timeout=20)
    assert steps_of(receiver.rows()) == list(range(100))
    st = t.stats()
    assert st["retries"] >= 7 and st["spooled"] == 0 and st["dropped"] == {}
    t.close()


def test_retry_after_is_honoured_within_the_deadline_then_spooled(tmp_path, receiver):
    receiver.plan.extend([("status", 503, 30)])  # asks for more than the retry deadline allows
    t = Transport(cfg(tmp_path, receiver.url, retry_deadline_s=1.0), RUN)
    t.submit("rank_step", step(0, 0))
    assert t.flush(timeout=10)
    assert receiver.ingest_requests() == 1  # did not hammer: waiting 30 s would pass the deadline
    assert t.stats()["spooled"] == 1
    t.close()


def test_server_down_spools_and_replays_in_order_when_it_returns(tmp_path):
    port = free_port()
    t = Transport(cfg(tmp_path, f"http://127.0.0.1:{port}", retry_deadline_s=0.3), RUN)
    for chunk in range(3):
        for i in range(chunk * 100, chunk * 100 + 100):
            t.submit("rank_step", step(0, i))
        assert t.flush(timeout=10)
    st = t.stats()
    assert st["spooled"] == 300 and st["sent"] == 0 and st["server_down"]
    assert spool_files(tmp_path)

    r = Receiver(port=port).start()
    try:
        for i in range(300, 310):
            t.submit("rank_step", step(0, i))
        assert wait_until(lambda: len(r.rows()) >= 310, timeout=15)
        t.flush(timeout=10)
        rows = steps_of(r.rows())
        assert sorted(rows) == list(range(310))  # 0 lost, 0 duplicated
        replayed = [s for s in rows if s < 300]
        assert replayed == sorted(replayed)  # the spool replays in order
        st = t.stats()
        assert st["replayed"] == 300 and st["sent"] == 10 and not st["server_down"]
        assert wait_until(lambda: spool_files(tmp_path) == [])  # deleted once accepted
        t.close()
    finally:
        r.stop()


def test_replay_interrupted_by_a_new_outage_resumes_without_resending(tmp_path):
    port = free_port()
    t = Transport(cfg(tmp_path, f"http://127.0.0.1:{port}", retry_deadline_s=0.3), RUN)
    for k in range(10):  # ten frames in the spool
        for i in range(k * 10, k * 10 + 10):
            t.submit("rank_step", step(0, i))
        assert t.flush(timeout=10)
    assert t.stats()["spooled"] == 100
    r = Receiver(port=port)
    r.plan.extend(["ok"] * 4)  # four frames go through, then the server fails again
    r.default = ("status", 503, 0)
    r.start()
    try:
        assert wait_until(lambda: t.stats()["replayed"] >= 40 and t.stats()["server_down"])
        r.default = "ok"  # back for good: no live data needed, the spool itself probes
        assert wait_until(lambda: t.stats()["replayed"] == 100)
        steps = steps_of(r.rows())
        assert sorted(steps) == list(range(100))  # every frame accepted exactly once
        assert steps == sorted(steps)
        assert wait_until(lambda: spool_files(tmp_path) == [])
        t.close()
    finally:
        r.stop()


def test_submit_work_is_constant_whatever_the_server_does(tmp_path, receiver):
    """O(1) by count: the profiler sees the same few calls per submit, healthy, hung, failing, or full."""
    receiver.plan.extend(["hang"] * 3)
    slow = dict(flush_interval_s=60, request_timeout_s=30, retry_deadline_s=30)
    t = Transport(cfg(tmp_path, receiver.url, batch_max_records=1000, queue_max_records=1000, **slow), RUN)
    t.submit("rank_step", step(0, 0))  # the first submit starts the sender thread (once)
    t.flush(timeout=0)  # wake it now
    assert receiver.ingest_started.wait(10)  # the sender is now stuck on a hung server

    calls: list[str] = []
    submit_code = Transport.submit.__code__

    def prof(frame: Any, event: str, arg: Any) -> None:  # what submit itself calls (not GC callbacks)
        if event == "c_call" and frame.f_code is submit_code:
            calls.append(arg.__name__)
        elif event == "call" and frame.f_back is not None and frame.f_back.f_code is submit_code:
            calls.append(frame.f_code.co_name)

    records = [step(0, i) for i in range(1, 1500)]
    per_submit = []
    gc.disable()  # a collection triggered inside submit would run weakref callbacks that are not submit's
    try:
        for rec in records:  # crosses the queue cap (1000) while the server hangs
            calls.clear()
            sys.setprofile(prof)
            t.submit("rank_step", rec)
            sys.setprofile(None)
            per_submit.append(tuple(calls))
    finally:
        gc.enable()
    wakes = [c for c in per_submit if "set" in c]  # the one notify when the queue first holds a full batch
    assert len(wakes) == 1
    assert not {"write", "send", "sendall", "open", "sleep", "wait"} & set(wakes[0])  # no I/O, no waiting
    rest = [c for c in per_submit if "set" not in c]
    assert {name for c in rest for name in c} <= {"len", "append", "is_set"}
    assert max(len(c) for c in rest) <= 4  # constant work: a few builtin calls per record
    assert rest.count(("len",)) == 499  # a full queue costs one len() and a counter
    assert t.stats()["dropped"]["queue_full"] == 499
    receiver.release.set()
    t.close(timeout=3)


def test_submit_never_raises_on_garbage_input(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url), RUN)
    t.submit("rank_step", None)
    t.submit("no-such-kind", object())
    t.submit("event", 42)
    t.submit("rank_step", step(0, 0))
    assert t.flush(timeout=10)
    t.close()
    assert steps_of(receiver.rows()) == [0]
    assert t.stats()["dropped"] == {"malformed": 2, "unknown_kind": 1}


def test_queue_full_drops_are_counted_and_reported_as_an_event(tmp_path, receiver):
    receiver.plan.append("hold")  # the first batch is held by the server until released
    # only a full batch wakes the sender (so it takes exactly the first 10), and the held request never times out
    big = dict(flush_interval_s=60, request_timeout_s=30, retry_deadline_s=30)
    t = Transport(cfg(tmp_path, receiver.url, batch_max_records=10, queue_max_records=10, **big), RUN)
    for i in range(10):
        t.submit("rank_step", step(2, i))
    assert receiver.ingest_started.wait(10)  # the sender has taken all 10 and waits on the server
    assert wait_until(lambda: t.stats()["queued"] == 0)
    for i in range(10, 25):
        t.submit("rank_step", step(2, i))  # 10 fit, 5 are dropped
    receiver.release.set()
    assert t.flush(timeout=10)
    t.close()
    assert steps_of(receiver.rows()) == list(range(20))
    assert t.stats()["dropped"] == {"queue_full": 5}
    drops = [e for e in receiver.events() if e["kind"] == "agent_drops"]
    assert drops and drops[-1]["data"] == {"queue_full": 5}
    assert drops[-1]["rank"] == 2 and AGENT_EVENT_SEQ_BASE <= drops[-1]["seq"] < 2**31


def test_unauthorized_is_spooled_not_retried_and_the_token_never_logged(tmp_path, receiver, caplog):
    caplog.set_level(logging.DEBUG, logger="fleetscope")
    t = Transport(cfg(tmp_path, receiver.url, token="wrong-token-123"), RUN)
    for i in range(50):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=10)
    t.close()
    assert receiver.log == [("/api/v1/runs", 401)]  # one request, no retries
    assert t.stats()["spooled"] == 50 and t.stats()["dropped"] == {}
    assert "wrong-token-123" not in caplog.text and "refused the token" in caplog.text
    assert sum("refused the token" in r.getMessage() for r in caplog.records) == 1  # logged once

    res = upload(tmp_path / "spool", receiver.url, "s3cret-token")  # the right token: nothing was lost
    assert res["records"] == 50 and res["failed"] == 0
    assert steps_of(receiver.rows()) == list(range(50))


def test_invalid_batch_is_dropped_counted_and_not_retried(tmp_path, receiver, caplog):
    receiver.plan.append(422)
    t = Transport(cfg(tmp_path, receiver.url, flush_interval_s=60), RUN)  # one batch per flush()
    for i in range(7):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=10)
    for i in range(7, 9):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=10)
    t.close()
    assert t.stats()["dropped"] == {"invalid": 7} and t.stats()["spooled"] == 0
    assert steps_of(receiver.rows()) == [7, 8]
    assert [s for p, s in receiver.log if p == "/api/v1/ingest"].count(422) == 1  # not retried
    assert [e["data"] for e in receiver.events() if e["kind"] == "agent_drops"] == [{"invalid": 7}]
    assert "rank_steps.step_s" in caplog.text  # the server's detail is logged (once)
    assert spool_files(tmp_path) == []


def test_invalid_record_named_by_the_server_is_dropped_alone(tmp_path, receiver):
    receiver.plan.extend([("invalid_row", 3), ("invalid_row", 0)])
    t = Transport(cfg(tmp_path, receiver.url, flush_interval_s=60), RUN)  # one batch per flush()
    for i in range(7):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=10)
    t.close()
    assert steps_of(receiver.rows()) == [1, 2, 4, 5, 6]  # step 3, then (index 0 of the rest) step 0
    assert t.stats()["dropped"] == {"invalid": 2} and t.stats()["sent"] == 5 + 1  # + the agent_drops event


def test_the_bad_record_is_found_by_the_structured_loc_alone(tmp_path, receiver):
    """The agent reads ``detail.loc`` {section, index, field} (no parsing of the message or ``where``);
    a loc naming no record, or one outside the batch, drops the whole batch as before."""
    receiver.plan.extend([("invalid_loc", "collectives", 1), ("invalid_loc", "rank_steps", None), "ok"])
    receiver.plan.append(("invalid_loc", "rank_steps", 99))
    t = Transport(cfg(tmp_path, receiver.url, flush_interval_s=60), RUN)  # one batch per flush()
    for i in range(3):
        t.submit("rank_step", step(0, i))
        t.submit("collective", (0, i, 0, "all_reduce", 8, 4096, 1, 0.001, 0.0005, 1.7e9))
    # collective 1 named: the 5 others are resent, then refused naming no record; then the
    # agent_drops event reporting the 6 is accepted
    assert t.flush(timeout=10)
    assert t.stats()["dropped"] == {"invalid": 1 + 5}
    for i in range(3, 5):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=10)  # index 99 is not in the batch: nothing to salvage
    t.close()
    assert t.stats()["dropped"] == {"invalid": 1 + 5 + 2}
    assert steps_of(receiver.rows()) == [] and len(receiver.batches) == 2  # the two agent_drops events
    assert [s for p, s in receiver.log if p == "/api/v1/ingest"].count(422) == 3


def test_too_large_batches_are_split_in_halves(tmp_path, receiver):
    receiver.max_records = 60
    t = Transport(cfg(tmp_path, receiver.url, batch_max_records=500, flush_interval_s=60), RUN)
    for i in range(500):
        t.submit("rank_step", step(0, i))
    assert t.flush(timeout=20)
    t.close()
    assert steps_of(receiver.rows()) == list(range(500))
    assert all(len(b["rank_steps"]["step"]) <= 60 for b in receiver.batches)
    assert t.stats()["dropped"] == {}


def test_close_returns_within_its_budget_when_the_server_hangs(tmp_path, receiver):
    receiver.default = "hang"
    t = Transport(
        cfg(tmp_path, receiver.url, request_timeout_s=30, retry_deadline_s=60, exit_timeout_s=1.0), RUN
    )
    for i in range(20):
        t.submit("rank_step", step(0, i))
    assert receiver.ingest_started.wait(10)  # a request hangs in the sender
    for i in range(20, 40):
        t.submit("rank_step", step(0, i))
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(timeout=1.0 + 4.0)  # the budget, plus slack for a loaded machine
    assert not closer.is_alive(), "close() waited on a hung server"
    assert t.stats()["spooled"] == 40  # nothing waited on, nothing lost
    receiver.release.set()
    receiver.default = "ok"
    assert upload(tmp_path / "spool", receiver.url, "s3cret-token")["records"] == 40
    assert sorted(steps_of(receiver.rows())) == list(range(40))


def test_close_is_idempotent_and_late_records_are_counted(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url), RUN)
    t.submit("rank_step", step(0, 0))
    t.close()
    t.close()
    t.submit("rank_step", step(0, 1))
    assert t.stats()["dropped"] == {"after_close": 1}
    assert steps_of(receiver.rows()) == [0]


# -- offline, spool sharing, orphans -----------------------------------------------------------------


def test_offline_mode_spools_and_upload_delivers_the_same_records(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url, offline=True, batch_max_records=100), RUN)
    for i in range(1_000):
        t.submit("rank_step", step(5, i, tokens=i))
    t.submit("event", {"rank": 5, "seq": 1, "kind": "eval", "ts": 1.7e9, "step": 999, "data": {"acc": 0.5}})
    t.finish_run("finished")
    t.close()
    assert receiver.log == []  # offline: no network at all
    assert t.stats()["spooled"] == 1_001 and spool_files(tmp_path)

    res = upload(tmp_path / "spool", receiver.url, "s3cret-token")
    assert res["records"] == 1_001 and res["failed"] == 0 and res["finished_runs"] == 1
    assert res["runs"] == {"exp-42": receiver.runs["exp-42"]}
    rows = receiver.rows()
    assert steps_of(rows) == list(range(1_000)) and [r["tokens"] for r in rows] == list(range(1_000))
    assert [e["kind"] for e in receiver.events()] == ["eval"]
    assert receiver.finishes == [(receiver.runs["exp-42"], "finished")]
    assert spool_files(tmp_path) == []


def test_full_spool_drops_the_oldest_records_and_counts_them(tmp_path, receiver):
    t = Transport(
        cfg(
            tmp_path,
            receiver.url,
            offline=True,
            batch_max_records=50,
            spool_max_bytes=3000,
            spool_segment_max_bytes=600,
        ),
        RUN,
    )
    for k in range(40):
        for i in range(k * 50, k * 50 + 50):
            t.submit("rank_step", step(0, i))
        assert t.flush(timeout=10)
    t.close()
    st = t.stats()
    lost = st["dropped"]["spool_full"]
    assert lost > 0 and st["spooled"] >= 2000  # + the agent_drops events reporting the loss
    assert sum(p.stat().st_size for p in spool_files(tmp_path)) <= 3000
    assert upload(tmp_path / "spool", receiver.url, "s3cret-token")["records"] == st["spooled"] - lost
    kept = steps_of(receiver.rows())
    assert kept == list(range(2000 - len(kept), 2000))  # the newest survive, contiguous, in order
    last = receiver.events()[-1]
    assert last["kind"] == "agent_drops" and last["data"]["spool_full"] > 0  # the loss is reported as data


def test_ranks_sharing_a_spool_dir_each_replay_their_own_segments(tmp_path):
    port = free_port()
    a = Transport(cfg(tmp_path, f"http://127.0.0.1:{port}", retry_deadline_s=0.2), RUN)
    b = Transport(cfg(tmp_path, f"http://127.0.0.1:{port}", retry_deadline_s=0.2), RUN)
    for i in range(30):
        a.submit("rank_step", step(0, i))
        b.submit("rank_step", step(1, i))
    assert a.flush(timeout=10) and b.flush(timeout=10)
    assert len(spool_files(tmp_path)) == 2  # one file per writer, no interleaving
    r = Receiver(port=port).start()
    try:
        a.submit("rank_step", step(0, 30))
        assert wait_until(lambda: len(r.rows()) == 61)
        assert sorted(steps_of(r.rows(), rank=0)) == list(range(31))  # live first, then the replay
        assert steps_of(r.rows(), rank=1) == list(range(30))  # once: each writer replays its own file
        assert wait_until(lambda: a.stats()["replayed"] == 30 and b.stats()["replayed"] == 30)
        assert wait_until(lambda: spool_files(tmp_path) == [])
        a.close()
        b.close()
    finally:
        r.stop()


def test_segment_of_a_dead_process_is_adopted_and_replayed(tmp_path, receiver):
    # a process that spooled and died (a crashed rank): its pid no longer exists
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(child.stdout)
    orphan = Spool(tmp_path / "spool", max_bytes=1 << 20, segment_max_bytes=1 << 20)
    orphan.pid = dead_pid
    batch, n, _ = build_batch([("rank_step", step(6, i)) for i in range(25)])
    orphan.append({"v": 1, "run_info": RUN, "batch": batch}, n)
    orphan._fd and os.close(orphan._fd)  # the process died: the segment is left as ".part"

    t = Transport(cfg(tmp_path, receiver.url), RUN)
    t.submit("rank_step", step(0, 0))
    assert wait_until(lambda: len(steps_of(receiver.rows(), rank=6)) == 25)
    t.close()
    assert steps_of(receiver.rows(), rank=6) == list(range(25))
    assert t.stats()["replayed"] == 25
    assert spool_files(tmp_path) == []


# -- fork ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_neither_duplicates_parent_records_nor_deadlocks(tmp_path, receiver):
    t = Transport(cfg(tmp_path, receiver.url, flush_interval_s=60, batch_max_records=1000), RUN)
    for i in range(5):
        t.submit("rank_step", step(0, i))  # queued in the parent, not yet sent
    assert t.stats()["queued"] == 5
    pid = os.fork()
    if pid == 0:  # the child: a fresh, lazy transport of its own
        code = 1
        try:
            if t.stats()["queued"] == 0:
                for i in range(3):
                    t.submit("rank_step", step(7, i))
                t.close(timeout=5)
                st = t.stats()
                code = 0 if (st["sent"], st["submitted"]) == (3, 3) else 2
        finally:
            os._exit(code)
    end = time.monotonic() + 20
    status = None
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child deadlocked")
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.flush(timeout=10)
    t.close()
    assert steps_of(receiver.rows(), rank=0) == list(range(5))  # once, not also by the child
    assert steps_of(receiver.rows(), rank=7) == list(range(3))


# -- exit ---------------------------------------------------------------------------------------------

_JOB = """
import sys
from fleetscope.agent.config import AgentConfig
from fleetscope.agent.transport import Transport
url, spool = sys.argv[1], sys.argv[2]
t = Transport(AgentConfig(server=url, token="s3cret-token", spool_dir=spool, flush_interval_s=60,
                          exit_timeout_s=1.0, request_timeout_s=30, retry_deadline_s=60), {"name": "exit-run"})
for i in range(100):
    t.submit("rank_step", (0, i, 0.1) + (None,) * 18)
# no close(): the interpreter exits and atexit flushes
"""


def test_exit_flushes_what_is_queued(tmp_path, receiver):
    subprocess.run(
        [sys.executable, "-c", _JOB, receiver.url, str(tmp_path / "spool")], check=True, timeout=30
    )
    assert steps_of(receiver.rows()) == list(range(100))
    assert spool_files(tmp_path) == []


def test_exit_with_a_hung_server_spools_within_the_budget(tmp_path, receiver):
    receiver.default = "hang"
    # exit_timeout_s=1: the process is done long before the 30 s request timeout (limit: generous slack)
    subprocess.run(
        [sys.executable, "-c", _JOB, receiver.url, str(tmp_path / "spool")], check=True, timeout=15
    )
    receiver.release.set()
    receiver.default = "ok"
    assert [p.suffix for p in spool_files(tmp_path)] == [SEALED_SUFFIX]  # sealed (fsynced) at exit
    assert upload(tmp_path / "spool", receiver.url, "s3cret-token")["records"] == 100
    assert steps_of(receiver.rows()) == list(range(100))


# -- the real server ------------------------------------------------------------------------------


@pytest.mark.timeout(300)  # includes starting the session's embedded Postgres
def test_real_server_takes_every_record_once(tmp_path, live_server):
    """Wire compatibility end to end: batches, the agent_drops event, a named bad record, finish, resend."""
    t = Transport(cfg(tmp_path, live_server.url, token=live_server.token, batch_max_records=400), RUN)
    t.submit("rank", {"rank": 0, "host": "n1", "node": "n1", "local_rank": 0, "device": "cpu"})
    for i in range(1000):
        t.submit("rank_step", step(i % 2, i // 2, tokens=100, data_s=0.01))
        t.submit("collective", (i % 2, i // 2, 0, "all_reduce", 8, 4096, 1, 0.001, 0.0005, 1.7e9))
    t.submit("rank_step", step(0, 9_999, step_s=-1.0))  # the server names it: dropped alone
    t.submit("rank_step", (0, 1))  # malformed: never sent, but reported in an agent_drops event
    t.finish_run("finished")
    t.close(timeout=20)
    st = t.stats()
    assert st["dropped"] == {"malformed": 1, "invalid": 1}  # the agent_drops event itself was accepted
    assert 2002 <= st["sent"] <= 2003  # the records, and one or two agent_drops events (batching decides)
    assert st["spooled"] == 0 and st["finished"] == 1

    c = live_server.client()
    live_server.compact()
    (run,) = c.http.get("/api/v1/runs", params={"name": RUN["name"]}).json()["runs"]
    assert run["rank_steps"] == 1000 and run["status"] == "finished"

    # the same records again (a replay after a crash resends whole segments): nothing doubles
    off = Transport(cfg(tmp_path, live_server.url, offline=True), RUN)
    for i in range(1000):
        off.submit("rank_step", step(i % 2, i // 2, tokens=100, data_s=0.01))
    off.close()
    res = upload(tmp_path / "spool", live_server.url, live_server.token)
    assert res["records"] == 1000 and res["failed"] == 0
    live_server.compact()
    (run,) = c.http.get("/api/v1/runs", params={"name": RUN["name"]}).json()["runs"]
    assert run["rank_steps"] == 1000
    c.close()
