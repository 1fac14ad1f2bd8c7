"""Device telemetry in a real job: a 2-rank `fleetscope run -- torchrun` CPU job (gloo, DDP) whose ranks read
the fake NVML provider (FLEETSCOPE_FAKE_NVML: device 1 sits at its power cap with SM clocks at 1.41 GHz,
device 0 runs at 1.98 GHz) and whose rank 1 is really slower (a sleep in its forward, so its excess is compute: a data-late rank is sent to its input pipeline, not its GPU) — against a real server
on loopback: ``/devices`` names rank 1 throttled by ``power``, and the summary's straggler (rank 1) carries
the reason in its ``cause``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 40

TRAIN = f"""
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()


class Capped(torch.nn.Linear):
    def forward(self, x):
        if rank == 1:
            time.sleep(0.06)  # the power-capped GPU's rank: really slower, in its compute
        return super().forward(x)


model = DDP(Capped(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range({STEPS}):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""

NORMAL = {"t": 0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_w": 520, "power_limit_w": 700, "temp_c": 61,
          "util": 0.97, "mem_used_bytes": 30 << 30, "throttle": [], "ecc_errors": 0}
CAPPED = {**NORMAL, "sm_clock_mhz": 1410, "power_w": 699, "throttle": ["power"]}


def _env(srv: Any, tmp_path: Path, script: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETSCOPE_", "TORCHELASTIC", "SLURM"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": srv.url,
            "FLEETSCOPE_TOKEN": srv.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"),
            "FLEETSCOPE_FAKE_NVML": str(script), "FLEETSCOPE_DEVICE_WINDOW_S": "1", "FLEETSCOPE_DEVICE_SAMPLE_S": "0.5"}


def _get(srv: Any, path: str) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}{path}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_power_capped_rank_is_named_with_its_reason_in_devices_and_in_the_stragglers_cause(
        live_server: Any, tmp_path: Path) -> None:
    script = tmp_path / "nvml.json"
    script.write_text(json.dumps({"devices": {"0": [NORMAL], "1": [CAPPED]}}))
    (tmp_path / "train.py").write_text(TRAIN)
    cmd = [*FS_RUN, "--name", "device-job", "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", "train.py"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(live_server, tmp_path, script), capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    deadline = time.monotonic() + 60
    while True:  # until compaction folded the steps and the stragglers are known
        (run,) = _get(live_server, "/api/v1/runs")["runs"]
        summary = _get(live_server, f"/api/v1/runs/{run['id']}/summary")
        if (run["rank_steps"] >= 2 * (STEPS - 2) and summary.get("stragglers")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    dev = _get(live_server, f"/api/v1/runs/{run['id']}/devices")
    ranks = {r["rank"]: r for r in dev["ranks"]}
    assert sorted(ranks) == [0, 1], dev
    assert dev["throttled_ranks"] == [1], dev
    assert ranks[1]["reason"] == "power" and ranks[1]["throttle"] == ["power"]
    assert ranks[1]["throttle_share"]["power"] > 0.5
    assert ranks[1]["sm_clock_mhz"] == 1410 and ranks[1]["peers_sm_clock_mhz"] == 1980
    assert ranks[0]["reason"] is None and ranks[0]["throttle"] == [] and ranks[0]["power_limit_w"] == 700
    assert ranks[1]["node"]  # the rank's node, from its registration
    strag = summary["stragglers"]
    assert strag and strag[0]["rank"] == 1, summary["stragglers"]
    cause = strag[0]["cause"]
    assert cause["reason"] == "power", cause
    assert "power cap" in cause["text"] and "1.41 GHz vs 1.98 GHz" in cause["text"], cause
