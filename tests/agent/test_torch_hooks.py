"""Automatic PyTorch instrumentation: loader/forward/optimizer hooks in one process, a real 2-process
gloo job under DDP and under FSDP2, and the GPU path on a fake CUDA device (lazy events, no syncs)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import agent_testutil as util  # noqa: E402
import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, parts_sum  # noqa: E402
from fleetscope.agent.collective_marks import coll_begin, coll_end  # noqa: E402
from fleetscope.agent.run import FLAG_FLOPS_MEASURED  # noqa: E402

torch.set_num_threads(1)


def _mlp() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loader(n_batches: int, batch: int = 4) -> Any:
    ds = torch.utils.data.TensorDataset(torch.randn(n_batches * batch, 16), torch.randn(n_batches * batch, 4))
    return torch.utils.data.DataLoader(ds, batch_size=batch)


@pytest.fixture
def run_tx(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    runs: list[Any] = []

    def make(**kw: Any) -> tuple[Any, FakeTransport]:
        kw.setdefault("collectives", False)
        r = fs.init("hooks-test", transport=FakeTransport, **kw)
        runs.append(r)
        return r, FakeTransport.instances[-1]

    yield make
    for r in runs:
        r.finish()


def _train(model: Any, opt: Any, loader: Any, accumulate: int = 1) -> int:
    n = 0
    for i, (x, y) in enumerate(loader):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            n += 1
    return n


def test_every_batch_is_one_step_with_all_phases(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.instrument(
        model=model,
        optimizer=opt,
        dataloader=_loader(5),
        counts=lambda b: {"tokens": 10 * len(b[0]), "padded_tokens": 16 * len(b[0])},
    )
    for _epoch in range(2):
        assert _train(model, opt, loader) == 5
    steps = tx.steps()
    assert [s["step"] for s in steps] == list(range(10))  # the exhausted next() leaves no step
    for s in steps:
        for k in ("data_s", "forward_s", "backward_s", "optimizer_s"):
            assert s[k] is not None and s[k] >= 0, k
        assert s["compute_s"] == pytest.approx(s["forward_s"] + s["backward_s"] + s["optimizer_s"], abs=1e-12)
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
        assert (s["tokens"], s["padded_tokens"]) == (40, 64)
    assert run.stats()["steps_discarded"] == 2  # one per epoch end
    assert run.stats()["internal_errors"] == 0


def test_gradient_accumulation_makes_one_step_per_optimizer_step(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run.instrument(model=model, optimizer=opt, dataloader=(loader := _loader(6)))
    assert _train(model, opt, loader, accumulate=3) == 2
    steps = tx.steps()
    assert len(steps) == 2
    assert [s["samples"] for s in steps] == [12, 12]  # default counts: batch dimension, 3 batches
    for s in steps:
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)


def test_eval_forward_outside_a_step_does_not_open_one(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run.instrument(model=model, optimizer=opt)  # no loader: forward starts the step
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)  # evaluation between steps
        model.eval()
        model(x)
        model.train()
    steps = tx.steps()
    assert len(steps) == 3
    for s in steps:
        assert s["data_s"] is None and s["forward_s"] > 0
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)


def test_manual_step_adopts_the_step_the_loader_opened(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.instrument(model=model, optimizer=opt, dataloader=_loader(3))
    for x, y in loader:
        with run.step(tokens=7):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # does not end a manual step
            with run.phase("logging"):
                pass
    steps = tx.steps()
    assert len(steps) == 3
    for s in steps:
        assert s["data_s"] is not None and s["tokens"] == 7
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)


def test_plain_iterables_are_wrapped_and_finish_removes_hooks(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(2, 16), torch.randn(2, 4)) for _ in range(3)]
    loader = run.instrument(model=model, optimizer=opt, dataloader=batches)
    assert loader is not batches and len(loader) == 3
    assert _train(model, opt, loader) == 3
    assert len(tx.steps()) == 3
    run.finish()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_flops_measured_once_and_flagged(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.instrument(model=model, optimizer=opt, dataloader=_loader(3))
    _train(model, opt, loader)
    steps = tx.steps()
    # 2·B·in·out per Linear forward; backward: weight grads (same) + input grad of the 2nd layer only
    fwd = 2 * 4 * (16 * 32 + 32 * 4)
    expected = fwd + fwd + 2 * 4 * 32 * 4
    assert [s["flops"] for s in steps] == [expected] * 3
    assert [bool(s["flags"] & FLAG_FLOPS_MEASURED) for s in steps] == [True, False, False]
    assert tx.run_info["meta"]["flops_source"] == "measured"
    (ev,) = [e for e in tx.of("event") if e["kind"] == "flops"]
    assert ev["data"]["flops"] == expected and ev["step"] == 0


# ---------------------------------------------------------------------- multi-process, gloo
def _spawn(worker: Any, tmp_path: Any, *args: Any) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, str(tmp_path / "store"), str(tmp_path), *args), nprocs=2, join=True)
    return [util.load(str(tmp_path / f"rank{r}.json")) for r in range(2)]


STEPS = 4


def test_ddp_two_ranks_every_step_decomposed_with_exact_collective_bytes(tmp_path: Any) -> None:
    docs = _spawn(util.ddp_worker, tmp_path, STEPS)
    param_bytes = 4 * (32 * 64 + 64 + 64 * 8 + 8)
    for rank, doc in enumerate(docs):
        assert doc["status"] == "finished"
        assert doc["run_info"]["world_size"] == 2 and doc["run_info"]["name"] == "ddp-test"
        assert doc["ranks"] == [
            {
                "rank": rank,
                "host": doc["ranks"][0]["host"],
                "node": doc["ranks"][0]["node"],
                "local_rank": rank,
                "device": "cpu",
            }
        ]
        steps = doc["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS)) and {s["rank"] for s in steps} == {rank}
        for s in steps:
            assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
            assert s["comm_total_s"] >= s["comm_exposed_s"] > 0
            assert s["forward_s"] is not None and s["backward_s"] is not None and s["optimizer_s"] is not None
            assert (s["tokens"], s["samples"]) == (64, 4)
        by_step: dict[int, list[dict[str, Any]]] = {}
        for c in doc["collectives"]:
            by_step.setdefault(c["step"], []).append(c)
            assert c["group_size"] == 2 and c["calls"] == 1
            assert 0 <= c["exposed_s"] <= c["total_s"]
        assert sorted(by_step) == list(range(STEPS))
        for step, calls in by_step.items():
            assert [c["seq"] for c in calls] == list(range(len(calls)))
            ops = [(c["op"], c["bytes"]) for c in calls]
            # DDP's gradient buckets (through the comm hook) carry every parameter's gradient once
            grads = sum(b for op, b in ops[:-3] if op == "all_reduce")
            assert grads == param_bytes, (step, ops)
            # then the loop's own collectives, in order
            assert ops[-3:] == [("all_reduce", 4000), ("all_gather", 2000), ("all_reduce", 256)]
            step_rec = doc["steps"][step]
            assert sum(c["total_s"] for c in calls) == pytest.approx(step_rec["comm_total_s"], rel=1e-9)


def test_fsdp2_two_ranks_all_gathers_and_reduce_scatters(tmp_path: Any) -> None:
    import torch.distributed.fsdp  # noqa: F401  (FSDP2 ships with torch >= 2.4)
    docs = _spawn(util.fsdp_worker, tmp_path, STEPS)
    unsharded = [4 * (32 * 64 + 64), 4 * (64 * 8 + 8)]
    for doc in docs:
        steps = doc["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS))
        for s in steps:
            assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
            assert s["comm_exposed_s"] > 0  # gloo collectives block the training thread
        for step in range(STEPS):
            calls = [c for c in doc["collectives"] if c["step"] == step]
            gathers = sorted(c["bytes"] for c in calls if c["op"] == "all_gather")
            scatters = sorted(c["bytes"] for c in calls if c["op"] == "reduce_scatter")
            # forward and backward each all-gather every layer (NCCL-tests size: the gathered
            # output); backward reduce-scatters every layer's full gradient
            assert gathers == sorted(unsharded * 2), gathers
            assert scatters == sorted(unsharded), scatters
            assert all(c["group_size"] == 2 for c in calls)


# ---------------------------------------------------------------------- GPU path, fake device
def test_cuda_events_resolve_lazily_without_any_synchronisation(
    run_tx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    run, tx = run_tx(clock="cuda")
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.instrument(model=model, optimizer=opt, dataloader=_loader(6))
    it = iter(loader)
    for _ in range(3):  # the device is "behind": nothing may be resolved or submitted yet
        x, y = next(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert tx.steps() == [] and run.stats()["pending_steps"] == 3
    dev.done_upto = dev.host  # the device catches up; the next step's end resolves them
    for x, y in it:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dev.done_upto = dev.host + 10**9
    run.finish(timeout=1.0)
    steps = tx.steps()
    assert [s["step"] for s in steps] == list(range(6))
    for s in steps:
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
        assert s["step_s"] > 0 and s["forward_s"] > 0
        assert (s["mem_allocated_bytes"], s["mem_reserved_bytes"], s["mem_peak_bytes"]) == (1000, 4000, 3000)
        assert s["alloc_retries"] == 3  # a delta per step (10 happened before the run), not the total
    assert dev.syncs == 0
    assert dev.recorded > 0 and run.stats()["clock"] == "cuda"


def test_cuda_steps_never_completed_are_dropped_at_finish_not_waited_for(
    run_tx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    run, tx = run_tx(clock="cuda", memory_every_steps=0)
    for _ in range(2):
        with run.step():
            with run.phase("forward"):
                pass
    run.finish(timeout=0.2)
    assert tx.steps() == [] and run.stats()["steps_dropped_unresolved"] == 2
    assert dev.syncs == 0 and tx.status == "finished"


def test_collective_on_a_side_stream_is_overlapped_not_exposed(
    run_tx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    run, tx = run_tx(clock="cuda", memory_every_steps=0)
    with run.step():
        with run.phase("forward"):
            dev.stream = "all_gather_stream"  # FSDP issues its all-gathers on its own stream
            c = coll_begin(run, "all_gather", (8, "world"), 1 << 20, True)
            coll_end(run, c, True)
            dev.stream = "main"
            c = coll_begin(run, "all_reduce", (8, "world"), 1 << 10, True)
            coll_end(run, c, True)
    dev.done_upto = dev.host
    run.finish(timeout=1.0)
    (s,) = tx.steps()
    ag, ar = tx.collectives()
    assert ag["exposed_s"] == 0 and ag["total_s"] > 0
    assert ar["exposed_s"] == ar["total_s"] > 0
    assert s["comm_exposed_s"] == pytest.approx(ar["total_s"])
    assert dev.syncs == 0


def test_steps_inside_a_cuda_graph_capture_record_nothing_and_are_dropped(
    run_tx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    run, tx = run_tx(clock="cuda", memory_every_steps=0)
    with run.step():
        pass
    dev.capturing = True  # recording an event now would invalidate the user's graph
    recorded = dev.recorded
    with run.step():
        with run.phase("forward"):
            pass
    assert dev.recorded == recorded
    dev.capturing = False
    with run.step():
        pass
    dev.done_upto = dev.host
    run.finish(timeout=1.0)
    assert [s["step"] for s in tx.steps()] == [0, 2]
    assert run.stats()["steps_in_graph_capture"] == 1 and run.stats()["internal_errors"] == 0
