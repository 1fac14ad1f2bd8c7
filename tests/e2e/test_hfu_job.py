"""MFU and HFU end to end: a real 2-rank `torchrun` CPU job (gloo, DDP) trains an activation-checkpointed
model on padded batches with the agent measuring its FLOPs, streaming into the real server. The stored
model FLOPs equal the un-checkpointed model's for the real tokens only, the hardware FLOPs add the
recomputed forward over every padded position, and the summary's ``hfu`` / ``recompute_overhead``
follow (expectations from FlopCounterMode on the plain model, tests/agent/ckpt_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleetscope.server.db import make_engine
from sqlalchemy import text

AGENT_TESTS = Path(__file__).resolve().parents[1] / "agent"
BATCH, SEQ, REAL, STEPS, PEAK = 4, 32, 96, 5, 1e12
PADDED = BATCH * SEQ

JOB = f"""
import os, sys
import torch
import torch.distributed as dist
from torch.utils.checkpoint import set_checkpoint_early_stop
import fleetscope.agent as fs
from ckpt_model import D_IN, Net

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
run = fs.init("hfu-job", model_family="ckpt-mlp", peak_flops={PEAK}, server=sys.argv[1], token=sys.argv[2],
              spool_dir=os.path.join(sys.argv[3], str(rank)))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(Net("nonreentrant"))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range({STEPS}):
    with run.step(tokens={REAL}, padded_tokens={PADDED}):
        x = torch.randn({BATCH}, {SEQ}, D_IN)
        with run.phase("forward"), set_checkpoint_early_stop(False):  # recompute whole blocks
            loss = model(x).square().mean()
        with run.phase("backward"):
            loss.backward()
        with run.phase("optimizer"):
            opt.step()
            opt.zero_grad()
stats = run.stats()
run.finish()
dist.destroy_process_group()
assert stats["internal_errors"] == 0, stats
"""


def test_checkpointed_padded_job_reports_mfu_and_hfu(live_server: Any, tmp_path: Path) -> None:
    sys.path.insert(0, str(AGENT_TESTS))
    import torch
    from ckpt_model import expectations

    torch.set_num_threads(1)
    exp = expectations(BATCH, SEQ)
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(AGENT_TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "job.py",
           live_server.url, live_server.token, str(tmp_path / "spool")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    live_server.compact()

    c = httpx.Client(base_url=live_server.url, timeout=10)
    (run,) = c.get("/api/v1/runs", params={"name": "hfu-job"}).json()["runs"]
    eng = make_engine(live_server.db_url, pool_size=1)
    try:
        with eng.connect() as conn:
            rows = conn.execute(text("SELECT step, n_ranks, flops, hw_flops, tokens, padded_tokens FROM steps "
                                     "WHERE run_id = :r ORDER BY step"), {"r": run["id"]}).fetchall()
    finally:
        eng.dispose()
    assert [r.step for r in rows] == list(range(STEPS)) and all(r.n_ranks == 2 for r in rows)
    for r in rows:
        # model FLOPs: the plain model's, for the real tokens only (sums over the 2 ranks)
        assert r.flops == pytest.approx(2 * exp["model"] * REAL / PADDED, rel=0.01)
        # hardware FLOPs: the recomputed forward included, over every padded position
        assert r.hw_flops == pytest.approx(2 * exp["hw"], rel=0.01)
        assert (r.tokens, r.padded_tokens) == (2 * REAL, 2 * PADDED)

    s = c.get(f"/api/v1/runs/{run['id']}/summary").json()
    assert s["flops_source"] == "measured"
    assert s["mfu"] is not None and s["hfu"] is not None
    # same steps, same step times: HFU / MFU is the hardware-to-model ratio of each step
    assert s["hfu"] / s["mfu"] == pytest.approx(exp["hw"] / exp["model"] * PADDED / REAL, rel=1e-3)
    # recomputation, net of padding: the blocks' forward over the model's FLOPs
    assert s["recompute_overhead"] == pytest.approx(exp["recompute"] / exp["model"], rel=0.01)
    assert 0.2 < s["recompute_overhead"] < 0.45
    c.close()
