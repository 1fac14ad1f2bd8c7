"""The run summary's ``compile`` object (server/store/compile.py → server/analysis/compile.py →
reports.run_summary), over the real server: compile events of two ranks in, figures out (maximum
over ranks, distinct graph-break reasons, top reasons, steps that recompiled); events that land
after the summary was first read show at once; malformed event data is ignored, not a 500; a run
without compile events has ``"compile": null``. Then the whole chain: a real compiled job on CPU,
the agent sending to the server, its summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dash_util import load

from fleetscope.synthetic import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def _compile(rank: int, seq: int, step: int, s: float, *, recompile: bool = False, reason: str | None = None,
             trigger: str = "dynamo", frame: str | None = "train.py:10 forward") -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "kind": "compile", "ts": 1.7e9 + seq, "step": step,
            "data": {"compile_s": s, "frame": frame, "recompile": recompile, "reason": reason, "trigger": trigger}}


def _event(rank: int, seq: int, kind: str, step: int, **data: Any) -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "kind": kind, "ts": 1.7e9 + seq, "step": step, "data": data}


SIZE = "0/0: tensor 'x' size mismatch at index 0. expected 8, actual 9"
BREAK = "Data-dependent branching (model/vla.py:88)"


def _events() -> list[dict[str, Any]]:
    ev = []
    for r in (0, 1):
        ev += [
            _compile(r, 1, 0, 2.0 + r),  # rank 1 compiles slower
            _event(r, 2, "graph_break", 0, reason=BREAK, count=1),
            _compile(r, 3, 0, 0.5, frame="train.py:40 torch_dynamo_resume_in_forward_at_40"),
            _compile(r, 4, 1, 0.25, trigger="lazy_backward", frame=None),  # time counted, not a compile
            _compile(r, 5, 7, 1.0, recompile=True, reason=SIZE),
        ]
    # rank 1 alone: a second recompile, another graph break
    ev += [_compile(1, 6, 12, 1.5, recompile=True, reason="0/1: ___check_obj_id(self.training)"),
           _event(1, 7, "graph_break", 12, reason="Call to `torch._dynamo.graph_break()` (model/vla.py:120)", count=1)]
    return ev


def test_the_summary_carries_compile_health_as_the_maximum_over_ranks(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="compiled", family="vla-7b", world_size=2, steps=16, seed=3))
    plain = load(live_server, RunSpec(name="eager", family="vla-7b", world_size=2, steps=16, seed=4))
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": _events()})
        s = c.summary(rid)
        assert c.summary(plain)["compile"] is None  # no compile events: null
    comp = s["compile"]
    assert comp == {
        "compiles": 4,  # rank 1: 2 first compiles + 2 recompiles (the lazy backward compile is not one)
        "recompiles": 2,
        "graph_breaks": 2,  # distinct reasons
        "compile_s": pytest.approx(2.0 + 1 + 0.5 + 0.25 + 1.0 + 1.5),  # rank 1's total: the larger
        "reasons": {  # most frequent first, then by name
            "recompile": [{"reason": SIZE, "count": 1}, {"reason": "0/1: ___check_obj_id(self.training)", "count": 1}],
            "graph_break": [{"reason": "Call to `torch._dynamo.graph_break()` (model/vla.py:120)", "count": 1},
                            {"reason": BREAK, "count": 1}],
        },
        "recompile_reasons": 2,
        "recompile_steps": [7, 12],
        "cudagraph_replays": 0,
        "ranks": 2,
    }

    # events landing later (the finish totals, CUDA-graph replays) show at once: the summary is not
    # served from a cache keyed on the steps
    late = [_event(r, 20, "compile_summary", 16, compiles=9 if r == 0 else 4, recompiles=2, compile_s=3.0,
                   other_compiles=1, graph_breaks=[{"reason": BREAK, "count": 5 + r}],
                   recompile_reasons=[{"reason": SIZE, "count": 3}], reasons_dropped=0, events_dropped=5)
            for r in (0, 1)]
    late.append(_event(0, 21, "cudagraph", 16, replays=1200))
    late.append(_event(1, 21, "cudagraph", 16, replays=1100))
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": late})
        comp = c.summary(rid)["compile"]
    assert comp["compiles"] == 9  # rank 0's summary counts compiles it sent no event for
    assert comp["recompiles"] == 2 and comp["compile_s"] == pytest.approx(6.25)
    assert comp["reasons"]["graph_break"][0] == {"reason": BREAK, "count": 6}  # max over ranks
    assert comp["reasons"]["recompile"][0] == {"reason": SIZE, "count": 3}
    assert comp["cudagraph_replays"] == 1200 and comp["graph_breaks"] == 2


def test_malformed_compile_events_are_ignored_not_an_error(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="odd", family="vla-7b", world_size=1, steps=4, seed=5))
    odd = [
        _event(0, 1, "compile", 0, compile_s="slow", recompile="yes", reason=7, trigger="dynamo"),
        _event(0, 2, "graph_break", 0, reason=["not", "a", "string"], count="many"),
        _event(0, 3, "compile_summary", 3, compiles="x", graph_breaks={"not": "a list"}, recompile_reasons=[1, None]),
        _event(0, 4, "cudagraph", 3, replays=None),
        _event(0, 5, "compile", 1, compile_s=0.5),  # the agent of another version: no trigger, no recompile
    ]
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "events": odd})
        comp = c.summary(rid)["compile"]
    assert comp["compiles"] == 2 and comp["recompiles"] == 0 and comp["compile_s"] == pytest.approx(0.5)
    assert comp["graph_breaks"] == 0 and comp["reasons"] == {"recompile": [], "graph_break": []}
    assert comp["recompile_steps"] == [] and comp["cudagraph_replays"] == 0


JOB = r'''
import sys, torch
torch.set_num_threads(1)
import fleetscope.agent as fs
run = fs.init("compiled-e2e", model_family="toy")
def f(x):
    y = x * 2
    if y.sum() > 0:
        return y + 1
    return y - 1
cf = torch.compile(f, backend="eager")
for n in (3, 3, 5, 5):
    with run.step(tokens=n):
        cf(torch.ones(n))
run.finish()
'''


def test_a_compiled_job_through_the_agent_lands_in_the_summary(live_server: Any, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_SERVER=live_server.url, FLEETSCOPE_TOKEN=live_server.token, OMP_NUM_THREADS="1",
               FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    p = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr[-2000:]
    live_server.compact()
    with live_server.client() as c:
        rid = next(r["id"] for r in c.run_list(name="compiled-e2e"))
        comp = c.summary(rid)["compile"]
    assert comp["compiles"] == 4 and comp["recompiles"] == 2 and comp["recompile_steps"] == [2]
    assert comp["graph_breaks"] == 1 and comp["ranks"] == 1 and comp["compile_s"] > 0
    (gb,) = comp["reasons"]["graph_break"]
    assert gb["reason"].startswith("Data-dependent branching (") and gb["count"] >= 2
    assert all("size mismatch" in r["reason"] for r in comp["reasons"]["recompile"])


ZERO_CODE_JOB = r'''
import torch
torch.set_num_threads(1)
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
                      backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    n = 4 if step < 3 else 6  # a new batch size at step 3: a recompile
    model(torch.randn(n, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("done")
'''


def test_zero_code_launcher_reports_compile_health(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ZERO_CODE_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_TOKEN=live_server.token, OMP_NUM_THREADS="1", FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    p = subprocess.run([sys.executable, "-m", "fleetscope.cli", "run", "--name", "zero-code-compiled", "--server",
                        live_server.url, "--", sys.executable, "train.py"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "done\n" and p.stderr == "", p.stderr[-2000:]
    live_server.compact()
    with live_server.client() as c:
        rid = next(r["id"] for r in c.run_list(name="zero-code-compiled"))
        summary = c.summary(rid)
        comp = summary["compile"]
    assert comp is not None and comp["compiles"] == 2 and comp["recompiles"] == 1 and comp["recompile_steps"] == [3]
    # its FLOPs: measured once (step 1, batch 4) on the eager module and fake tensors, without a compile
    # more — forward 2·4·(8·16 + 16·1), backward the second layer's input and weight, the first's weight
    want = 2 * 4 * (8 * 16 + 16) + 2 * (2 * 4 * 16) + 2 * 4 * 8 * 16
    assert summary["flops_per_rank_step"] == {"model": want, "hardware": want, "source": "measured_uncompiled"}
    assert comp["graph_breaks"] == 0 and comp["compile_s"] > 0
    (r,) = comp["reasons"]["recompile"]
    assert "size mismatch at index 0. expected 4, actual 6" in r["reason"]
