"""The agent's sampled tracing: every K steps a few steps are profiled with torch.profiler and reduced
to a trace_summary on the tracer's own thread; the training loop never waits for it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from fleetscope.agent.tracing import SampledTracer  # noqa: E402


def _train(tracer: SampledTracer, steps: int) -> list[int]:
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = []
    for step in range(1, steps + 1):
        tracer.on_step_start(step)
        x, y = torch.randn(8, 16), torch.randn(8, 2)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracer.on_step_end(step)
        done.append(step)
    return done


def test_summary_is_produced_off_the_training_thread_without_blocking_it() -> None:
    release = threading.Event()
    got: list[tuple[int, dict[str, Any]]] = []

    def submit(rec: dict[str, Any]) -> None:
        got.append((threading.get_ident(), rec))
        release.wait(60)  # a slow sink: the training loop must not wait for it

    tracer = SampledTracer(every_k_steps=3, active_steps=2, submit=submit, rank=5)
    starts: list[int] = []
    real_start = tracer._start

    def counting_start(step: int) -> None:
        starts.append(step)
        real_start(step)

    tracer._start = counting_start  # type: ignore[method-assign]
    done = _train(tracer, 12)
    assert done == list(range(1, 13))  # all steps ran while the first summary was still being submitted
    assert starts == [3]  # windows at 6, 9, 12 were skipped: the first trace was still in flight
    assert tracer.skipped_busy == 3
    release.set()
    assert tracer.flush(60)
    tracer.close()
    assert len(got) == 1
    thread, rec = got[0]
    assert thread != threading.get_ident()
    assert rec["kind"] == "trace_summary" and rec["rank"] == 5 and rec["first_step"] == 3
    s = rec["summary"]
    assert s["rank"] == 5 and s["timeline"] == "cpu" and s["profiler_steps"] == [3, 4]
    assert [st["step"] for st in s["steps"]] == [3, 4]
    assert all(st["compute_s"] > 0 for st in s["steps"])
    assert tracer.stats() == {"windows": 1, "submitted": 1, "skipped_busy": 3, "errors": 0}


def test_every_window_is_traced_when_the_sink_keeps_up() -> None:
    got: list[dict[str, Any]] = []
    tracer = SampledTracer(every_k_steps=4, active_steps=1, submit=got.append, rank=0)
    for step in range(1, 13):
        tracer.on_step_start(step)
        torch.ones(4) @ torch.ones(4)
        tracer.on_step_end(step)
        tracer.flush(60)  # let each reduction finish before the next window
    tracer.close()
    assert [r["first_step"] for r in got] == [4, 8, 12]


def test_errors_in_the_sink_are_counted_not_raised() -> None:
    def boom(rec: dict[str, Any]) -> None:
        raise RuntimeError("sink down")

    tracer = SampledTracer(every_k_steps=2, active_steps=1, submit=boom, rank=0)
    _train(tracer, 2)
    assert tracer.flush(60)
    tracer.close()
    assert tracer.errors == 1 and tracer.submitted == 0


def test_close_in_the_middle_of_a_window_drops_it() -> None:
    got: list[dict[str, Any]] = []
    tracer = SampledTracer(every_k_steps=2, active_steps=2, submit=got.append, rank=0)
    tracer.on_step_start(2)
    tracer.close()
    tracer.on_step_end(2)
    assert got == [] and tracer.errors == 0


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError):
        SampledTracer(every_k_steps=0, active_steps=1, submit=print, rank=0)
    with pytest.raises(ValueError):
        SampledTracer(every_k_steps=2, active_steps=3, submit=print, rank=0)
