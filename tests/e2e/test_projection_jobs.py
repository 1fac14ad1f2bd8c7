"""A projection checked on real jobs (issue 33): a 2-rank CPU job (torchrun + gloo, unmodified, through
``fleetscope run``) projected to 4 ranks before any 4-rank run exists, then the 4-rank job of the same
family and config measured; the projected step is compared with the measured one, the track record lists
the blind check with its error, and the projection's parts say that communication grew and compute stayed.

The job is comm-bound in a way the machine's cores do not decide: its "compute" is a ``time.sleep`` inside
the model's forward (no CPU, so 4 ranks on 2 cores still compute in the same time), and each step
all-reduces a 16 MiB buffer (the gradients of a 4 M-parameter model) — a clear share of the step.

The gloo all-reduce itself runs on the CPU: 4 ranks on a 2-core machine share the cores, so it takes
2–3× the 2-rank time, not the 1.5× the ring's 2(n−1)/n alone gives. That is this cluster's bandwidth at
4 ranks, and the projection reads it the way it reads a real cluster's: from ``fleetscope bench``'s
all_reduce busbw at 2 and 4 ranks (posted first, as the bench CLI posts them), at the job's message size.
Without those points the 4-rank time would be extrapolated by the ring model alone (×1.5) and the projection
would under-project this oversubscribed host; docs/analysis.md "Projections" says to bench first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetscope.bench import collective_busbw

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
FAMILY = "proj-sleep-allreduce"
STEPS = 60
SLEEP_S = 0.05  # the "compute" of one step
BUF_BYTES = 16 << 20  # all-reduced once per step
BENCH_ITERS = 120
# Tolerances, from measurements on the shared 2-core VM at load average 4-9 (other suites running): with 60
# steps and 60 bench iterations the projected step was off by -7.9 %, +4.6 %, -1.2 %, +21.6 % (exposed comm
# -18 %, +11 %, -0.5 %, +42 %; compute within 2 %); with 30 steps and 40 iterations, errors reached -36 % and
# once +71 %, when a load burst doubled the 2-rank run's all-reduce (the projection carries the run's own
# comm level, and the bench's 4/2-rank ratio ranged 2.1-3.1x against the jobs' 2.2-3.0x). The comm is CPU
# work that other processes slow down at random, the sleep is not; hence 35 % on the step and 75 % on the
# exposed comm (about half the 4-rank step), 1.6x the worst error seen with these sizes. With 120 bench
# iterations (as here): -4.1 %, +8.7 %, +17.5 % on the step (comm -9 %, +15 %, +38 %).
STEP_TOL = 0.35
COMM_TOL = 0.75  # exposed comm alone: all of the load's noise lands there
COMPUTE_TOL = 0.15  # the sleep, plus a few ms of Python around it
GROWTH = 1.5  # at least the ring's 2(n-1)/n from 2 to 4 ranks (measured: 2.2-3.0x on 2 cores)

SCRIPT = f"""
import sys
import time
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")


