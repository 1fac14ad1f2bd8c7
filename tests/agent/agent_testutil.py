"""Helpers of the agent API tests: a fake transport and a scripted clock satisfying the agent's
protocols (agent/protocols.py), records as dicts, and the worker functions of the multi-process torch
jobs (importable by spawned children)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from fleetscope.wire import COLLECTIVE_FIELDS, MODALITY_FIELDS, RANK_STEP_FIELDS

RS = [f.name for f in RANK_STEP_FIELDS]
CO = [f.name for f in COLLECTIVE_FIELDS]
MO = [f.name for f in MODALITY_FIELDS]


class FakeTransport:
    """A ``fleetscope.agent.protocols.Transport`` (like the real ``transport.Transport``); keeps what it
    is given.

    With ``path``, ``close`` writes everything to that JSON file (multi-process tests)."""

    instances: list[FakeTransport] = []

    def __init__(self, config: Any, run_info: dict[str, Any], path: str | None = None) -> None:
        self.config = config
        self.run_info = run_info
        self.path = path
        self.records: list[tuple[str, Any]] = []
        self.status: str | None = None
        self.closed = False
        self.flushes = 0
        FakeTransport.instances.append(self)

    def submit(self, kind: str, record: Any) -> None:
        self.records.append((kind, record))

    def flush(self, timeout: float | None = None) -> bool:
        self.flushes += 1
        return True

    def close(self, timeout: float | None = None) -> None:
        self.closed = True
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"run_info": self.run_info, "records": self.records, "status": self.status}, f)

    def finish_run(self, status: str) -> None:
        self.status = status

    def stats(self) -> dict[str, Any]:
        return {"records": len(self.records)}

    # views
    def of(self, kind: str) -> list[Any]:
        return [r for k, r in self.records if k == kind]

    def steps(self) -> list[dict[str, Any]]:
        return [dict(zip(RS, r, strict=True)) for r in self.of("rank_step")]

    def collectives(self) -> list[dict[str, Any]]:
        return [dict(zip(CO, r, strict=True)) for r in self.of("collective")]

    def modalities(self) -> list[dict[str, Any]]:
        return [dict(zip(MO, r, strict=True)) for r in self.of("modality_tokens")]


class ScriptedClock:
    """A host clock the test moves by hand: every mark reads ``now`` (ns)."""

    kind = "cpu"

    def __init__(self) -> None:
        self.now = 0

    def mark(self) -> int:
        return self.now

    mark_async = mark

    @staticmethod
    def ready(m: Any) -> bool:
        return True

    @staticmethod
    def elapsed_ns(a: int, b: int) -> int:
        return b - a

    def release(self, marks: Any) -> None:
        return None

    def on_main_stream(self) -> bool:
        return True

    def set_main_stream(self) -> None:
        return None


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        doc = json.load(f)
    recs = doc["records"]
    doc["steps"] = [dict(zip(RS, r, strict=True)) for k, r in recs if k == "rank_step"]
    doc["collectives"] = [dict(zip(CO, r, strict=True)) for k, r in recs if k == "collective"]
    doc["events"] = [r for k, r in recs if k == "event"]
    doc["ranks"] = [r for k, r in recs if k == "rank"]
    return doc


def parts_sum(s: dict[str, Any]) -> float:
    """data + compute + exposed comm + other of a rank_step record (None counts as 0)."""
    return (s["data_s"] or 0.0) + s["compute_s"] + (s["comm_exposed_s"] or 0.0) + s["other_s"]


# ---------------------------------------------------------------------- multi-process workers
def _dist_setup(rank: int, world: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), GROUP_RANK="0")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _init_run(out_dir: str, rank: int, name: str, **kw: Any) -> Any:
    import functools

    import fleetscope.agent as fs

    path = os.path.join(out_dir, f"rank{rank}.json")
    return fs.init(name, transport=functools.partial(FakeTransport, path=path), **kw)


def ddp_worker(rank: int, world: int, store: str, out_dir: str, steps: int) -> None:
    """Tiny MLP under DDP, instrumented automatically; one explicit all_reduce and all_gather per step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _dist_setup(rank, world, store)
    run = _init_run(out_dir, rank, "ddp-test", model_family="mlp", config={"lr": 0.1})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    # small buckets: several gradient all-reduces per step
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 4, 32), torch.randn(steps * 4, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    loader = run.instrument(
        model=ddp,
        optimizer=opt,
        dataloader=loader,
        counts=lambda b: {"tokens": int(b[0].shape[0]) * 16, "samples": int(b[0].shape[0])},
    )
    probe = torch.ones(1000, dtype=torch.float32)
    part = torch.full((250,), float(rank))
    gathered = torch.empty(250 * world)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        dist.all_reduce(probe)  # 4000 bytes, blocking: exposed
        dist.all_gather_into_tensor(gathered, part)  # 250 floats in, 250*world out
        work = dist.all_reduce(torch.ones(64), async_op=True)
        work.wait()
        opt.step()
        opt.zero_grad()
    run.finish()
    dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
    dist.destroy_process_group()


def fsdp_worker(rank: int, world: int, store: str, out_dir: str, steps: int) -> None:
    """Tiny MLP under FSDP2 (``fully_shard``) on CPU/gloo, instrumented automatically."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    _dist_setup(rank, world, store)
    run = _init_run(out_dir, rank, "fsdp-test", model_family="mlp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 4, 32), torch.randn(steps * 4, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    run.instrument(model=model, optimizer=opt, dataloader=loader)
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    run.finish()
    dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
    dist.destroy_process_group()


def collectives_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """Every wrapped collective once inside its own manual step, with known sizes."""
    import torch
    import torch.distributed as dist

    _dist_setup(rank, world, store)
    run = _init_run(out_dir, rank, "coll-test")
    f32 = torch.float32
    peer = 1 - rank
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mine = singles[rank]
    plan: list[tuple[str, Any]] = [
        ("all_reduce", lambda: dist.all_reduce(torch.ones(1000, dtype=f32))),
        ("all_gather", lambda: dist.all_gather([torch.empty(100) for _ in range(world)], torch.ones(100))),
        (
            "all_gather_into_tensor",
            lambda: dist.all_gather_into_tensor(torch.empty(250 * world), torch.ones(250)),
        ),
        (
            "reduce_scatter_tensor",
            lambda: dist.reduce_scatter_tensor(torch.empty(500), torch.ones(500 * world)),
        ),
        (
            "all_to_all_single",
            lambda: dist.all_to_all_single(torch.empty(64 * world), torch.ones(64 * world)),
        ),
        ("broadcast", lambda: dist.broadcast(torch.ones(300, dtype=torch.float64), src=0)),
        ("reduce", lambda: dist.reduce(torch.ones(10, dtype=torch.int64), dst=0)),
        ("barrier", lambda: dist.barrier()),
        (
            "send_recv",
            lambda: dist.send(torch.ones(7), dst=peer) if rank == 0 else dist.recv(torch.empty(7), src=peer),
        ),
        (
            "isend_irecv",
            lambda: (
                dist.isend(torch.ones(9), dst=peer) if rank == 0 else dist.irecv(torch.empty(9), src=peer)
            ).wait(),
        ),
        ("async_all_reduce", lambda: dist.all_reduce(torch.ones(2048), async_op=True).wait()),
        (
            "batch_isend_irecv",
            lambda: [
                w.wait()
                for w in dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.ones(5), peer)]
                )
            ],
        ),
        ("subgroup", lambda: dist.all_reduce(torch.ones(16), group=mine)),
    ]
    index = {}
    for i, (name, fn) in enumerate(plan):
        index[name] = i
        with run.step():
            fn()
    # many small calls in one step: aggregated per (op, group, size bucket)
    with run.step():
        for k in range(80):
            dist.all_reduce(torch.ones(4 if k % 2 else 40))
    # a collective outside any step is attributed to the next step, not counted in it
    dist.barrier()
    with run.step():
        time.sleep(0.001)
    run.event("plan", index=index)
    run.finish()
    dist.barrier()  # no rank tears gloo down while its peer is still in the last collective
    dist.destroy_process_group()


# ---------------------------------------------------------------------- a fake CUDA device
class FakeDevice:
    """Device timeline of the fake CUDA events: an event recorded at host time t completes once
    ``done_upto`` reaches t. ``syncs`` counts every synchronising call the agent could make."""

    def __init__(self) -> None:
        self.done_upto = -1
        self.syncs = 0
        self.host = 0
        self.recorded = 0
        self.queried = 0
        self.stream = "main"
        self.retries = 10  # allocator retries before the run started
        self.capturing = False  # a CUDA graph capture in progress

    def tick(self) -> int:
        self.host += 1000  # 1 µs of device time per mark
        return self.host


def fake_cuda(monkeypatch: Any, dev: FakeDevice) -> None:
    """Replace torch.cuda's events, streams, memory counters and synchronisation with fakes."""
    import torch

    class Event:
        def __init__(self, enable_timing: bool = False, **kw: Any) -> None:
            assert enable_timing, "timing events only"
            self.t: int | None = None

        def record(self, stream: Any = None) -> None:
            dev.recorded += 1
            self.t = dev.tick()

        def query(self) -> bool:
            dev.queried += 1
            return self.t is not None and self.t <= dev.done_upto

        def elapsed_time(self, end: Any) -> float:
            if not (self.query() and end.query()):
                raise RuntimeError("elapsed_time on an incomplete event would block")
            return (end.t - self.t) / 1e6  # ms

        def synchronize(self) -> None:
            dev.syncs += 1

        def wait(self, stream: Any = None) -> None:
            dev.syncs += 1

    def count_sync(*a: Any, **k: Any) -> None:
        dev.syncs += 1

    def memory_stats(device: Any = None) -> dict[str, int]:
        dev.retries += 3
        return {
            "allocated_bytes.all.current": 1000,
            "reserved_bytes.all.current": 4000,
            "allocated_bytes.all.peak": 3000,
            "num_alloc_retries": dev.retries,
        }

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", count_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", count_sync)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: dev.stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: dev.capturing)
    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    item = torch.Tensor.item
    agent_dir = os.path.dirname(os.path.abspath(__import__("fleetscope.agent").agent.__file__))

    def counted_item(self: Any) -> Any:
        # torch itself calls .item() (the DataLoader's seed); only the agent's calls count
        if os.path.dirname(os.path.abspath(sys._getframe(1).f_code.co_filename)) == agent_dir:
            dev.syncs += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted_item)
