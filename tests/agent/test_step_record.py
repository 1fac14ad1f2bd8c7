"""The rank_step record is built in one place (``StepMachine._record``): the inlined host-clock path
(``Step``/``Phase`` inline transitions, the wrappers' fast collective path, ``_end_fast``) and the
general path (``_begin``/``_push``/``_pop``, ``_coll_begin``/``_coll_end``, ``_end``,
``_submit_step``) emit identical records for the same scripted step."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, ScriptedClock, parts_sum  # noqa: E402
from fleetscope.agent import collectives, step_end, step_state  # noqa: E402
from fleetscope.agent.collective_stats import C_KIND, K_PUSHED, K_SYNC_FAST, K_TRAINING  # noqa: E402


class _Tensor:
    nbytes = 4096


class _QuietTracer:
    """A sampled tracer that never traces: its presence alone puts steps on the general path."""

    def on_step_start(self, step: int) -> None:
        return None

    def on_step_end(self, step: int) -> None:
        return None

    def close(self, timeout: float = 5.0) -> None:
        return None


class _FixedMemory:
    min_interval_ns = 0

    def sample(self) -> tuple[int, None, None, None]:
        return (123_456, None, None, None)

    def close(self) -> None:
        return None


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A run on a scripted clock with a fixed wall time and memory, and a generated all_reduce
    wrapper around a collective that takes 7 ns of the scripted clock."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED", "FLEETSCOPE_TRACE_EVERY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(step_state, "_time", lambda: 1_700_000_123.5)
    run = fs.init("one-record", transport=FakeTransport, collectives=False, flops_per_token=6.0)
    assert isinstance(run, fs.Run)
    tx = FakeTransport.instances[-1]
    clock = ScriptedClock()
    run._use_clock(clock)
    run._mem = _FixedMemory()
    run._mem_interval = 0
    world = object()
    monkeypatch.setattr(
        collectives,
        "_c10d",
        types.SimpleNamespace(
            _world=types.SimpleNamespace(_default_pg=world),
            GroupMember=types.SimpleNamespace(WORLD=world),
            get_world_size=lambda g: 4,
        ),
    )
    monkeypatch.setitem(collectives._sizes, world, (4, "world"))
    monkeypatch.setattr(collectives, "_run", run)

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        clock.now += 7

    wrapped = collectives._make_wrapper("all_reduce", all_reduce)
    assert wrapped.__code__.co_filename == "<fleetscope wrapper of all_reduce>"  # the generated one
    yield run, tx, clock, wrapped
    run.finish()


def _scripted_step(run: Any, clock: Any, all_reduce: Any, seen: dict[str, Any]) -> None:
    t = _Tensor()
    with run.step(tokens={"vision": 10, "text": 6}, samples=2, padded_tokens=20, step=7) as s:
        seen["fast"] = run._fast
        with s.phase("data"):
            clock.now += 10
        with run.phase("forward"):
            clock.now += 20
        with run.phase("backward"):
            clock.now += 5
            all_reduce(t)  # blocking, on the training thread: exposed comm
            seen["kind"] = run._step.calls[-1][C_KIND]
            clock.now += 3
            all_reduce(t, group=None)
            clock.now += 2
        with run.phase("optimizer"):
            clock.now += 4
        with run.phase("ema_update"):  # a custom phase: compute
            clock.now += 6
        s.count(tokens={"text": 2}, samples=1)
        clock.now += 1


def test_fast_and_general_paths_emit_identical_records(scripted: Any) -> None:
    run, tx, clock, all_reduce = scripted
    tx.records.clear()  # the rank record init submitted
    fast: dict[str, Any] = {}
    _scripted_step(run, clock, all_reduce, fast)
    first = list(tx.records)
    tx.records.clear()

    run._tracer = _QuietTracer()  # the same step, on the general path
    general: dict[str, Any] = {}
    _scripted_step(run, clock, all_reduce, general)
    second = list(tx.records)
    run._tracer = None

    # the same step once more, its records built off the training thread: end_fast queues the raw
    # marks (DEFERRED_STEP) when the transport expands them (the real Transport, on its sender thread)
    tx.records.clear()
    run._defer = True
    deferred: dict[str, Any] = {}
    _scripted_step(run, clock, all_reduce, deferred)
    run._defer = False
    queued = list(tx.records)
    tx.records.clear()
    assert deferred == fast
    assert [k for k, _ in queued] == [step_end.DEFERRED_STEP]  # nothing built on the training thread
    third: list[tuple[str, Any]] = []
    step_end.expand_step(run, queued[0][1], lambda kind, rec: third.append((kind, rec)))
    assert third == first
    tx.records.extend(third)  # the step read back below
    assert run._spare is queued[0][1][0]  # the StepData is offered back for the next step

    # the two paths really were taken
    assert fast == {"fast": True, "kind": K_SYNC_FAST}
    assert general == {"fast": False, "kind": K_TRAINING | K_PUSHED}
    assert [k for k, _ in first] == [k for k, _ in second] == [
        "collective", "collective", "rank_step", "modality_tokens", "modality_tokens", "phase",
    ]  # fmt: skip
    assert first == second
    (custom,) = [r for k, r in first if k == "phase"]  # the custom phase, by name, with its own time
    assert custom[1:3] == (7, "ema_update") and custom[3] == pytest.approx(6e-9)

    (st,) = tx.steps()
    assert st["step"] == 7 and st["ts"] == 1_700_000_123.5
    assert st["step_s"] == 65e-9
    assert (st["data_s"], st["forward_s"], st["backward_s"], st["optimizer_s"]) == (10e-9, 20e-9, 10e-9, 4e-9)
    assert st["compute_s"] == 40e-9  # forward + backward + optimizer + the custom phase
    assert st["comm_exposed_s"] == st["comm_total_s"] == 14e-9
    assert st["other_s"] == 1e-9
    assert parts_sum(st) == pytest.approx(st["step_s"], rel=1e-12, abs=0)
    assert (st["tokens"], st["padded_tokens"], st["samples"], st["flags"]) == (18, 20, 3, 0)
    assert st["flops"] == 6.0 * 18  # model FLOPs per token given: the real tokens, padding excluded
    assert st["hw_flops"] is None  # hardware FLOPs only when measured
    assert st["mem_allocated_bytes"] == 123_456
    assert [(c["seq"], c["group_size"], c["bytes"], c["total_s"], c["exposed_s"]) for c in tx.collectives()] == [
        (0, 4, 4096, 7e-9, 7e-9),
        (1, 4, 4096, 7e-9, 7e-9),
    ]
    assert sorted((m["modality"], m["tokens"]) for m in tx.modalities()) == [("text", 8), ("vision", 10)]
    assert run.stats()["internal_errors"] == 0