class Work(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep({SLEEP_S})  # compute that needs no CPU
        return (self.w * x).sum()


model = Work()
opt = torch.optim.SGD(model.parameters(), lr=0.0)
grads = torch.zeros({BUF_BYTES // 4})
for step in range({STEPS}):
    model(torch.ones(4)).backward()
    dist.all_reduce(grads)  # the gradient exchange
    opt.step()
    opt.zero_grad()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""


def _job(live_server: Any, tmp_path: Path, name: str, ranks: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / f"spool-{name}"),
           "FLEETSCOPE_FAMILY": FAMILY}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", name, "--", TORCHRUN, "--standalone", "--nproc-per-node", str(ranks),
                          "train.py"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": name}, timeout=10,
                     headers={"Authorization": f"Bearer {live_server.token}"}).json()["runs"]
    assert len(runs) == 1 and runs[0]["world_size"] == ranks, runs
    live_server.compact()
    return int(runs[0]["id"])


def test_a_2_rank_job_projected_to_4_ranks_matches_the_4_rank_job(live_server: Any, tmp_path: Path) -> None:
    """Blind projection 2 → 4 ranks within STEP_TOL = 35 % of the 4-rank run's measured steady (median)
    step. The number: measured errors were −7.9 %, +4.6 %, −1.2 %, +21.6 % at load average 5–7 on the
    2-core VM; the exposed comm (gloo, CPU work) carries all of the load's noise and is half the 4-rank
    step, so a load burst during the bench or one of the short runs moves the step by ~20 %; 35 % is 1.6×
    the worst seen. The tighter claims are in the parts: compute held within 15 %, comm grown > 1.5×."""
    (tmp_path / "train.py").write_text(SCRIPT)
    # this cluster's all_reduce bandwidth at the job's message size, at 2 and 4 ranks (as `fleetscope bench`
    # measures and posts it; more iterations than its default, for a steadier median on a loaded machine)
    points = collective_busbw([BUF_BYTES], world=2, iters=BENCH_ITERS) \
        + collective_busbw([BUF_BYTES], world=4, iters=BENCH_ITERS)
    r = httpx.post(f"{live_server.url}/api/v1/benchmarks", json={"cluster": "this-host", "points": points},
                   headers={"Authorization": f"Bearer {live_server.token}"}, timeout=60)
    assert r.status_code == 200, r.text

    small = _job(live_server, tmp_path, "proj-2", 2)
    with live_server.client() as c:
        out = c.projection(small, world_size=4)  # blind: no 4-rank run exists yet
        rec = c.projection_track_record(FAMILY)
    assert out["status"] == "ok", out
    assert out["estimated"] is True
    assert rec["checked"] == [] and [p["from_run"] for p in rec["pending"]] == [small]
    [coll] = out["basis"]["collectives"]
    assert (coll["op"], coll["dim"], coll["group_size"], coll["to_group_size"]) == ("all_reduce", "dp", 2, 4)
    assert coll["bytes_per_call"] == coll["to_bytes_per_call"] == BUF_BYTES
    # both ends of the comm ratio read from the bench's measurements at 2 and 4 ranks, not extrapolated
    assert coll["how"] == "measured" and all(s.startswith("bench:") for s in out["basis"]["sources"]), out["basis"]

    large = _job(live_server, tmp_path, "proj-4", 4)
    with live_server.client() as c:
        m2 = c.summary(small)["decomposition"]
        m4 = c.summary(large)["decomposition"]
        rec = c.projection_track_record(FAMILY)
    measured = m4["step_s"]
    err = out["step_s"] / measured - 1
    print(f"projection 2 -> 4 ranks: error={err:+.3f} projected={out['step_s']:.4f} measured={measured:.4f} "
          f"2-rank step={m2['step_s']:.4f} "
          f"comm {out['parts']['comm_exposed']:.4f} vs {m4['comm_exposed_s']:.4f} (2: {m2['comm_exposed_s']:.4f}) "
          f"compute {out['parts']['compute']:.4f} vs {m4['compute_s']:.4f} "
          f"bench {[round(p['value'], 3) for p in points]}")
    # (a) the projected step is the measured 4-rank step within the tolerance; both are slower than 2 ranks
    assert abs(err) <= STEP_TOL, (out["step_s"], measured)
    assert out["step_s"] > m2["step_s"] and measured > m2["step_s"], (out["step_s"], measured, m2["step_s"])

    # (b) the track record lists that projection, checked blind against the 4-rank run, with its error
    assert rec["pending"] == []
    [chk] = rec["checked"]
    assert (chk["from_run"], chk["measured_run"], chk["from_world_size"], chk["world_size"]) == (small, large, 2, 4)
    assert chk["blind"] is True
    assert chk["projected_step_s"] == pytest.approx(out["step_s"])
    assert chk["measured_step_s"] == pytest.approx(measured)
    assert chk["error"] == pytest.approx(err)
    assert rec["summary"]["n"] == 1 and rec["summary"]["by_ratio"]["2"]["worst_abs_error"] == pytest.approx(abs(err))

    # (c) the parts: compute (the sleep) stayed, exposed communication grew, each as the 4-rank run measured
    parts, before = out["parts"], out["basis"]["measured_parts"]
    assert parts["compute"] == pytest.approx(before["compute"])
    assert abs(parts["compute"] / m4["compute_s"] - 1) <= COMPUTE_TOL, (parts["compute"], m4["compute_s"])
    assert parts["comm_exposed"] > GROWTH * before["comm_exposed"], (parts, before)
    assert m4["comm_exposed_s"] > GROWTH * m2["comm_exposed_s"], (m4, m2)
    assert abs(parts["comm_exposed"] / m4["comm_exposed_s"] - 1) <= COMM_TOL, (parts, m4)
