"""torch.distributed collectives are recorded once init ran: op, group size, NCCL-tests bytes,
duration, exposed part; aggregated per (op, group, size bucket) above the threshold; restored at
finish; no device synchronisation on the (fake) GPU path."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import agent_testutil as util  # noqa: E402
import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, parts_sum  # noqa: E402
from fleetscope.agent import collectives  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: Any) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("coll")
    mp.spawn(util.collectives_worker, args=(2, str(d / "store"), str(d)), nprocs=2, join=True)
    return [util.load(str(d / f"rank{r}.json")) for r in range(2)]


def _plan(doc: dict[str, Any]) -> dict[str, int]:
    (ev,) = [e for e in doc["events"] if e["kind"] == "plan"]
    return ev["data"]["index"]


# (op, bytes) per planned call; bytes as NCCL-tests sizes them, world of 2 ranks
EXPECTED = {
    "all_reduce": ("all_reduce", 1000 * 4),
    "all_gather": ("all_gather", 2 * 100 * 4),  # the gathered output: n × the 400-byte input
    "all_gather_into_tensor": ("all_gather", 2 * 250 * 4),
    "reduce_scatter_tensor": ("reduce_scatter", 2 * 500 * 4),  # the full input
    "all_to_all_single": ("all_to_all", 2 * 64 * 4),  # the full input
    "broadcast": ("broadcast", 300 * 8),
    "reduce": ("reduce", 10 * 8),
    "barrier": ("barrier", 0),
    "async_all_reduce": ("all_reduce", 2048 * 4),
}


def test_every_collective_recorded_with_exact_bytes_and_group_size(
    two_rank_job: list[dict[str, Any]],
) -> None:
    for rank, doc in enumerate(two_rank_job):
        plan = _plan(doc)
        by_step = {}
        for c in doc["collectives"]:
            by_step.setdefault(c["step"], []).append(c)
        for name, (op, nbytes) in EXPECTED.items():
            (c,) = by_step[plan[name]]
            assert (c["op"], c["bytes"], c["group_size"], c["calls"], c["seq"]) == (op, nbytes, 2, 1, 0), name
            assert c["total_s"] > 0 and 0 <= c["exposed_s"] <= c["total_s"]
            assert c["start_ts"] >= doc["steps"][plan[name]]["ts"]
        p2p = "send" if rank == 0 else "recv"
        for name, nbytes in (("send_recv", 7 * 4), ("isend_irecv", 9 * 4), ("batch_isend_irecv", 5 * 4)):
            (c,) = by_step[plan[name]]
            assert (c["op"], c["bytes"], c["group_size"]) == (p2p, nbytes, 2), name
        (c,) = by_step[plan["subgroup"]]
        assert (c["op"], c["group_size"], c["bytes"]) == ("all_reduce", 1, 64)


def test_blocking_collectives_are_exposed_and_sum_into_the_step(two_rank_job: list[dict[str, Any]]) -> None:
    for doc in two_rank_job:
        plan = _plan(doc)
        for name in ("all_reduce", "broadcast", "barrier", "all_gather"):
            step = doc["steps"][plan[name]]
            (c,) = [c for c in doc["collectives"] if c["step"] == plan[name]]
            assert c["exposed_s"] == c["total_s"]  # a blocking call: the thread waited throughout
            assert step["comm_total_s"] == pytest.approx(c["total_s"], rel=1e-9)
            assert step["comm_exposed_s"] == pytest.approx(c["total_s"], rel=1e-9)
        for step in doc["steps"]:
            assert parts_sum(step) == pytest.approx(step["step_s"], rel=1e-9, abs=1e-12)
            assert step["comm_total_s"] >= step["comm_exposed_s"] * (1 - 1e-9)


def test_many_calls_in_a_step_are_aggregated_by_size_bucket(two_rank_job: list[dict[str, Any]]) -> None:
    for doc in two_rank_job:
        step = len(_plan(doc))  # the step after the plan: 80 all-reduces of 160 and 16 bytes
        calls = [c for c in doc["collectives"] if c["step"] == step]
        assert sorted((c["op"], c["group_size"], c["bytes"], c["calls"]) for c in calls) == [
            ("all_reduce", 2, 40 * 16, 40),
            ("all_reduce", 2, 40 * 160, 40),
        ]
        assert [c["seq"] for c in calls] == [0, 1]
        assert sum(c["total_s"] for c in calls) == pytest.approx(doc["steps"][step]["comm_total_s"], rel=1e-9)


def test_collective_between_steps_goes_to_the_next_step_but_not_its_time(
    two_rank_job: list[dict[str, Any]],
) -> None:
    for doc in two_rank_job:
        step = len(_plan(doc)) + 1
        (c,) = [c for c in doc["collectives"] if c["step"] == step]
        assert c["op"] == "barrier" and c["total_s"] > 0
        assert doc["steps"][step]["comm_total_s"] == 0.0  # it happened before the step began


def test_async_work_wait_is_the_exposed_part(two_rank_job: list[dict[str, Any]]) -> None:
    for doc in two_rank_job:
        plan = _plan(doc)
        (c,) = [c for c in doc["collectives"] if c["step"] == plan["async_all_reduce"]]
        step = doc["steps"][plan["async_all_reduce"]]
        assert 0 <= c["exposed_s"] <= c["total_s"]
        assert step["comm_exposed_s"] == pytest.approx(c["exposed_s"], rel=1e-6, abs=1e-7)


def test_message_bytes_rules() -> None:
    t = torch.ones(10, dtype=torch.float16)
    assert collectives.message_bytes("t0", t) == 20
    assert collectives.message_bytes("l0", [t, t, torch.ones(3)]) == 52
    assert collectives.message_bytes("ll0", [[t], [t, t]]) == 60
    assert collectives.message_bytes("", None) == 0


def test_finish_restores_torch_distributed(tmp_path: Any) -> None:
    names = [n for n in collectives.WRAPPED if hasattr(dist, n)]
    before = {n: getattr(dist, n) for n in names}
    wait = dist.Work.wait
    run = fs.init("restore", transport=FakeTransport)
    assert all(getattr(dist, n) is not before[n] for n in names)
    assert dist.all_reduce is dist.distributed_c10d.all_reduce  # one wrapper for both modules
    assert dist.isend is dist.distributed_c10d.isend  # P2POp's identity check still passes
    assert dist.Work.wait is not wait
    run.finish()
    assert all(getattr(dist, n) is before[n] for n in names)
    assert dist.Work.wait is wait and not collectives.installed()


def test_single_process_group_records_and_ddp_hook_matches_default(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = fs.init("single", transport=FakeTransport)
        tx = FakeTransport.instances[-1]
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        ref = torch.nn.Linear(8, 8)
        ddp = DDP(torch.nn.Linear(8, 8))
        ddp.module.load_state_dict(ref.state_dict())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        run.instrument(model=ddp, optimizer=opt)
        x = torch.randn(4, 8)
        ddp(x).sum().backward()
        ref(x).sum().backward()
        # the timed hook reduces exactly like DDP's default (world of 1: the gradient itself)
        assert torch.allclose(ddp.module.weight.grad, ref.weight.grad)
        opt.step()
        with run.step():
            work = dist.all_reduce(torch.ones(1000), async_op=True)
            work.wait()
        run.finish()
        steps, colls = tx.steps(), tx.collectives()
        assert len(steps) == 2
        assert [(c["step"], c["op"], c["bytes"], c["group_size"]) for c in colls] == [
            (0, "all_reduce", 4 * (64 + 8), 1),
            (1, "all_reduce", 4000, 1),
        ]
    finally:
        dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
        dist.destroy_process_group()


def test_no_device_synchronisation_with_cuda_timing(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Collectives, waits and steps under the CUDA clock on a fake device: 0 syncs, 0 .item()."""
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = fs.init("gpu-sync", transport=FakeTransport, clock="cuda")
        tx = FakeTransport.instances[-1]
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.instrument(model=model, optimizer=opt)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            dist.all_reduce(torch.ones(16))
            dist.all_reduce(torch.ones(16), async_op=True).wait()
            opt.step()
        dev.done_upto = dev.host + 10**9
        run.finish(timeout=1.0)
        assert dev.syncs == 0
        assert len(tx.steps()) == 3 and len(tx.collectives()) == 6
        for s in tx.steps():
            assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
    finally:
        dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
        dist.destroy_process_group()


