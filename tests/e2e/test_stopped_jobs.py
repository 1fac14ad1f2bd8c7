"""When a run stops, say where and why: real gloo DDP jobs under ``fleetscope run -- torchrun`` that
hang, raise, get SIGKILLed, restart from a checkpoint and pause, against the real server. What the
agent sent is read back from what the server stored (``run_positions``, ``run_failures``,
``run_pauses``, ``run_events``, ``GET /runs``) and from ``GET /runs/{id}/health``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

pytestmark = pytest.mark.timeout(300)

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

HEAD = """
import os, sys, signal, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

HANG = HEAD + """
def read_batch_from_a_dead_filesystem(step):
    if rank == 2 and step == 6:
        time.sleep(float(os.environ["HANG_S"]))  # rank 2 never arrives at step 6's all_reduce
    return torch.randn(4, 8)

for step in range(8):
    x = read_batch_from_a_dead_filesystem(step)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

RAISE = HEAD + """
def check_the_batch(step):
    if rank == 1 and step == 3:
        raise ValueError(f"batch {step} has NaN labels")

for step in range(6):
    x = torch.randn(4, 8)
    check_the_batch(step)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

KILL = HEAD + """
for step in range(6):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, say
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

# each attempt meets in a file store of its own: torchrun's own store hands a restarted gloo group the
# first attempt's addresses now and then (torch 2.13, plain torchrun too)
RESTART = HEAD.replace('dist.init_process_group("gloo")', """attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", init_method="file://" + os.path.abspath(f"pg_store_{attempt}"),
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))""") + """
import fleetscope.agent as fs
start = 0
if os.path.exists("ckpt.pt"):
    state = torch.load("ckpt.pt")
    model.module.load_state_dict(state["model"])
    start = state["step"]
for step in range(start, 6):
    if attempt == 0 and rank == 1 and step == 4:
        raise RuntimeError("lost a node")
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 2 and rank == 0:
        torch.save({"model": model.module.state_dict(), "step": 3}, "ckpt.pt")
    dist.barrier()
    if attempt == 1 and step == 4:
        with fs.get_run().pause("eval", expected_s=6):
            time.sleep(6.0)  # a declared evaluation pause, longer than the server's stall threshold (4 s)
