"""Memory without touching the job's counters (agent/memory.py): the agent never calls
``reset_peak_memory_stats``, so a job that reads ``torch.cuda.max_memory_allocated()`` gets its own
high-water mark; the per-step peak is derived from that mark (exact when it rose in the step); each rank
sends its run figures (peaks, fragmentation, retries, OOMs) in a rare ``memory`` event.

No GPU here: the GPU path runs on the fake CUDA device of agent_testutil with a scripted caching
allocator behind ``torch.cuda.memory_stats`` (torch's own ``max_memory_allocated`` reads it); the real
device check is bench/gpu_check.py ``memory_not_reset``."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import agent_testutil as util  # noqa: E402
import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent import memory  # noqa: E402

torch.set_num_threads(1)
MB = 1 << 20


class Allocator:
    """A caching allocator's counters as ``torch.cuda.memory_stats()`` reports them."""

    def __init__(self) -> None:
        self.cur = self.peak = self.reserved = self.reserved_peak = 0
        self.retries = self.ooms = 0
        self.resets: list[str] = []  # who reset the peak: only ever the job

    def alloc(self, n: int) -> None:
        self.cur += n
        self.peak = max(self.peak, self.cur)
        if self.cur > self.reserved:
            self.reserved = -(-self.cur // (20 * MB)) * 20 * MB  # 20 MiB segments: reserved > allocated
            self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        self.cur -= n

    def stats(self, device: Any = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.cur, "allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.reserved_peak,
                "num_alloc_retries": self.retries, "num_ooms": self.ooms}

    def reset_peak(self, who: str) -> None:
        self.resets.append(who)
        self.peak, self.reserved_peak = self.cur, self.reserved


@pytest.fixture
def cuda_job(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake CUDA device with ``Allocator`` behind torch's memory API; ``reset_peak_memory_stats``
    spied everywhere torch exposes it (the agent's calls land in ``alloc.resets`` as "agent")."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    dev = util.FakeDevice()
    util.fake_cuda(monkeypatch, dev)
    alloc = Allocator()
    for mod in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(mod, "memory_stats", alloc.stats)
        monkeypatch.setattr(mod, "reset_peak_memory_stats", lambda device=None: alloc.reset_peak("agent"))
        monkeypatch.setattr(mod, "reset_max_memory_allocated", lambda device=None: alloc.reset_peak("agent"))
    runs: list[Any] = []

    def start(**kw: Any) -> tuple[Any, FakeTransport]:
        kw.setdefault("collectives", False)
        r = fs.init("memory-test", transport=FakeTransport, clock="cuda", **kw)
        runs.append(r)
        return r, FakeTransport.instances[-1]

    yield dev, alloc, start
    for r in runs:
        r.finish(timeout=0.5)


def _memory_events(tx: FakeTransport) -> list[dict[str, Any]]:
    return [e["data"] for e in tx.of("event") if e["kind"] == "memory"]


def test_the_job_reads_its_own_peak_and_the_agent_never_resets_it(cuda_job: Any) -> None:
    dev, alloc, start = cuda_job
    model = torch.nn.Linear(8, 8)
    alloc.alloc(100 * MB)  # weights and optimizer state, before the run
    alloc.alloc(500 * MB)  # a transient spike before the run (loading a checkpoint)
    alloc.free(500 * MB)
    run, tx = start()
    acts = [50, 80, 80, 60, 700, 80, 80, 80]  # activations per step (MiB); step 4 beats the pre-run spike
    job_reads, true_peaks = [], []
    for i, a in enumerate(acts):
        before = alloc.peak
        with run.step():
            with run.phase("forward"):
                model(torch.randn(4, 8)).sum()  # real torch work in the step
                alloc.alloc(a * MB)
            with run.phase("backward"):
                alloc.alloc(10 * MB)  # gradients of the step, freed below
                alloc.free((a + 10) * MB)
            if i == 6:  # the job caught an OOM and an allocator retry in this step
                alloc.ooms += 1
                alloc.retries += 2
        true_peaks.append((100 + a + 10) * MB if alloc.peak > before else None)
        job_reads.append(torch.cuda.max_memory_allocated())  # torch's own function, the job's counter
    dev.done_upto = dev.host + 10**9
    run.finish(timeout=1.0)

    assert alloc.resets == []  # the agent never reset the job's peak counters
    # the job sees its own high-water mark: the pre-run spike until step 4, then step 4's peak
    assert job_reads == [600 * MB] * 4 + [810 * MB] * 4
    steps = tx.steps()
    assert [s["step"] for s in steps] == list(range(len(acts)))
    # the per-step peak is that same mark read at the step's end: exact on step 4, where it rose
    assert [s["mem_peak_bytes"] for s in steps] == job_reads
    assert steps[4]["mem_peak_bytes"] == true_peaks[4] and [i for i, p in enumerate(true_peaks) if p] == [4]
    assert all(s["mem_allocated_bytes"] == 100 * MB for s in steps)
    assert [s["alloc_retries"] for s in steps] == [0] * 6 + [2, 0]
    ev = _memory_events(tx)
    assert ev[0]["source"] == "cuda"
    last = ev[-1]
    assert last["peak_allocated_bytes"] == 810 * MB and last["peak_exact"] is True
    assert last["peak_reserved_bytes"] == 820 * MB and last["fragmentation_bytes"] == 10 * MB
    assert last["ooms"] == 1 and last["alloc_retries"] == 2
    assert last["samples"] == len(acts) + 1  # + the final read at finish
    assert len(ev) == 1  # 8 steps: no look before sample 10, one event at finish


def test_a_job_that_resets_its_own_peak_is_followed(cuda_job: Any) -> None:
    """The job's resets are the job's: its per-epoch max_memory_allocated works, the agent follows."""
    dev, alloc, start = cuda_job
    run, tx = start()
    reads = []
    for epoch in range(2):
        for a in ((300, 100) if epoch == 0 else (120, 150)):
            with run.step():
                alloc.alloc(a * MB)
                alloc.free(a * MB)
        reads.append(torch.cuda.max_memory_allocated())
        alloc.reset_peak("job")
    dev.done_upto = dev.host + 10**9
    run.finish(timeout=1.0)
    assert reads == [300 * MB, 150 * MB]  # each epoch's own peak: nobody else reset it
    assert alloc.resets == ["job", "job"]
    assert [s["mem_peak_bytes"] for s in tx.steps()] == [300 * MB, 300 * MB, 120 * MB, 150 * MB]
    assert _memory_events(tx)[-1]["peak_allocated_bytes"] == 300 * MB


def test_the_per_step_peak_on_scripted_allocator_stats() -> None:
    """``CudaMemorySampler`` on a scripted sequence of ``memory_stats`` dicts, and a spy that fails on any
    reset: exact when the mark rose, the mark (an upper bound) otherwise, deltas of retries and OOMs."""

    class Cuda:
        def __init__(self, seq: list[dict[str, int]]) -> None:
            self.seq = seq

        def memory_stats(self, device: Any = None) -> dict[str, int]:
            return self.seq.pop(0)

        def reset_peak_memory_stats(self, device: Any = None) -> None:
            raise AssertionError("the agent reset the job's peak")

    def s(cur: int, peak: int, res: int, rpeak: int, retries: int = 0, ooms: int = 0) -> dict[str, int]:
        return {"allocated_bytes.all.current": cur, "allocated_bytes.all.peak": peak, "reserved_bytes.all.current": res,
                "reserved_bytes.all.peak": rpeak, "num_alloc_retries": retries, "num_ooms": ooms}

    sent: list[dict[str, Any]] = []
    cuda = Cuda([s(10, 50, 60, 60, retries=4, ooms=1),  # baseline: before the run (its retries and OOM are not the run's)
                 s(12, 40 + 30, 80, 80, 4, 1),  # rose: exact
                 s(12, 70, 80, 80, 5, 1),  # steady: the mark, an upper bound; one retry
                 s(12, 90, 100, 100, 5, 3),  # rose again; two OOMs
                 s(11, 30, 100, 100, 5, 3),  # the job reset its peak: followed
                 s(11, 30, 100, 100, 2, 3)])  # the job reset the accumulated counters: retries unknown
    smp = memory.CudaMemorySampler(cuda, emit=sent.append)
    out = [smp.sample() for _ in range(5)]
    assert out == [(12, 80, 70, 0), (12, 80, 70, 1), (12, 100, 90, 0), (11, 100, 30, 0), (11, 100, 30, None)]
    fig = smp._figures()
    assert fig["peak_allocated_bytes"] == 90 and fig["peak_exact"] is True and fig["peak_reserved_bytes"] == 100
    assert fig["fragmentation_bytes"] == 10 and fig["alloc_retries"] == 1 and fig["ooms"] == 2
    assert sent == []  # no look before sample FIRST_LOOK

    t = memory.PeakTracker(None, None)  # an allocator without a high-water mark: a lower bound
    assert t.window(None, 5) == (5, False) and t.window(None, 3) == (5, False) and t.window(None, 2) == (3, False)
    # an allocator not yet initialised at the baseline (no stats): all of it is the run's, exact
    smp = memory.CudaMemorySampler(Cuda([{}, s(10, 40, 20, 20)]))
    assert smp.sample() == (10, 20, 40, 0) and smp._alloc.run_exact


def test_memory_events_stay_rare_and_never_break_the_step() -> None:
    class Cuda:
        n = 0

        def memory_stats(self, device: Any = None) -> dict[str, int]:
            self.n += 1
            return {"allocated_bytes.all.current": 5, "allocated_bytes.all.peak": 9,
                    "reserved_bytes.all.current": 10, "reserved_bytes.all.peak": 10, "num_alloc_retries": 0}

    sent: list[dict[str, Any]] = []
    smp = memory.CudaMemorySampler(Cuda(), emit=sent.append)
    for _ in range(5000):
        smp.sample()
    smp.finish()
    # the first look (sample 10), then steady: nothing until finish
    assert [e["samples"] for e in sent] == [memory.FIRST_LOOK, 5001] and sent[-1]["ooms"] is None  # no num_ooms stat

    class Growing(Cuda):
        def memory_stats(self, device: Any = None) -> dict[str, int]:
            d = super().memory_stats()
            d["allocated_bytes.all.peak"] = 9 + (self.n >= 15) * 100 + (self.n >= 4000) * 1  # +1: under 1 %
            d["num_ooms"] = int(self.n >= 30)
            return d

    sent = []
    smp = memory.CudaMemorySampler(Growing(), emit=sent.append)
    for _ in range(5000):
        smp.sample()
    # looks at 10, 20, 40, 80, …: the rise at sample 14 is sent at 20, the OOM at 29 at 40; +1 byte is not news
    assert [(e["samples"], e["peak_allocated_bytes"], e["ooms"]) for e in sent] == [(10, 9, 0), (20, 109, 0), (40, 109, 1)]

    def broken(_d: dict[str, Any]) -> None:
        raise RuntimeError("transport gone")

    smp = memory.CudaMemorySampler(Cuda(), emit=broken)
    assert smp.sample() == (5, 10, 9, 0)  # the sample survives a failing event


def test_cpu_job_reports_rss_and_never_touches_cuda_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    calls: list[str] = []
    for mod in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(mod, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    run = fs.init("memory-cpu", transport=FakeTransport, clock="cpu", collectives=False)
    tx = FakeTransport.instances[-1]
    model = torch.nn.Linear(16, 16)
    for _ in range(3):
        with run.step():
            with run.phase("forward"):
                model(torch.randn(8, 16)).sum().backward()
    run.finish(timeout=1.0)
    assert calls == []
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("RSS is read from /proc")
    steps = tx.steps()
    for s in steps:
        assert s["mem_allocated_bytes"] > 0 and s["mem_peak_bytes"] >= s["mem_allocated_bytes"]
        assert s["mem_reserved_bytes"] is None and s["alloc_retries"] is None  # no allocator on CPU
    ev = _memory_events(tx)
    assert ev and ev[-1]["source"] == "rss" and ev[-1]["peak_allocated_bytes"] >= steps[-1]["mem_allocated_bytes"]
    assert "ooms" not in ev[-1] and "peak_reserved_bytes" not in ev[-1]


def test_no_agent_module_calls_a_memory_reset() -> None:
    """The GPU path cannot run here: the source itself is checked — no call of torch's memory-counter
    resets anywhere in the agent (by attribute or by name, through getattr or not)."""
    import ast
    from pathlib import Path

    resets = {"reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
              "reset_accumulated_memory_stats", "_cuda_resetPeakMemoryStats", "_cuda_resetAccumulatedMemoryStats"}
    found = []
    for path in Path(memory.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in resets:
                name = node.value  # getattr(torch.cuda, "reset_peak_memory_stats")
            if name in resets:
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
