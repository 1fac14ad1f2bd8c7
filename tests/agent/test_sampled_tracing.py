"""Sampled tracing wired into Run: every K steps a window is profiled, reduced off the training
thread, and sent as a `trace_summary` event with JSON-safe data."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED", "FLEETSCOPE_TRACE_EVERY"):
        monkeypatch.delenv(var, raising=False)


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return True


def test_every_k_steps_a_reduced_trace_is_sent_as_an_event(clean_env: None) -> None:
    import torch

    torch.set_num_threads(1)
    run = fs.init("trace-wired", transport=FakeTransport, collectives=False, trace_every_steps=4, trace_active_steps=2)
    tx = FakeTransport.instances[-1]
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        with run.step(tokens=16):
            with run.phase("forward"):
                loss = model(torch.randn(16, 32)).pow(2).mean()
            with run.phase("backward"):
                loss.backward()
            with run.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    run.finish()
    events = [e for e in tx.of("event") if e["kind"] == "trace_summary"]
    assert events, "no sampled trace was sent"
    e = events[0]
    assert e["data"]["summary"]["source"].startswith("sampled@step")
    assert "kernel_time_us" in e["data"]["summary"] or "steps" in e["data"]["summary"]
    assert _finite(e["data"]) and json.dumps(e["data"], allow_nan=False)  # the server refuses NaN
    assert len([s for s in tx.steps()]) == 10  # tracing did not lose or merge steps


def test_trace_env_var_is_read_and_validated(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLEETSCOPE_TRACE_EVERY", "50")
    assert fs.AgentConfig.from_env().trace_every_steps == 50
    # a bad value must not kill the job: it is reported (once) and the default (off) is used
    # (every FLEETSCOPE_* variable: tests/agent/test_config.py)
    monkeypatch.setenv("FLEETSCOPE_TRACE_EVERY", "often-but-not-an-integer")
    with caplog.at_level("WARNING", logger="fleetscope.agent.config"):
        assert fs.AgentConfig.from_env().trace_every_steps == 0
    assert "FLEETSCOPE_TRACE_EVERY" in caplog.text and "must be an integer" in caplog.text
    with pytest.raises(ValueError, match="trace_every_steps"):  # a bad argument is the caller's bug
        fs.AgentConfig.from_env(trace_every_steps=-1)
