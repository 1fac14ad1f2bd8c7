"""Pipeline parallelism through the zero-code launcher: an unmodified 2-stage
``torch.distributed.pipelining`` job (torchrun + gloo on CPU) against a real server — each rank's stage
(``pp_stage`` events), the schedule, the send/recv transfers, each stage's own FLOPs (measured), and a
bubble that grows when the same global batch is cut into fewer micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_launcher import TORCHRUN, _fs_run, _runs, _wait_rank_steps

STEPS = 6
BATCH = 512  # the global batch: the same in both configurations
DIM = 1536
LAYERS = 4  # per stage

PP_SCRIPT = f"""
import os
import sys
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
# a matmul-heavy stage: the bubble is waiting for the other stage's compute, not message latency
stage_mod = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear({DIM}, {DIM}), torch.nn.Tanh())
                                  for _ in range({LAYERS})])
stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=int(os.environ["PP_MICROBATCHES"]),
                         loss_fn=lambda out, target: (out - target).pow(2).mean())
opt = torch.optim.SGD(stage_mod.parameters(), lr=1e-3)
for step in range({STEPS}):
    x = torch.randn({BATCH}, {DIM})
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=torch.randn({BATCH}, {DIM}))
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
sys.stdout.write(f"rank {{rank}} done\\n")
"""

P2P = ("send", "recv")


def _pipeline_job(live_server: Any, engine: Any, tmp_path: Path, name: str, microbatches: int) -> dict[str, Any]:
    """Run the job under ``fleetscope run`` with ``microbatches``; check what every run must show and
    return its figures."""
    from fleetscope.server.store.events import run_events
    from fleetscope.server.store.steps import rank_step_matrix

    env = {"FLEETSCOPE_SERVER": live_server.url, "FLEETSCOPE_TOKEN": live_server.token,
           "FLEETSCOPE_SPOOL_DIR": str(tmp_path / f"spool-{name}"), "PP_MICROBATCHES": str(microbatches)}
    res = _fs_run(["--name", name, "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", "pp.py"], env, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(res.stdout.split("\n")) == ["", "rank 0 done", "rank 1 done"], res.stdout
    assert "internal error" not in res.stderr and "failed" not in res.stderr, res.stderr[-3000:]

    run = _wait_rank_steps(live_server.url, name, 2 * STEPS)
    assert run["rank_steps"] == 2 * STEPS and run["world_size"] == 2 and run["status"] == "finished", run
    steps, ranks, step_s = rank_step_matrix(engine, run["id"], "step_s")
    assert step_s.shape == (STEPS, 2) and list(ranks) == [0, 1] and not np.isnan(step_s).any(), step_s

    # the stages: one event per rank, rank r runs stage r of 2; the schedule once per rank
    evs = run_events(engine, run["id"])
    stages = sorted((e["rank"], e["data"]) for e in evs if e["kind"] == "pp_stage")
    assert [(r, d["stage"], d["num_stages"], d["group_rank"], d["group_size"]) for r, d in stages] == [
        (0, 0, 2, 0, 2), (1, 1, 2, 1, 2)], stages
    scheds = sorted((e["rank"], e["data"]) for e in evs if e["kind"] == "pp_schedule")
    assert scheds == [(r, {"schedule": "ScheduleGPipe", "n_microbatches": microbatches, "stages": [r]})
                      for r in (0, 1)], scheds

    # the transfers: activations forward, gradients back, micro-batch by micro-batch
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/collectives", timeout=10).json()["collectives"]
    by_op: dict[str, dict[str, float]] = {}
    for c in colls:
        if c["op"] in P2P:
            agg = by_op.setdefault(c["op"], {"calls": 0, "bytes": 0.0, "exposed_s": 0.0})
            agg["calls"] += c["calls"]
            agg["bytes"] += c["bytes"]
            agg["exposed_s"] += c["exposed_s"]
    assert set(by_op) == set(P2P), colls
    per_step = 2 * BATCH * DIM * 4  # each rank sends (and receives) the batch's activations or gradients
    for op in P2P:
        # every step's micro-batches (the first step's metadata exchange adds a few small calls)
        assert by_op[op]["calls"] >= 2 * microbatches * STEPS, (op, by_op)
        assert by_op[op]["bytes"] >= per_step * STEPS, (op, by_op)
    # the bubble: the time the ranks wait in send/recv. Every exposed second of the steps is one (no
    # other collective runs inside a step), so the steady-state fraction leaves out step 0 (metadata
    # exchange and the ranks' start-up skew) through the steps' exposed-comm column
    bubble = sum(v["exposed_s"] for v in by_op.values())
    exposed = rank_step_matrix(engine, run["id"], "comm_exposed_s")[2]
    np.testing.assert_allclose(float(np.nan_to_num(exposed).sum()), bubble, rtol=0.02, atol=0.005)
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    # FLOPs per stage, measured (no module hooks under pipelining): each rank its own stage's matmuls
    # over all micro-batches — forward 2·B·D² per layer, backward the weight gradient and the input
    # gradient (2·B·D² each) except stage 0's first layer, whose input (the batch) needs no gradient
    flops = rank_step_matrix(engine, run["id"], "flops")[2]
    mm = 2 * BATCH * DIM * DIM
    expected = np.array([(3 * LAYERS - 1) * mm, 3 * LAYERS * mm], dtype=float)
    # step 0 also runs the stages' shape inference: measured from step 1, every step after it counted
    assert np.isnan(flops[0]).all() and not np.isnan(flops[1:]).any(), flops
    np.testing.assert_allclose(flops[1:], np.tile(expected, (STEPS - 1, 1)), rtol=1e-6)
    fprs = summary["flops_per_rank_step"]
    assert fprs["source"] == "measured" and fprs["model"] == pytest.approx(float(np.median(expected)), rel=1e-6), fprs
    return {"fraction": bubble / float(step_s.sum()),
            "steady": float(np.nan_to_num(exposed[1:]).sum() / step_s[1:].sum()),
            "summary_pipeline": summary.get("pipeline")}


def test_pipeline_stages_and_bubble_under_the_launcher(live_server: Any, engine: Any, tmp_path: Path) -> None:
    (tmp_path / "pp.py").write_text(PP_SCRIPT)
    many = _pipeline_job(live_server, engine, tmp_path, "pp-8-microbatches", 8)
    few = _pipeline_job(live_server, engine, tmp_path, "pp-2-microbatches", 2)
    assert len(_runs(live_server.url)) == 2
    sys.stderr.write(f"bubble fraction (all steps / steps 1+): 8 micro-batches {many['fraction']:.3f} / "
                     f"{many['steady']:.3f}, 2 micro-batches {few['fraction']:.3f} / {few['steady']:.3f}\n")
    # GPipe over S = 2 stages idles (S-1)/(M+S-1) of a step: 1/9 with M = 8 micro-batches, 1/3 with 2
    # (measured on 2 busy cores: 0.14-0.19 and 0.27-0.33; per-transfer costs inflate the first)
    assert few["steady"] > 1.4 * many["steady"], (few, many)
    assert few["fraction"] > many["fraction"], (few, many)
    for r in (many, few):
        p = r["summary_pipeline"]
        if p is not None:  # the server's summary of the same events and transfers
            assert p["stages"] == 2 and p["schedule"] == "ScheduleGPipe", p
    if few["summary_pipeline"] is not None and many["summary_pipeline"] is not None:
        assert few["summary_pipeline"]["microbatches"] == 2 and many["summary_pipeline"]["microbatches"] == 8


UNIT_SCRIPT = """
import json
import sys
import torch
import torch.distributed as dist
import fleetscope.agent as fs

