"""`fleetscope run -- COMMAND`: unmodified scripts instrumented by the launcher, in real processes
(torchrun + gloo on CPU) against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
PARAMS = 8 * 16 + 16 + 16 * 1 + 1  # the DDP script's model

DDP_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from contextlib import nullcontext
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    for micro in range(2):  # gradient accumulation: two backward passes per optimizer step
        with model.no_sync() if micro == 0 else nullcontext():
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
    opt.step()
    opt.zero_grad()
with torch.no_grad():
    model.eval()
    model(torch.randn(4, 8))  # an eval forward after training opens nothing
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {rank} done\\n")  # one write: the two ranks share the pipe
"""


def _fs_run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    full.pop("FLEETSCOPE_RUN_NAME", None)
    return subprocess.run([*FS_RUN, *args], capture_output=True, text=True, timeout=timeout, env=full, cwd=cwd)


def _runs(url: str, **params: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = httpx.get(f"{url}/api/v1/runs", params=params, timeout=10).json()["runs"]
    return runs


def _wait_rank_steps(url: str, name: str, n: int, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        runs = _runs(url, name=name)
        if runs and runs[0]["rank_steps"] >= n or time.monotonic() > deadline:
            assert runs, f"run {name} not registered"
            return runs[0]
        time.sleep(0.3)


def test_unmodified_ddp_job_under_torchrun_lands_in_one_run(live_server: Any, engine: Any, tmp_path: Path) -> None:
    from fleetscope.server.store.steps import rank_step_matrix

    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    env = {"FLEETSCOPE_SERVER": live_server.url, "FLEETSCOPE_TOKEN": live_server.token,
           "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    res = _fs_run(["--name", "zero-code", "--family", "f", "--",
                   TORCHRUN, "--standalone", "--nproc-per-node", "2", "train.py"], env, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(res.stdout.split("\n")) == ["", "rank 0 done", "rank 1 done"], res.stdout

    run = _wait_rank_steps(live_server.url, "zero-code", 12)
    assert len(_runs(live_server.url)) == 1  # both ranks in one run; torchrun's own process in none
    assert run["rank_steps"] == 12, run  # 6 optimizer steps x 2 ranks: micro-steps are not steps
    assert run["world_size"] == 2 and run["model_family"] == "f" and run["status"] == "finished"
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    assert summary["steps"] == 6 and summary["rank_steps"] == 12

    # the decomposition of automatic mode: forward on the top-level module, backward up to the
    # optimizer step, data from the previous optimizer step to the first forward (none in step 0)
    cols = {f: rank_step_matrix(engine, run["id"], f)[2] for f in
            ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "compute_s", "comm_exposed_s", "other_s")}
    assert cols["step_s"].shape == (6, 2) and not np.isnan(cols["step_s"]).any()
    for f in ("forward_s", "backward_s", "optimizer_s"):
        assert (cols[f] > 0).all(), f
    assert np.isnan(cols["data_s"][0]).all() and (cols["data_s"][1:] > 0).all()
    parts = np.nan_to_num(cols["data_s"]) + cols["compute_s"] + cols["comm_exposed_s"] + cols["other_s"]
    np.testing.assert_allclose(parts, cols["step_s"], rtol=1e-5, atol=1e-6)

    # DDP's gradient all-reduce, through the comm hook: once per optimizer step (no_sync on micro 0)
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/collectives", timeout=10).json()["collectives"]
    ar = [c for c in colls if c["op"] == "all_reduce" and c["group_size"] == 2]
    assert ar, colls
    assert sum(c["bytes"] for c in ar) == PARAMS * 4 * 2 * 6


def test_exit_code_and_stdout_pass_through(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(textwrap.dedent("""
        import sys
        import torch
        torch.set_num_threads(1)
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
        import fleetscope.agent as fs
        run = fs.get_run()
        sys.stderr.write(f"steps={run.stats()['steps'] if run else None}\\n")
        print("the job's own line: 42 ümlaut", flush=True)
        sys.exit(3)
    """))
    env = {"FLEETSCOPE_OFFLINE": "1", "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    res = _fs_run(["--name", "exit3", "--", sys.executable, "fail.py"], env, tmp_path)
    assert res.returncode == 3, res.stderr[-3000:]
    assert res.stdout == "the job's own line: 42 ümlaut\n"
    assert "steps=3" in res.stderr  # it was instrumented
    missing = _fs_run(["--", "/nonexistent/command"], {}, tmp_path)
    assert missing.returncode == 127


def test_existing_sitecustomize_is_chained(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.stderr.write('user sitecustomize ran\\n')\n")
    env = {"PYTHONPATH": str(site), "FLEETSCOPE_OFFLINE": "1"}
    res = _fs_run(["--", sys.executable, "-c", "import sitecustomize; print(sitecustomize.__file__)"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "user sitecustomize ran" in res.stderr
    assert res.stdout.strip() == str(site / "sitecustomize.py")


def test_script_that_calls_init_itself_is_instrumented_once(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "own.py").write_text(textwrap.dedent("""
        import torch
        import fleetscope.agent as fs
        torch.set_num_threads(1)
        run = fs.init(name="explicit-run", model_family="own")
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        run.instrument(model=m, optimizer=opt)
        for _ in range(4):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        run.finish()
    """))
    env = {"FLEETSCOPE_SERVER": live_server.url, "FLEETSCOPE_TOKEN": live_server.token,
           "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    res = _fs_run(["--name", "launcher-name", "--", sys.executable, "own.py"], env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = _wait_rank_steps(live_server.url, "explicit-run", 4)
    time.sleep(1.5)  # past the compaction grace: a second (auto) run or doubled steps would show now
    assert [r["name"] for r in _runs(live_server.url)] == ["explicit-run"]
    assert _runs(live_server.url, name="explicit-run")[0]["rank_steps"] == 4
    assert run["model_family"] == "own"
