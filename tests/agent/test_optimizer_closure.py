"""Automatic mode when the step's forward and backward run inside ``optimizer.step(closure)``
(Lightning's automatic optimization, LBFGS), and collectives issued after the last step.

In-process, explicit ``run.instrument(model=, optimizer=)``; the zero-code launcher's version is
tested with real Lightning and HF Trainer jobs in tests/e2e/test_frameworks.py."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, parts_sum  # noqa: E402
from fleetscope.agent.collective_marks import coll_begin, coll_end  # noqa: E402

torch.set_num_threads(1)
UPDATE_S = 0.02  # the optimizer's own update, made slow on purpose
B = 4
# per micro-batch of the MLP below: forward 2·B·(16·32 + 32·4), backward the weight gradients (same)
# plus the second layer's input gradient
MICRO_FLOPS = 2 * (2 * B * (16 * 32 + 32 * 4)) + 2 * B * 32 * 4


class SlowSGD(torch.optim.Optimizer):
    """SGD whose update takes ``UPDATE_S``; calls its closure first, as torch's optimizers do."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        time.sleep(UPDATE_S)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-g["lr"])
        return loss


@pytest.fixture
def run_tx(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    runs: list[Any] = []

    def make(**kw: Any) -> tuple[Any, FakeTransport]:
        kw.setdefault("collectives", False)
        r = fs.init("closure-test", transport=FakeTransport, **kw)
        runs.append(r)
        return r, FakeTransport.instances[-1]

    yield make
    for r in runs:
        r.finish()


def _mlp() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_closure_is_the_steps_forward_and_backward(run_tx: Any, accumulate: int) -> None:
    """Lightning's loop: micro-batches 1..k-1 outside the optimizer, the last in its closure."""
    run, tx = run_tx()
    model = _mlp()
    opt = SlowSGD(model.parameters())
    run.instrument(model=model, optimizer=opt)
    calls = []

    def micro() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(torch.randn(B, 16)), torch.randn(B, 4))
        opt.zero_grad()
        loss.backward()
        return loss

    for _ in range(3):
        for _ in range(accumulate - 1):
            micro()
        out = opt.step(micro)  # positional, as LBFGS users write it; the closure's result comes back
        calls.append(out)
    assert all(isinstance(c, torch.Tensor) for c in calls)
    opt.step(closure=micro)  # the keyword form
    run.finish()
    steps = tx.steps()
    assert len(steps) == 4
    assert [s["flops"] for s in steps[:3]] == [accumulate * MICRO_FLOPS] * 3  # every micro-batch counted
    for s in steps:
        assert s["forward_s"] and s["backward_s"]
        assert s["optimizer_s"] >= UPDATE_S  # the update, not the µs of step()'s entry
        assert parts_sum(s) == pytest.approx(s["step_s"], rel=1e-9, abs=1e-12)
    assert run.stats()["internal_errors"] == 0


def test_step_without_closure_unchanged(run_tx: Any) -> None:
    run, tx = run_tx()
    model = _mlp()
    opt = SlowSGD(model.parameters())
    run.instrument(model=model, optimizer=opt)
    for _ in range(2):
        torch.nn.functional.mse_loss(model(torch.randn(B, 16)), torch.randn(B, 4)).backward()
        opt.step()
    run.finish()
    steps = tx.steps()
    assert len(steps) == 2 and steps[0]["flops"] == MICRO_FLOPS
    assert all(s["optimizer_s"] >= UPDATE_S for s in steps)


def test_collectives_after_the_last_step_open_no_step(run_tx: Any) -> None:
    """HF Trainer's end-of-training gathers: reported as one event at the last step, not as records
    of a step that no rank ran (a phantom step)."""
    run, tx = run_tx()
    for _ in range(2):
        with run.step():
            pass
    for op in ("all_gather", "all_gather", "barrier"):
        coll_end(run, coll_begin(run, op, (2, "world"), 8, True), True)
    run.finish()
    assert [s["step"] for s in tx.steps()] == [0, 1]
    assert tx.collectives() == []
    (ev,) = [e for e in tx.of("event") if e["kind"] == "collectives_after_last_step"]
    assert ev["step"] == 1 and ev["data"] == {"calls": 3, "ops": {"all_gather": 2, "barrier": 1}}
    assert run.stats()["collectives_after_last_step"] == 3


def test_collectives_of_a_run_without_steps_still_sent(run_tx: Any) -> None:
    run, tx = run_tx()
    coll_end(run, coll_begin(run, "barrier", (2, "world"), 0, True), True)
    run.finish()
    assert [(c["step"], c["op"]) for c in tx.collectives()] == [(0, "barrier")]
    assert not [e for e in tx.of("event") if e["kind"] == "collectives_after_last_step"]
