"""Positions (agent/health.py): the sender thread says where a rank is while a step is open longer
than usual — its phase, the collective it is blocked in or last issued (per-dimension sequence
number), and past a threshold the training thread's stack — read back at a loopback receiver."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import fleetscope.agent as fs
import pytest
from fleetscope.agent.config import AgentConfig
from fleetscope.agent.health import HEALTH_EVENT_SEQ_BASE, Watch, job_identity

try:
    from ._receiver import Receiver
except ImportError:  # tests/agent is not a package
    from _receiver import Receiver

pytestmark = pytest.mark.timeout(120)


def _init(r: Receiver, tmp_path: Path, name: str, **kw: Any) -> Any:
    settings: dict[str, Any] = dict(server=r.url, token=r.token, spool_dir=str(tmp_path / "spool"),
                                    flush_interval_s=0.1, heartbeat_s=0.3, stack_after_s=0.6)
    settings.update(kw)
    return fs.init(name, agent_config=AgentConfig(**settings))


def _positions(r: Receiver) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "position"]


def _wait(pred: Any, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return pred()


def stuck_in_the_loader(seconds: float) -> None:
    time.sleep(seconds)  # the frame a stuck rank's stack must show


def test_open_step_reports_phase_and_stack_innermost_last(tmp_path: Path) -> None:
    with Receiver() as r:
        run = _init(r, tmp_path, "pos-stack")
        for _ in range(5):
            with run.step(tokens=8):
                with run.phase("forward"):
                    time.sleep(0.005)
        assert not _positions(r)  # healthy steps: no position at all
        with run.step(tokens=8):
            with run.phase("data"):
                stuck_in_the_loader(2.2)
        run.finish()
    pos = _positions(r)
    assert pos, r.events()
    # at most one per heartbeat (0.3 s) over ~2.2 s open (minus the 1 s threshold)
    ts = [p["ts"] for p in pos]
    assert all(b - a >= 0.29 for a, b in zip(ts, ts[1:], strict=False)), ts
    assert len(pos) <= 5, len(pos)
    for p in pos:
        d = p["data"]
        assert p["step"] == 5 and p["rank"] == 0
        assert d["state"] == "in_step" and d["phase"] == "data" and d["source"] == "agent"
        assert d["open_s"] >= 1.0  # threshold: max(2 × median step, 1 s)
        assert p["seq"] >= HEALTH_EVENT_SEQ_BASE
    with_stack = [p for p in pos if p["data"]["stack"]]
    assert with_stack and all(p["data"]["open_s"] >= 0.6 for p in with_stack)
    stack = with_stack[-1]["data"]["stack"]
    assert 1 <= len(stack) <= 12
    assert stack[-1]["func"] == "stuck_in_the_loader" and stack[-1]["file"].endswith("test_positions.py")
    assert stack[-2]["func"] == "test_open_step_reports_phase_and_stack_innermost_last"
    assert set(stack[-1]) == {"file", "line", "func"}  # no locals
    assert not any("fleetscope/agent" in f["file"] or f["file"].startswith("agent/") for f in stack)
    assert len({p["seq"] for p in pos}) == len(pos)


def test_between_steps_position_and_no_position_when_disabled(tmp_path: Path) -> None:
    with Receiver() as r:
        run = _init(r, tmp_path, "pos-between")
        for _ in range(3):
            with run.step():
                pass
        stuck_in_the_loader(1.6)  # outside any step (an evaluation, say): > heartbeat and > 1 s
        run.finish()
    pos = _positions(r)
    assert pos and all(p["data"]["state"] == "between_steps" for p in pos)
    assert pos[-1]["step"] == 2 and pos[-1]["data"]["phase"] is None
    assert pos[-1]["data"]["stack"][-1]["func"] == "stuck_in_the_loader"
    with Receiver() as r2:
        run = _init(r2, tmp_path, "pos-off", heartbeat_s=0.0)
        with run.step():
            stuck_in_the_loader(1.5)
        run.finish()
        assert not _positions(r2)
        assert _wait(lambda: r2.finishes)


def test_threshold_follows_the_ranks_step_times() -> None:
    class _R:
        pass

    w = Watch(_R(), heartbeat_s=5.0, stack_after_s=30.0)
    assert w.threshold_s() == 5.0  # before any step: the heartbeat
    w.observe([("rank_step", (0, i, 0.1, 1.7e9 + i)) for i in range(10)])
    assert w.threshold_s() == 1.0  # 2 × 0.1 s is below the 1 s floor
    w.observe([("rank_step", (0, 10 + i, 3.0, 1.8e9 + i)) for i in range(30)])
    assert w.threshold_s() == 6.0  # 2 × the median of the recent steps


def test_job_identity_from_the_environment() -> None:
    assert job_identity({}) == (None, 0)
    assert job_identity({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}) == ("77", 2)
    assert job_identity({"FLEETSCOPE_JOB_ID": "j1", "TORCHELASTIC_RUN_ID": "abc",
                         "TORCHELASTIC_RESTART_COUNT": "1", "FLEETSCOPE_ATTEMPT": "3"}) == ("j1", 3)
    assert job_identity({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "x"}) == ("abc", 0)
    assert job_identity({"FLEETSCOPE_JOB_ID": "x" * 300})[0] == "x" * 128
    assert job_identity({"FLEETSCOPE_JOB_ID": "a\nb\x00", "FLEETSCOPE_ATTEMPT": "99999999"}) == ("ab", 10_000)


PEER = """
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2)
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
time.sleep(float(sys.argv[2]))   # rank 1 is late for the 4th all_reduce
dist.all_reduce(t)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_blocked_collective_has_op_dim_and_sequence_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("FLEETSCOPE_FLIGHT_RECORDER", "0")  # the agent's own records (no Flight Recorder)

    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{_free_port()}"
    (tmp_path / "peer.py").write_text(textwrap.dedent(PEER))
    peer = subprocess.Popen([sys.executable, str(tmp_path / "peer.py"), url, "3.0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        with Receiver() as r:
            dist.init_process_group("gloo", init_method=url, rank=0, world_size=2)
            try:
                run = _init(r, tmp_path, "pos-coll", stack_after_s=1.2)
                t = torch.ones(4)
                for _ in range(3):
                    with run.step():
                        dist.all_reduce(t)
                with run.step():
                    with run.phase("backward"):
                        dist.all_reduce(t)  # blocks ~3 s: the peer sleeps
                run.finish()
            finally:
                dist.destroy_process_group()
        assert peer.wait(timeout=30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    pos = _positions(r)
    assert pos, r.events()
    for p in pos:
        c = p["data"]["collective"]
        assert p["step"] == 3 and p["data"]["phase"] == "backward" and p["data"]["source"] == "agent"
        assert c["op"] == "all_reduce" and c["dim"] == "world" and c["seq"] == 4 and c["done"] is False
        assert c["bytes"] == 16 and c["since_s"] >= 0.9
    stacks = [p["data"]["stack"] for p in pos if p["data"]["stack"]]
    assert stacks and stacks[-1][-1]["func"] in ("all_reduce", "wrapper")  # torch's frame, innermost
    assert any(f["func"] == "test_blocked_collective_has_op_dim_and_sequence_number" for f in stacks[-1])
