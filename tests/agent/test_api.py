"""The agent's public API with a fake transport: step decomposition, phases, tokens, run
registration, environment detection, error containment."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, ScriptedClock, parts_sum  # noqa: E402
from fleetscope.agent import env  # noqa: E402
from fleetscope.agent.collective_marks import coll_begin, coll_end, ddp_issue  # noqa: E402
from fleetscope.agent.step_state import BACKWARD, FLAG_NEGATIVE_RESIDUAL  # noqa: E402

from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402


@pytest.fixture
def make_run(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "FLEETSCOPE_DISABLED",
    ):
        monkeypatch.delenv(var, raising=False)
    runs: list[Any] = []

    def make(name: str = "api-test", **kw: Any) -> tuple[Any, FakeTransport]:
        kw.setdefault("collectives", False)
        run = fs.init(name, transport=FakeTransport, **kw)
        runs.append(run)
        return run, FakeTransport.instances[-1]

    yield make
    for r in runs:
        r.finish()


def test_decomposition_sums_exactly_and_exposed_comm_leaves_its_phase(make_run: Any) -> None:
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    with run.step(tokens=100, samples=4, padded_tokens=128) as s:
        with s.phase("data"):
            clock.now = 10
        with run.phase("forward"):
            clock.now = 30
        with run.phase("backward"):
            clock.now = 40
            call = coll_begin(run, "all_reduce", (2, "world"), 4000, True)  # blocking: the thread waits
            clock.now = 50
            coll_end(run, call, True)
            clock.now = 60
        with run.phase("optimizer"):
            clock.now = 65
        with run.phase("ema_update"):  # a custom phase: compute
            clock.now = 70
        clock.now = 75
    (st,) = tx.steps()
    assert st["step_s"] == 75e-9
    assert st["data_s"] == 10e-9
    assert st["forward_s"] == 20e-9
    assert st["backward_s"] == 20e-9  # 30 minus the 10 spent waiting on the all-reduce
    assert st["optimizer_s"] == 5e-9
    assert st["compute_s"] == 50e-9  # forward + backward + optimizer + custom
    assert st["comm_exposed_s"] == 10e-9
    assert st["comm_total_s"] == 10e-9
    assert st["other_s"] == 5e-9
    assert parts_sum(st) == pytest.approx(st["step_s"], rel=1e-12, abs=0)
    assert (st["tokens"], st["samples"], st["padded_tokens"], st["flags"]) == (100, 4, 128, 0)
    (coll,) = tx.collectives()
    assert (coll["op"], coll["group_size"], coll["bytes"], coll["calls"]) == ("all_reduce", 2, 4000, 1)
    assert coll["exposed_s"] == coll["total_s"] == 10e-9


def test_negative_residual_is_flagged_not_silently_clamped(make_run: Any) -> None:
    """A DDP bucket tail longer than the phase it was measured in is a measurement error."""
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    with run.step():
        with run.phase("backward"):
            clock.now = 2
            call = ddp_issue(run, (2, "world"), 1024)
            assert call[7] == BACKWARD
            clock.now = 10
        clock.now = 30
        call[4] = 100  # completion reported past the step's end: impossible for a real reducer
    (st,) = tx.steps()
    # the 98 ns tail does not fit in the 10 ns backward phase it came from: flagged, and only the
    # phase's own time is moved, so the components still sum to the step (the server rejects rows
    # whose components exceed step_s)
    assert st["flags"] & FLAG_NEGATIVE_RESIDUAL
    assert st["backward_s"] == 0.0
    assert st["comm_exposed_s"] == 10e-9
    assert st["other_s"] == 20e-9
    assert parts_sum(st) == pytest.approx(st["step_s"], rel=1e-12, abs=0)
    assert run.stats()["negative_residuals"] == 1


def test_ddp_tail_moves_from_backward_to_exposed_comm(make_run: Any) -> None:
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    with run.step():
        with run.phase("backward"):
            clock.now = 10
            a = ddp_issue(run, (2, "world"), 4096)  # bucket 1, overlapped with the rest of backward
            clock.now = 30
            b = ddp_issue(run, (2, "world"), 2048)  # the last bucket: compute is over
            a[4] = 35
            clock.now = 50
            b[4] = 50  # the reducer waited from 30 to 50
        clock.now = 55
    (st,) = tx.steps()
    assert st["comm_exposed_s"] == 20e-9
    assert st["backward_s"] == 30e-9  # 50 measured, 20 of them waiting
    assert st["comm_total_s"] == 45e-9  # 25 + 20
    assert parts_sum(st) == pytest.approx(st["step_s"], rel=1e-12, abs=0)
    c1, c2 = tx.collectives()
    assert (c1["bytes"], c1["exposed_s"]) == (4096, 5e-9)  # 30..35 lies past the last issue
    assert (c2["bytes"], c2["exposed_s"]) == (2048, 15e-9)  # 35..50
    assert st["flags"] == 0


def test_nested_phases_and_a_custom_phase_first_seen_inside_a_step(make_run: Any) -> None:
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    with run.step():
        clock.now = 5
        with run.phase("forward"):
            clock.now = 15
            with run.phase("attention_kernel_tuning"):  # created now: the step's table grows
                clock.now = 40
                with run.phase("attention_kernel_tuning"):  # re-entered: the stack, not the object
                    clock.now = 50
                clock.now = 55
            clock.now = 60
        clock.now = 61
        run.phase("backward").__exit__(None, None, None)  # an exit without its enter: ignored
        clock.now = 70
    (st,) = tx.steps()
    assert st["forward_s"] == 15e-9  # 5..15 and 55..60
    assert st["compute_s"] == 55e-9  # forward 15 + the custom phase 40 (15..55)
    assert st["other_s"] == 15e-9 and st["backward_s"] is None and st["data_s"] is None
    assert parts_sum(st) == pytest.approx(st["step_s"], rel=1e-12, abs=0)
    with run.step():  # the next step starts from zero, the custom phase known
        with run.phase("attention_kernel_tuning"):
            clock.now = 75
    st = tx.steps()[1]
    assert st["compute_s"] == 5e-9 and st["forward_s"] is None


def test_rss_is_read_at_most_every_100_ms_of_the_step_clock(make_run: Any) -> None:
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    reads = []
    sample = run._mem.sample
    run._mem.sample = lambda: reads.append(clock.now) or sample()
    for _ in range(5):
        with run.step():
            clock.now += 40_000_000  # 40 ms steps
    assert reads == [40_000_000, 160_000_000]
    mems = [s["mem_allocated_bytes"] for s in tx.steps()]
    assert all(m is None or m > 0 for m in mems) and len(set(mems)) <= 2


def test_rank_step_tuple_follows_the_wire_layout(make_run: Any) -> None:
    run, tx = make_run()
    with run.step(tokens=5):
        pass
    (rec,) = tx.of("rank_step")
    assert isinstance(rec, tuple) and len(rec) == len(RANK_STEP_FIELDS)
    st = tx.steps()[0]
    assert st["rank"] == 0 and st["step"] == 0 and st["step_s"] > 0
    assert st["data_s"] is None and st["forward_s"] is None  # not measured, not zero
    assert st["comm_total_s"] is None  # collectives not recorded in this run
    assert st["mem_allocated_bytes"] is None or st["mem_allocated_bytes"] > 0


def test_tokens_per_modality_and_counts_accumulate(make_run: Any) -> None:
    run, tx = make_run()
    with run.step(tokens={"vision": 300, "text": 100}, padded_tokens=512, samples=2) as s:
        s.count(tokens={"text": 20, "action": 7}, samples=1)
        run.count(padded_tokens=64)
    st = tx.steps()[0]
    assert st["tokens"] == 427 and st["padded_tokens"] == 576 and st["samples"] == 3
    mods = {m["modality"]: m["tokens"] for m in tx.modalities()}
    assert mods == {"vision": 300, "text": 120, "action": 7}
    assert all(m["step"] == 0 and m["rank"] == 0 for m in tx.modalities())


def test_steps_are_numbered_and_prebuilt_objects_reused(make_run: Any) -> None:
    run, tx = make_run(start_step=100)
    assert run.step() is run.step() and run.phase("forward") is run.phase("forward")
    for _ in range(3):
        with run.step():
            with run.phase("forward"):
                pass
    with run.step(step=500):
        pass
    assert [s["step"] for s in tx.steps()] == [100, 101, 102, 500]
    assert run.step_index == 501


def test_failed_step_is_not_submitted_and_the_exception_propagates(make_run: Any) -> None:
    run, tx = make_run()
    with pytest.raises(ZeroDivisionError):
        with run.step():
            with run.phase("forward"):
                1 / 0  # noqa: B018
    with run.step():
        pass
    assert [s["step"] for s in tx.steps()] == [0]
    assert run.stats()["steps_aborted"] == 1


def test_phases_outside_a_step_are_ignored(make_run: Any) -> None:
    run, tx = make_run()
    with run.phase("forward"):
        pass
    with run.phase("data"):  # e.g. wrapping next(loader) before the step opens
        with run.step():
            with run.phase("forward"):
                pass
    st = tx.steps()[0]
    assert st["data_s"] is None and st["forward_s"] is not None
    assert run.stats()["internal_errors"] == 0


def test_internal_errors_never_reach_the_training_loop(make_run: Any) -> None:
    run, tx = make_run()

    def broken(kind: str, record: Any) -> None:
        raise RuntimeError("transport bug")

    run._submit = broken
    for _ in range(3):
        with run.step(tokens=1):
            with run.phase("forward"):
                pass
    assert run.stats()["internal_errors"] == 3


def test_run_registration_and_rank_record(make_run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    run, tx = make_run("reg-test", model_family="vla-7b", config={"lr": 3e-4, "tp": 1}, dtype="bf16")
    info = tx.run_info
    assert info["name"] == "reg-test" and info["model_family"] == "vla-7b"
    assert info["config"] == {"lr": 3e-4, "tp": 1}
    assert info["world_size"] == 1 and info["git_commit"] == "abc123"
    assert {
        "name",
        "model_family",
        "config",
        "world_size",
        "device_type",
        "device_count",
        "peak_flops",
        "git_commit",
        "meta",
    } <= set(info)
    assert info["meta"]["host"] and info["meta"]["dtype"] == "bf16"
    (rank,) = tx.of("rank")
    assert set(rank) == {"rank", "host", "node", "local_rank", "device"} and rank["rank"] == 0
    assert fs.get_run() is run
    run.finish()
    assert tx.status == "finished" and tx.closed and fs.get_run() is None
    run.finish("failed")  # idempotent
    assert tx.status == "finished"


def test_events_are_numbered_per_rank_and_across_restarts(make_run: Any) -> None:
    run, tx = make_run()
    run.event("checkpoint", duration_s=1.5)
    with run.step():
        pass
    run.event("eval", step=7)
    e1, e2 = tx.of("event")
    assert (e1["kind"], e1["step"], e1["data"]) == ("checkpoint", 0, {"duration_s": 1.5})
    assert (e2["kind"], e2["step"]) == ("eval", 7)
    # consecutive, and a process started later (a restart) numbers above this one
    assert e2["seq"] == e1["seq"] + 1 and 0 < e1["seq"] < 2**30
    run2, tx2 = make_run()
    run2._event_seq += 4  # as if started one second later
    run2.event("restart")
    assert tx2.of("event")[0]["seq"] > e2["seq"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (
            {
                "RANK": "5",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "1",
                "GROUP_RANK": "2",
                "TORCHELASTIC_RUN_ID": "j1",
            },
            (5, 16, 1, 2, "j1", "torchrun"),
        ),
        (
            {
                "SLURM_PROCID": "9",
                "SLURM_NTASKS": "32",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "4",
                "SLURM_JOB_ID": "777",
                "SLURMD_NODENAME": "gpu-node-4",
            },
            (9, 32, 1, 4, "777", "slurm"),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
            (3, 8, 3, None, None, "mpi"),
        ),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 4, 0, None, None, "pmi")),
        # torchrun inside a SLURM allocation: torchrun's variables describe the trainers
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "1",
                "SLURM_JOB_ID": "99",
            },
            (1, 2, 1, None, "99", "torchrun"),
        ),
        ({}, (0, 1, 0, None, None, "single")),
    ],
)
def test_rank_environment_detection(environ: dict[str, str], expected: tuple[Any, ...]) -> None:
    r = env.detect_rank(environ)
    assert (r.rank, r.world_size, r.local_rank, r.node_rank, r.job_id, r.launcher) == expected
    if "SLURMD_NODENAME" in environ:
        assert r.node == environ["SLURMD_NODENAME"]
    else:
        assert r.node == r.host


def test_device_type_names() -> None:
    assert env.device_type_of("NVIDIA H100 80GB HBM3") == "H100"
    assert env.device_type_of("NVIDIA H100 PCIe") == "H100-PCIe"
    assert env.device_type_of("NVIDIA A100-SXM4-80GB") == "A100"
    assert env.device_type_of("NVIDIA H200") == "H200"
    assert env.device_type_of("NVIDIA B200") == "B200"
    assert env.device_type_of("AMD Instinct MI300X") == "MI300X"
    assert env.device_type_of("NVIDIA GH200 480GB") == "NVIDIA GH200 480GB"  # not in the table


def test_git_commit_from_env_repo_or_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_COMMIT", "deadbeef")
    assert env.git_commit(str(tmp_path)) == "deadbeef"
    monkeypatch.delenv("GIT_COMMIT")
    assert env.git_commit(str(tmp_path)) is None  # not a repository
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert env.git_commit(str(tmp_path)) == head


def test_init_twice_finishes_the_previous_run(make_run: Any) -> None:
    r1, t1 = make_run("first")
    r2, t2 = make_run("second")
    assert r1.finished and t1.status == "finished" and fs.get_run() is r2


def test_agent_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="clock"):
        fs.init("bad", transport=FakeTransport, clock="sundial")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_inherits_an_inert_run(make_run: Any) -> None:
    run, tx = make_run()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: must neither measure nor submit
        n = len(tx.records)
        with run.step(tokens=1):
            with run.phase("forward"):
                pass
        run.finish()
        os._exit(0 if run.finished and len(tx.records) == n and tx.status is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with run.step():
        pass
    assert len(tx.steps()) == 1 and not run.finished


def test_records_pass_the_transport_and_the_server_validator(make_run: Any) -> None:
    """Contract check: what the agent submits is well-formed for the transport's batch builder and
    accepted, field by field, by the server's ingest validation."""
    from fleetscope.agent.transport import build_batch
    from fleetscope.server.validate import validate_batch
    run, tx = make_run()
    clock = ScriptedClock()
    run._use_clock(clock)
    for k in range(3):
        with run.step(tokens={"vision": 10, "text": 5}, padded_tokens=20, samples=1):
            with run.phase("forward"):
                clock.now += 7
                c = coll_begin(run, "all_gather", (1, "world"), 2048, True)
                clock.now += 3
                coll_end(run, c, True)
            with run.phase("backward"):
                d = ddp_issue(run, (1, "world"), 4096)
                clock.now += 5
                d[4] = clock.now + 2  # the tail: the reducer waits 2 more
                clock.now += 2
            clock.now += 1
        run.event("checkpoint", step=k, path="ckpt", seconds=1.0)
    run.finish()
    batch, n, dropped = build_batch(list(tx.records))
    assert dropped == {} and n == len(tx.records)
    batch["run_id"] = 1
    valid = validate_batch(batch, lambda run_id: 1)
    assert valid.n_records == n