sys.path.insert(0, sys.argv[3])
from agent_testutil import FakeTransport

torch.set_num_threads(1)
out, port = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mode = sys.argv[4]


def build():
    from torch.distributed.pipelining import PipelineStage

    m = torch.nn.Linear(8, 8)
    return m, PipelineStage(m, 0, 1, torch.device("cpu"))


if mode == "before":  # the stage exists before init: reported by the schedule's first step
    m, stage = build()
run = fs.init(name="pp-unit", transport=lambda c, i: FakeTransport(c, i, path=out), offline=True)


def watching():
    return any(type(f).__name__ == "_PipeliningWatcher" for f in sys.meta_path)


if mode == "lazy":  # the package is imported after init: wrapped on import
    assert "torch.distributed.pipelining" not in sys.modules and watching()
    m, stage = build()
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

def wrapped():
    return [getattr(_PipelineStageBase.__init__, "_fleetscope", False), getattr(PipelineScheduleSingle.step, "_fleetscope", False)]

during = wrapped()
schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: (o - t).pow(2).mean())
opt = torch.optim.SGD(m.parameters(), lr=0.1)
run.instrument(model=m, optimizer=opt)
for _ in range(3):
    schedule.step(torch.randn(4, 8), target=torch.randn(4, 8))
    opt.step()
    opt.zero_grad()
stats = run.stats()
run.finish()
after = wrapped()
dist.destroy_process_group()
print(json.dumps({"during": during, "after": after, "watcher_left": watching(), "steps": stats["steps"],
                  "errors": stats["internal_errors"]}))
"""


def test_stage_and_schedule_events_with_init(tmp_path: Path) -> None:
    """``fleetscope.agent.init`` mode, one process: the package imported after init is wrapped on
    import; a stage built before init is reported by the schedule; one event each; unwrapped at finish."""
    import json
    import subprocess

    from conftest import free_port

    (tmp_path / "unit.py").write_text(UNIT_SCRIPT)
    agent_tests = str(Path(__file__).parents[1] / "agent")
    for mode in ("lazy", "before"):
        out = tmp_path / f"{mode}.json"
        res = subprocess.run([sys.executable, "unit.py", str(out), str(free_port()), agent_tests, mode],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got == {"during": [True, True], "after": [False, False], "watcher_left": False, "steps": 3,
                       "errors": 0}, (mode, got)
        events = [r for k, r in json.loads(out.read_text())["records"] if k == "event" and r["kind"].startswith("pp_")]
        assert [(e["kind"], e["data"]) for e in events] == [
            ("pp_stage", {"stage": 0, "num_stages": 1, "group_rank": 0, "group_size": 1}),
            ("pp_schedule", {"schedule": "ScheduleGPipe", "n_microbatches": 2, "stages": [0]}),
        ], (mode, events)
