"""A node whose launcher dies is "node lost", named: two nodes of one torchrun job (two concurrent
`fleetscope run --job-id J -- torchrun --nnodes 2 --node-rank K …` launches on loopback, distinct
`FLEETSCOPE_NODE`), node-b's whole launch SIGKILLed mid-training as a dying machine would end it. The
survivors on node-a fail on gloo ("connection closed by peer"); the run is one run, it ends failed, and
its health names node-b (its node, its rank) as the root cause, ahead of node-a's connection errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port

pytestmark = pytest.mark.timeout(300)

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# long enough to be killed in the middle of it (it is killed after a few steps)
TRAIN = """
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3000):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.fixture
def srv(db_url: str) -> Iterator[Any]:
    from conftest import start_server

    # silence: how long a node may say nothing before it is called lost (FLEETSCOPE_STALL_SILENCE_S)
    s = start_server(db_url, health_interval_s=0.5, stall_min_s=4.0, stall_first_s=60.0, stall_silence_s=4.0)
    yield s
    s.stop()


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


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the launch and everything below it at once (a node losing power)."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"{what}: not in {timeout:.0f} s (last: {last!r})")


def test_a_node_whose_launcher_dies_is_named_lost_as_the_root_cause(srv: Any, engine: Any, tmp_path: Path) -> None:
    from fleetscope.server.store.health import node_map

    (tmp_path / "train.py").write_text(TRAIN)
    port = free_port()
    ours = ("FLEETSCOPE_RUN_NAME", "FLEETSCOPE_JOB_ID", "FLEETSCOPE_LAUNCH_ID", "FLEETSCOPE_ATTEMPT", "FLEETSCOPE_NODE",
            "TORCHELASTIC_RUN_ID", "PET_RDZV_ID", "PMIX_NAMESPACE")
    base = {k: v for k, v in os.environ.items() if k not in ours and not k.startswith("SLURM")}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for k, node in enumerate(("node-a", "node-b")):
            env = {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": srv.url,
                   "FLEETSCOPE_TOKEN": srv.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / f"spool-{node}"),
                   "FLEETSCOPE_HEARTBEAT_S": "1", "FLEETSCOPE_NODE": node}
            cmd = [*FS_RUN, "--job-id", "job-lost", "--", TORCHRUN, "--nnodes", "2", "--node-rank", str(k),
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "job-lost", "train.py"]
            procs[node] = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, start_new_session=True)

        def one_run_with_both_nodes() -> dict[str, Any] | None:
            runs = httpx.get(f"{srv.url}/api/v1/runs", timeout=10).json()["runs"]
            if len(runs) != 1 or runs[0]["rank_steps"] < 6:
                return None
            nodes = node_map(engine, runs[0]["id"])
            return runs[0] if sorted(nodes.values()) == ["node-a", "node-b"] else None

        run = _wait(one_run_with_both_nodes, 120, "both nodes of the job training in one run")
        rid = run["id"]
        nodes = node_map(engine, rid)
        lost_rank = next(r for r, n in nodes.items() if n == "node-b")

        _kill_tree(procs["node-b"])  # node-b dies: its launcher, torchrun and worker, with no word
        out, err = procs["node-a"].communicate(timeout=180)
        assert procs["node-a"].returncode != 0, out[-2000:] + err[-4000:]  # the survivor fails on gloo

        def lost() -> dict[str, Any] | None:
            h = httpx.get(f"{srv.url}/api/v1/runs/{rid}/health", timeout=10).json()
            return h if h["state"] == "failed" and h.get("cause") == "node_lost" else None

        h = _wait(lost, 60, "the run failed with node-b lost")
    finally:
        for p in procs.values():
            if p.poll() is None:
                _kill_tree(p)
            p.communicate()
    assert h["lost_nodes"] == [{"node": "node-b", "ranks": [lost_rank], "rank_count": 1}], h
    assert h["missing_nodes"] == ["node-b"] and h["missing_ranks"] == [lost_rank], h
    assert f"node node-b lost — its rank {lost_rank} stopped with no failure or exit reported" in h["finding"], h
    # node-a's errors are there, as what followed: none of them is from node-b
    assert h["failures"] and all(nodes[f["rank"]] == "node-a" for f in h["failures"]), h["failures"]
    # one alert for the incident, naming node-b as the root cause (raised by the health pass, which
    # concludes what /health evaluates when read within one interval)

    def health_alerts() -> list[dict[str, Any]]:
        return [a for a in httpx.get(f"{srv.url}/api/v1/alerts", timeout=10).json()["alerts"]
                if a["run_id"] == rid and a["kind"] in ("hang", "node_lost", "failure")]

    _wait(lambda: [a for a in health_alerts() if a["details"].get("root_cause", {}).get("cause") == "node_lost"], 30,
          "the failure alert naming node-b")
    alerts = health_alerts()
    assert len(alerts) == 1, alerts
    runs = httpx.get(f"{srv.url}/api/v1/runs", timeout=10).json()["runs"]
    assert len(runs) == 1 and runs[0]["status"] == "failed" and runs[0]["world_size"] == 2, runs
    (a,) = alerts
    assert a["details"]["root_cause"]["cause"] == "node_lost" and a["details"]["root_cause"]["nodes"] == ["node-b"]
    assert a["details"]["missing_nodes"] == ["node-b"] and "node node-b lost" in a["details"]["finding"]