dist.destroy_process_group()
"""


def _launch(script: str, tmp_path: Path, srv: Any, name: str, nproc: int, *extra: str,
            env: dict[str, str] | None = None) -> subprocess.Popen:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(script))
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "FLEETSCOPE_SERVER": srv.url, "FLEETSCOPE_TOKEN": srv.token,
            "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "FLEETSCOPE_HEARTBEAT_S": "1",
            "FLEETSCOPE_STACK_AFTER_S": "2", **(env or {})}
    for var in ("FLEETSCOPE_RUN_NAME", "FLEETSCOPE_JOB_ID", "FLEETSCOPE_ATTEMPT"):
        full.pop(var, None)
    return subprocess.Popen(
        [*FS_RUN, "--name", name, "--", TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *extra, f"{name}.py"],
        cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise
    return proc.returncode, (out or "")[-3000:] + (err or "")[-5000:]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(proc: subprocess.Popen) -> None:
    """End the launch and everything it started (fleetscope run, torchrun, the workers)."""
    if proc.poll() is None:
        pids = _descendants(proc.pid)
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def _runs(url: str, **params: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = httpx.get(f"{url}/api/v1/runs", params=params, timeout=10).json()["runs"]
    return runs


def _run_id(url: str, name: str, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = _runs(url, name=name)
        if runs:
            return int(runs[0]["id"])
        time.sleep(0.3)
    raise AssertionError(f"run {name} never registered")


def _rows(db_url: str, sql: str, **params: Any) -> list[Any]:
    from fleetscope.server.db import make_engine

    eng = make_engine(db_url, pool_size=1)
    try:
        with eng.connect() as c:
            return list(c.execute(text(sql), params).mappings())
    finally:
        eng.dispose()


def _health(url: str, run_id: int) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/v1/runs/{run_id}/health", timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _wait_failed(url: str, run_id: int, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    h = _health(url, run_id)
    while h["state"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.5)
        h = _health(url, run_id)
    return h


@pytest.fixture
def srv(db_url: str) -> Any:
    from conftest import start_server

    s = start_server(db_url, health_interval_s=1.0, stall_min_s=4.0, stall_first_s=60.0)
    yield s
    s.stop()


@pytest.mark.parametrize("recorder", ["flight_recorder", "agent"])
def test_a_rank_that_sleeps_inside_a_step_is_named_with_its_stack(srv: Any, db_url: str, tmp_path: Path,
                                                                 recorder: str) -> None:
    # with and without torch's Flight Recorder (then from the agent's own collective records)
    env = {"HANG_S": "120", "FLEETSCOPE_FLIGHT_RECORDER": "1" if recorder == "flight_recorder" else "0"}
    proc = _launch(HANG, tmp_path, srv, "hang", 4, env=env)
    try:
        rid = _run_id(srv.url, "hang")
        deadline = time.monotonic() + 90
        pos: dict[int, Any] = {}
        while time.monotonic() < deadline:
            rows = _rows(db_url, "SELECT * FROM run_positions WHERE run_id = :r", r=rid)
            pos = {int(p["rank"]): p for p in rows}
            if len(pos) == 4 and pos[2]["stack"] and all(pos[r]["coll_seq"] is not None for r in (0, 1, 3)):
                break
            time.sleep(0.5)
        assert sorted(pos) == [0, 1, 2, 3], pos
        # the others wait in step 6's gradient all-reduce, the same number on the world group for all;
        # with the agent's own records it is number 7 (steps 0-5 issued 6), the Flight Recorder also
        # counts what DDP ran before the first step
        seq = pos[0]["coll_seq"]
        source = pos[0]["source"]
        assert source == recorder, pos[0]
        for r in (0, 1, 3):
            p = pos[r]
            assert p["step"] == 6 and p["state"] == "in_step" and p["phase"] == "backward", p
            assert (p["coll_op"], p["coll_dim"], p["coll_seq"], p["coll_done"]) == ("all_reduce", "world", seq, False), p
            assert p["coll_bytes"] > 0 and p["coll_since_s"] >= 1.0 and p["source"] == source
        if source == "agent":
            assert seq == 7
        # rank 2 never arrived: its last all-reduce is the one before, done; its stack shows where it is
        p2 = pos[2]
        assert p2["step"] == 6 and p2["phase"] == "data" and p2["open_s"] >= 2.0
        assert (p2["coll_op"], p2["coll_seq"], p2["coll_done"]) == ("all_reduce", seq - 1, True), p2
        assert p2["stack"][-1]["func"] == "read_batch_from_a_dead_filesystem" and p2["stack"][-1]["file"] == "hang.py"
        assert p2["stack"][-2]["func"] == "<module>" and len(p2["stack"]) <= 12

        # the server's verdict, while the job still hangs
        deadline = time.monotonic() + 60
        h = _health(srv.url, rid)
        while h["state"] != "hung" and time.monotonic() < deadline:
            time.sleep(0.5)
            h = _health(srv.url, rid)
        assert h["state"] == "hung", h
        assert h["missing_ranks"] == [2], h
        assert h["collective"]["op"] == "all_reduce" and h["collective"]["seq"] == seq, h
        assert any(f["func"] == "read_batch_from_a_dead_filesystem" for f in h["stacks"]["2"]), h["stacks"]
    finally:
        _kill(proc)  # the job is then killed: nothing from it is left running


def test_a_rank_that_raises_is_the_root_cause_with_its_exception(srv: Any, db_url: str, tmp_path: Path) -> None:
    proc = _launch(RAISE, tmp_path, srv, "raises", 2)
    code, out = _finish(proc)
    assert code == 1, out
    assert "ValueError: batch 3 has NaN labels" in out  # the job's own traceback is still printed
    rid = _run_id(srv.url, "raises")
    h = _wait_failed(srv.url, rid)
    rows = _rows(db_url, "SELECT * FROM run_failures WHERE run_id = :r ORDER BY ts", r=rid)
    by = {(int(f["rank"]), f["source"]): f for f in rows}
    exc = by[(1, "exception")]
    assert exc["exception"] == "ValueError" and exc["message"] == "batch 3 has NaN labels" and exc["step"] == 3
    assert exc["frames"][-1] == {"file": "raises.py", "line": 16, "func": "check_the_batch"}
    assert exc["frames"][-2]["func"] == "<module>"
    launcher = by[(1, "launcher")]
    assert launcher["exit_code"] == 1 and launcher["signal"] is None
    assert rows[0]["rank"] == 1  # the first failure by time is the raising rank
    assert h["state"] == "failed", h
    assert h["failures"][0]["rank"] == 1 and h["failures"][0]["exception"] == "ValueError", h
    assert _runs(srv.url, name="raises")[0]["status"] == "failed"


def test_a_sigkilled_rank_is_reported_by_the_launcher(srv: Any, db_url: str, tmp_path: Path) -> None:
    proc = _launch(KILL, tmp_path, srv, "killed", 2)
    code, out = _finish(proc)
    assert code != 0, out
    rid = _run_id(srv.url, "killed")
    h = _wait_failed(srv.url, rid)
    rows = _rows(db_url, "SELECT * FROM run_failures WHERE run_id = :r ORDER BY ts", r=rid)
    launcher = [f for f in rows if f["source"] == "launcher"]
    # first the killed rank; rank 0, stopped by torchrun afterwards (SIGTERM), comes after it
    assert [(f["rank"], f["signal"], f["exit_code"]) for f in launcher][0] == (1, "SIGKILL", -9), rows
    brief = [(f["rank"], f["source"], f["ts"], f["exit_code"], f["signal"], f["message"]) for f in rows]
    assert all(f["ts"] > launcher[0]["ts"] for f in rows if f["rank"] == 0), brief
    assert not [f for f in rows if f["rank"] == 1 and f["source"] != "launcher"]  # it could say nothing itself
    assert h["state"] == "failed" and any(f["rank"] == 1 for f in h["failures"]), h
    assert _runs(srv.url, name="killed")[0]["status"] == "failed"


def test_a_restarted_job_is_two_attempts_of_one_job_with_a_declared_pause(srv: Any, db_url: str, tmp_path: Path) -> None:
    proc = _launch(RESTART, tmp_path, srv, "restarts", 2, "--max-restarts", "1")
    seen: set[str] = set()  # the states attempt 1 is in while it runs (its pause included)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            for r in _runs(srv.url, name="restarts"):
                if r["attempt"] == 1:
                    seen.add(_health(srv.url, int(r["id"]))["state"])
            time.sleep(0.5)
    finally:
        code, out = _finish(proc, timeout=60)
    assert code == 0, out
    assert "running" in seen and not seen & {"stalled", "hung", "failed"}, seen  # a declared pause is no stall
    deadline = time.monotonic() + 30
    runs = _runs(srv.url, name="restarts")
    while time.monotonic() < deadline and not (len(runs) == 2 and {r["status"] for r in runs} == {"failed", "finished"}):
        time.sleep(0.5)
        runs = _runs(srv.url, name="restarts")
    runs.sort(key=lambda r: r["attempt"])
    assert [r["attempt"] for r in runs] == [0, 1], runs
    assert runs[0]["job_id"] and runs[0]["job_id"] == runs[1]["job_id"]
    assert [r["status"] for r in runs] == ["failed", "finished"], runs
    first, second = (int(r["id"]) for r in runs)
    f = _rows(db_url, "SELECT * FROM run_failures WHERE run_id = :r ORDER BY ts", r=first)
    assert any(x["rank"] == 1 and x["source"] == "exception" and x["message"] == "lost a node" for x in f), f
    assert any(x["rank"] == 1 and x["source"] == "launcher" and x["exit_code"] == 1 for x in f), f
    assert not _rows(db_url, "SELECT * FROM run_failures WHERE run_id = :r", r=second)
    # the declared pause of attempt 1 (and its checkpoint load: a small file, so no checkpoint pause)
    ev = _rows(db_url, "SELECT rank, step, data FROM run_events WHERE run_id = :r AND kind = 'pause' ORDER BY ts", r=second)
    for rank in (0, 1):
        mine = [e["data"] for e in ev if e["rank"] == rank]
        assert [(d["reason"], d["state"]) for d in mine] == [("eval", "begin"), ("eval", "end")], ev
        assert mine[0]["expected_s"] == 6.0 and 6.0 <= mine[1]["duration_s"] < 10.0
    pauses = _rows(db_url, "SELECT * FROM run_pauses WHERE run_id = :r", r=second)
    assert {(p["rank"], p["reason"]) for p in pauses} == {(0, "eval"), (1, "eval")}
    assert all(p["open_since"] is None and p["total_s"] >= 6.0 for p in pauses), pauses
    assert _health(srv.url, second)["state"] == "finished"
    alerts = httpx.get(f"{srv.url}/api/v1/alerts", params={"run_id": second}, timeout=10).json()["alerts"]
    assert not alerts, alerts  # no hang or stall alert for a declared pause