def _fake_all_reduce(seconds: float) -> Any:
    """A collective with ``all_reduce``'s signature that takes ``seconds`` (no transfer)."""
    import time

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        time.sleep(seconds)

    return all_reduce


def test_fast_path_moves_blocking_calls_out_of_their_phase(tmp_path: Any) -> None:
    """The generated wrapper's hot path (host clock, blocking, training thread) leaves the call's time
    in its phase until the step ends; then it is exposed comm, exactly, one call or 70 (aggregated)."""
    import time

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = fs.init("fast-path", transport=FakeTransport, clock="cpu", flops_per_step=1.0)
        tx = FakeTransport.instances[-1]
        slow = collectives._make_wrapper("all_reduce", _fake_all_reduce(0.004))
        quick = collectives._make_wrapper("all_reduce", _fake_all_reduce(0.0))
        assert slow.__code__.co_filename == "<fleetscope wrapper of all_reduce>"  # not the generic one
        t = torch.ones(8)
        with run.step():
            with run.phase("backward"):
                time.sleep(0.002)
                slow(t)
                slow(t, group=None)
        with run.step():
            with run.phase("forward"):
                for _ in range(70):
                    quick(t)
            with run.phase("backward"):
                slow(t)
        run.finish()
        s0, s1 = tx.steps()
        colls = tx.collectives()
        c0 = [c for c in colls if c["step"] == 0]
        assert [(c["op"], c["bytes"], c["group_size"], c["calls"], c["seq"]) for c in c0] == [
            ("all_reduce", 32, 1, 1, 0),
            ("all_reduce", 32, 1, 1, 1),
        ]
        assert all(c["exposed_s"] == c["total_s"] >= 0.004 for c in c0)
        assert s0["comm_exposed_s"] == s0["comm_total_s"] == pytest.approx(sum(c["total_s"] for c in c0))
        assert 0.002 <= s0["backward_s"] < 0.004  # the phase's own time, the waits left out
        c1 = [c for c in colls if c["step"] == 1]
        assert sum(c["calls"] for c in c1) == 71  # above the threshold: aggregated by size bucket
        assert s1["comm_exposed_s"] == pytest.approx(s1["comm_total_s"], rel=1e-12)
        assert s1["backward_s"] < 0.004 <= s1["comm_exposed_s"]
        for s in (s0, s1):
            assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-12, abs=0)
        assert run.stats()["internal_errors"] == 0
    finally:
        dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
        dist.destroy_process_group()


