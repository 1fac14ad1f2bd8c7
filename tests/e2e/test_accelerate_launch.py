"""`fleetscope run -- accelerate launch`: HF Accelerate's launcher runs torchrun's elastic agent in its
own process (``accelerate/commands/launch.py`` ``_run_torchrun``). Real processes, 2 gloo ranks on CPU,
a real server on loopback: one run of both ranks with every step; what the script passes to
``accelerator.log`` arrives as ``accelerate/…`` scalars (no tracker configured); a rank that exits with
code 3 gives the launcher-level failure record from accelerate's process, as under torchrun.

``--multi_gpu`` is what makes accelerate start torchrun's agent (``--cpu`` runs the script once, in one
process); ``ACCELERATE_USE_CPU=1`` keeps the ranks on CPU (gloo) on a machine with GPUs too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(180)

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
STEPS = 4

TRAIN = f"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
from accelerate import Accelerator  # noqa: E402

acc = Accelerator()  # no tracker: accelerator.log reaches no logger, only fleetscope's capture
rank = acc.process_index
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = acc.prepare(model, opt)
logged = []
for i in range({STEPS}):
    if rank == 1 and i == int(os.environ.get("EXIT_AT", "-1")):
        sys.exit(3)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    value = loss.item()
    logged.append(value)
    acc.log({{"loss": value, "loss_t": loss.detach(), "lr": {{"group0": 0.01}}, "note": "text"}}, step=i)
with open(f"logged_{{rank}}.json", "w") as f:
    json.dump(logged, f)
sys.stdout.write(f"rank {{rank}} of {{acc.num_processes}} {{acc.distributed_type}} run_id={{os.environ.get('TORCHELASTIC_RUN_ID')}}\\n")
acc.end_training()
"""


def _launch(srv: Any, tmp_path: Path, name: str, **extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLEETSCOPE_RUN_NAME", "FLEETSCOPE_JOB_ID", "FLEETSCOPE_LAUNCH_ID", "FLEETSCOPE_ATTEMPT",
                        "TORCHELASTIC_RUN_ID", "PET_RDZV_ID") and not k.startswith("SLURM")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1",
                "HF_HOME": str(tmp_path / "hf"),  # no default accelerate config from the machine
                "FLEETSCOPE_SERVER": srv.url, "FLEETSCOPE_TOKEN": srv.token,
                "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), **extra})
    cmd = [*FS_RUN, "--name", name, "--", ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "train.py"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)


def _wait_run(srv: Any, name: str, done: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        runs = httpx.get(f"{srv.url}/api/v1/runs", params={"name": name}, timeout=10).json()["runs"]
        if runs and done(runs[0]):
            return dict(runs[0])
        assert time.monotonic() < deadline, runs
        time.sleep(0.3)


def test_accelerate_launch_is_one_run_with_accelerator_log_scalars(live_server: Any, tmp_path: Path) -> None:
    res = _launch(live_server, tmp_path, "acc")
    out = res.stdout[-3000:] + res.stderr[-5000:]
    assert res.returncode == 0, out
    assert "internal error" not in res.stderr and "capture" not in res.stderr, out
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    # two ranks of torchrun's agent inside accelerate's process, with torchrun's default rendezvous id
    assert lines == [f"rank {r} of 2 DistributedType.MULTI_CPU run_id=none" for r in (0, 1)], out

    run = _wait_run(live_server, "acc", lambda r: r["status"] == "finished" and r["rank_steps"] >= 2 * STEPS)
    runs = httpx.get(f"{live_server.url}/api/v1/runs", timeout=10).json()["runs"]
    assert len(runs) == 1, runs  # both ranks in one run; accelerate's own process in none
    assert run["world_size"] == 2 and run["rank_steps"] == 2 * STEPS, run
    assert run["job_id"] and run["job_id"] != "none", run  # the launch's own id: torchrun's "none" names nothing
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    assert summary["steps"] == STEPS and summary["rank_steps"] == 2 * STEPS

    logged = {r: json.loads((tmp_path / f"logged_{r}.json").read_text()) for r in (0, 1)}
    body = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/scalars", timeout=10).json()["scalars"]
    assert sorted(body) == ["accelerate/loss", "accelerate/loss_t", "accelerate/lr/group0"], sorted(body)
    for key in ("accelerate/loss", "accelerate/loss_t"):  # the API shows the lowest rank's value per step
        assert body[key]["step"] == list(range(STEPS))
        assert body[key]["value"] == pytest.approx(logged[0], rel=1e-6)
    assert body["accelerate/lr/group0"]["value"] == pytest.approx([0.01] * STEPS)
    with live_server.state.engine.connect() as c:  # every rank's own values, at the script's steps
        rows = c.execute(text("SELECT rank, step, value FROM run_scalars WHERE run_id = :r AND name = 'accelerate/loss' "
                              "ORDER BY rank, step"), {"r": run["id"]}).fetchall()
    assert [(r, s) for r, s, _ in rows] == [(r, s) for r in (0, 1) for s in range(STEPS)]
    assert [v for r, _, v in rows if r == 1] == pytest.approx(logged[1], rel=1e-6)


def test_a_rank_exiting_under_accelerate_launch_gets_the_launcher_failure(live_server: Any, tmp_path: Path) -> None:
    res = _launch(live_server, tmp_path, "acc-exit", EXIT_AT="2")
    out = res.stdout[-3000:] + res.stderr[-5000:]
    assert res.returncode != 0, out  # accelerate raises torchrun's ChildFailedError

    run = _wait_run(live_server, "acc-exit", lambda r: r["status"] == "failed")
    assert len(httpx.get(f"{live_server.url}/api/v1/runs", timeout=10).json()["runs"]) == 1
    with live_server.state.engine.connect() as c:
        rows = [dict(r) for r in c.execute(text("SELECT * FROM run_failures WHERE run_id = :r ORDER BY ts"),
                                           {"r": run["id"]}).mappings()]
    brief = [(f["rank"], f["source"], f["exit_code"], f["signal"]) for f in rows]
    by = {(f["rank"], f["source"]): f for f in rows}
    # from accelerate's own process, which runs torchrun's elastic agent: rank 1 exited with code 3
    launcher = by.get((1, "launcher"))
    assert launcher is not None and (launcher["exit_code"], launcher["signal"]) == (3, None), brief
    assert launcher["step"] is None and launcher["exception"] is None, launcher
    if (0, "launcher") in by:  # rank 0, stopped by the agent after rank 1 exited
        assert (by[(0, "launcher")]["exit_code"], by[(0, "launcher")]["signal"]) == (-15, "SIGTERM"), brief
    own = by.get((1, "exit"))  # the rank's own record of its sys.exit(3), in the step it left
    assert own is not None and own["exit_code"] == 3 and own["step"] == 2, brief
    assert rows[0]["rank"] == 1 and rows[0]["source"] == "exit", brief  # the first failure by time
    health = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/health", timeout=10).json()
    assert any(f["rank"] == 1 for f in health["failures"]), health
