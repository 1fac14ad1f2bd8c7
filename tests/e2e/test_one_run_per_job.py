"""One job, one run: every node of a job runs its own `fleetscope run` (or its own `fs.init()`), with no
coordination between them, and all of them land in one run identified by the job's own id — torchrun's
`--rdzv-id`, SLURM's job and step — in real processes against a real server on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import free_port

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 3

TRAIN = f"""
import os
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range({STEPS}):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} run_id={{os.environ['TORCHELASTIC_RUN_ID']}} job={{os.environ.get('FLEETSCOPE_JOB_ID')}}\\n")
"""

# a SLURM task: the agent's own API, no torch, `fs.init()` without a name
TASK = f"""
import fleetscope.agent as fs
run = fs.init()
for _ in range({STEPS}):
    with run.step():
        with run.phase("forward"):
            pass
run.finish()
"""


def _env(srv: Any, tmp_path: Path, **extra: str) -> dict[str, str]:
    ours = ("FLEETSCOPE_RUN_NAME", "FLEETSCOPE_JOB_ID", "FLEETSCOPE_LAUNCH_ID", "FLEETSCOPE_ATTEMPT", "FLEETSCOPE_NODE",
            "TORCHELASTIC_RUN_ID", "PET_RDZV_ID", "PMIX_NAMESPACE")
    env = {k: v for k, v in os.environ.items() if k not in ours and not k.startswith("SLURM")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": srv.url,
            "FLEETSCOPE_TOKEN": srv.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), **extra}


def _register(srv: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{srv.url}/api/v1/runs", json=body, headers={"Authorization": f"Bearer {srv.token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _runs(srv: Any) -> list[dict[str, Any]]:
    return httpx.get(f"{srv.url}/api/v1/runs", timeout=10).json()["runs"]  # type: ignore[no-any-return]


def _settled(srv: Any, rank_steps: int, timeout: float = 30) -> list[dict[str, Any]]:
    """The runs once the expected rank-steps landed and compaction passed (a second run would show)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = _runs(srv)
        if sum(r["rank_steps"] for r in runs) >= rank_steps or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    time.sleep(1.5)  # past the compaction grace
    return _runs(srv)


def test_two_nodes_of_a_torchrun_job_are_one_run(live_server: Any, engine: Any, tmp_path: Path) -> None:
    from fleetscope.server.store.health import node_map

    (tmp_path / "train.py").write_text(TRAIN)
    port = free_port()
    procs = []
    for node in (0, 1):
        env = _env(live_server, tmp_path, FLEETSCOPE_NODE=f"node-{'ab'[node]}")
        cmd = [*FS_RUN, "--name", "two-nodes", "--", TORCHRUN, "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "job-77", "train.py"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, out[-2000:] + err[-4000:]
        outs.append(out)
    lines = sorted(line for out in outs for line in out.splitlines() if line.startswith("rank "))
    # torchrun's own run id reaches its workers unchanged; the launcher adds no job id of its own
    assert lines == [f"rank {r} run_id=job-77 job=None" for r in range(4)], outs

    (run,) = _settled(live_server, 4 * STEPS)
    assert run["name"] == "two-nodes" and run["job_id"] == "job-77" and run["attempt"] == 0
    assert run["world_size"] == 4 and run["rank_steps"] == 4 * STEPS, run
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    assert summary["steps"] == STEPS and summary["rank_steps"] == 4 * STEPS
    nodes = node_map(engine, run["id"])  # what the health pass names missing ranks' nodes by
    assert sorted(nodes) == [0, 1, 2, 3] and sorted(set(nodes.values())) == ["node-a", "node-b"]
    assert sorted(nodes[r] for r in range(4)) == ["node-a", "node-a", "node-b", "node-b"]


def test_two_slurm_tasks_of_one_step_are_one_run(live_server: Any, engine: Any, tmp_path: Path) -> None:
    """`srun -N2 python task.py` (SLURM_* as srun sets them): one task under `fleetscope run`, the other
    plain; both name the run `<script>-<job>.<step>` themselves."""
    from fleetscope.server.store.health import node_map

    (tmp_path / "task.py").write_text(TASK)
    procs = []
    for task in (0, 1):
        env = _env(live_server, tmp_path, SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(task),
                   SLURM_NTASKS="2", SLURM_NODEID=str(task), SLURM_LOCALID="0", SLURM_NNODES="2",
                   SLURMD_NODENAME=f"gpu-{task}")
        cmd = [*FS_RUN, "--", sys.executable, "task.py"] if task == 0 else [sys.executable, "task.py"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out[-2000:] + err[-4000:]

    runs = _settled(live_server, 2 * STEPS)
    assert len(runs) == 1, runs
    (run,) = runs
    assert run["name"] == "task-4242.0" and run["job_id"] == "4242.0", run
    assert run["world_size"] == 2 and run["rank_steps"] == 2 * STEPS, run
    assert node_map(engine, run["id"]) == {0: "gpu-0", 1: "gpu-1"}


def test_concurrent_registrations_of_one_job_create_one_run(live_server: Any) -> None:
    """Nodes that name the run differently (a time in the name) still join the run of their (owner, job
    id, attempt), however many register at once; a restart is an attempt of its own; a run of the same
    job id started after the first one ended (another `init` in one process) is a run of its own."""
    srv = live_server
    t0 = time.time()
    barrier = threading.Barrier(8)
    answers: list[dict[str, Any]] = []

    def register(i: int) -> None:
        body = {"name": f"node{i}-{t0 + i}", "world_size": 8 if i == 7 else 4, "job_id": "slurm-9", "attempt": 0,
                "started_at": t0}
        barrier.wait()
        answers.append(_register(srv, body))

    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({a["id"] for a in answers}) == 1 and sum(a["created"] for a in answers) == 1, answers
    (run,) = _runs(srv)
    assert run["job_id"] == "slurm-9" and run["world_size"] == 8

    restart = _register(srv, {"name": "node0-x", "world_size": 4, "job_id": "slurm-9", "attempt": 1,
                              "started_at": t0 + 60})
    assert restart["id"] != run["id"] and restart["created"]
    with srv.client() as c:
        c.finish_run(run["id"], "finished", finished_at=t0 + 30)
        late = _register(srv, {"name": "node9", "world_size": 4, "job_id": "slurm-9", "started_at": t0 + 10})
        assert late["id"] == run["id"] and not late["created"]  # a node of that run, late
        c.finish_run(run["id"], "finished", finished_at=t0 + 30)
    later = _register(srv, {"name": "eval", "world_size": 4, "job_id": "slurm-9", "started_at": t0 + 90})
    assert later["id"] not in (run["id"], restart["id"]) and later["created"]