def test_fast_path_nested_call_other_thread_and_failing_collective(tmp_path: Any) -> None:
    import threading

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = fs.init("fast-edges", transport=FakeTransport, clock="cpu", flops_per_step=1.0)
        tx = FakeTransport.instances[-1]
        inner = collectives._make_wrapper("all_reduce", _fake_all_reduce(0.0))

        def outer_fn(
            output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
        ) -> None:
            inner(input_tensor)  # torch's helpers call other collectives: one collective, not two

        outer = collectives._make_wrapper("all_gather_into_tensor", outer_fn)

        def broken(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
            raise RuntimeError("connection reset by peer")

        failing = collectives._make_wrapper("all_reduce", broken)
        t = torch.ones(4)
        with run.step():
            with run.phase("forward"):
                outer(torch.empty(4), t)
                th = threading.Thread(target=inner, args=(t,))  # e.g. an async checkpointer's barrier
                th.start()
                th.join()
            with pytest.raises(RuntimeError, match="connection reset"):
                with run.phase("backward"):
                    failing(t)
            with run.phase("optimizer"):
                pass
        run.finish()
        (s,) = tx.steps()
        ops = [(c["op"], c["bytes"]) for c in tx.collectives()]
        assert ops == [("all_gather", 16), ("all_reduce", 16), ("all_reduce", 16)]
        other_thread = tx.collectives()[1]
        assert other_thread["exposed_s"] == 0  # issued by another thread: the loop did not wait
        assert s["optimizer_s"] is not None and s["backward_s"] is not None
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-12, abs=0)
        assert run.stats()["internal_errors"] == 0
    finally:
        dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
        dist.destroy_process_group()
