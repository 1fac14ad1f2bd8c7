"""torch.compile health (agent/compile_watch.py): a real compiled job on CPU — a shape change that
recompiles, a data-dependent branch that breaks the graph, a lazily compiled backward and a
``torch._dynamo.reset()`` — reports its compiles, recompile reasons, graph breaks and compile time as
run events, prints nothing the job would not print without the agent, and leaves torch as it found
it at finish. Then the watcher's parts on their own: never raising into the job, bounds, events made
on another thread, the fallback graph-break source, CUDA-graph replay counting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
from fleetscope.agent import compile_watch as cw

HERE = Path(__file__).resolve().parent

JOB = r'''
import functools, json, sys
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
import fleetscope.agent as fs
from agent_testutil import FakeTransport

checks = {}
run = fs.init("compile-job", transport=functools.partial(FakeTransport, path=sys.argv[1] + ".records"))
checks["dynamo_imported_at_init"] = "torch._dynamo" in sys.modules
from fleetscope.agent import compile_watch
checks["waiting_for_dynamo"] = any(type(f).__name__ == "_DynamoFinder" for f in sys.meta_path)

def f(x):
    y = x * 2
    if y.sum() > 0:          # data-dependent branch: a graph break
        return y + 1
    return y - 1

cf = torch.compile(f, backend="eager")
lin = torch.nn.Linear(4, 2)
clin = torch.compile(lin, backend="aot_eager")
for i, n in enumerate([3, 3, 3, 5, 5]):  # the shape changes at step 3: a recompile
    with run.step():
        out = cf(torch.ones(n))
        if i == 1:
            clin(torch.ones(2, 4)).sum().backward()  # its backward is compiled lazily
    print(i, float(out.sum()))
checks["watching"] = compile_watch.watching() is not None
import torch._dynamo
from torch._dynamo.symbolic_convert import InstructionTranslatorBase
checks["patched_during_run"] = hasattr(InstructionTranslatorBase.log_graph_break, "__wrapped__")
torch._dynamo.reset()  # clears every compile callback: the watcher registers its own again
with run.step():
    out = cf(torch.ones(3))
print("after reset", float(out.sum()))
run.finish()
h = torch._dynamo.callback_handler
checks["callbacks_left"] = len(h.start_callbacks) + len(h.end_callbacks)
checks["log_graph_break_restored"] = not hasattr(InstructionTranslatorBase.log_graph_break, "__wrapped__")
checks["reset_restored"] = not hasattr(torch._dynamo.reset, "__wrapped__")
checks["finder_left"] = any(type(f).__name__ == "_DynamoFinder" for f in sys.meta_path)
json.dump(checks, open(sys.argv[1] + ".checks", "w"))
'''


IF_LINE = JOB.splitlines().index("    if y.sum() > 0:          # data-dependent branch: a graph break") + 1


def _run_job(tmp_path: Path, *, disabled: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / ("off" if disabled else "on")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETSCOPE_", "TORCH_LOGS", "TORCHDYNAMO"))}
    env.update(OMP_NUM_THREADS="1", FLEETSCOPE_OFFLINE="1", FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    if disabled:
        env["FLEETSCOPE_DISABLED"] = "1"
    p = subprocess.run([sys.executable, str(script), str(out), str(HERE)], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, out


def test_a_compiled_job_reports_compiles_recompiles_and_graph_breaks_and_prints_nothing_extra(tmp_path: Path) -> None:
    on, path = _run_job(tmp_path, disabled=False)
    off, _ = _run_job(tmp_path, disabled=True)
    # the job's own output only: the same with the agent as without, nothing on stderr
    assert on.stdout == off.stdout
    assert on.stdout.splitlines()[0] == "0 9.0" and on.stdout.splitlines()[-1] == "after reset 9.0"
    assert on.stderr == off.stderr == ""

    checks = json.loads(Path(str(path) + ".checks").read_text())
    assert checks == {
        "dynamo_imported_at_init": False, "waiting_for_dynamo": True,  # no eager 1 s import of torch._dynamo
        "watching": True, "patched_during_run": True,
        "callbacks_left": 0, "log_graph_break_restored": True, "reset_restored": True, "finder_left": False,
    }  # fmt: skip
    doc = json.loads(Path(str(path) + ".records").read_text())
    events = [r for k, r in doc["records"] if k == "event"]
    compiles = [e for e in events if e["kind"] == "compile"]
    dyn = [e for e in compiles if e["data"]["trigger"] == "dynamo"]
    for e in compiles:
        assert e["rank"] == 0 and e["data"]["compile_s"] > 0
    # step 0: f and the resume function after its graph break; the Linear's forward at step 1 and its
    # backward (lazily compiled); step 3: f and its resume function again, for the new shape; after the
    # reset (step 5) everything is compiled anew, counted as first compiles
    resume = f"torch_dynamo_resume_in_f_at_{IF_LINE}"
    by_step = [(e["step"], e["data"]["frame"].split(" ")[-1], e["data"]["recompile"]) for e in dyn]
    assert by_step == [(0, "f", False), (0, resume, False), (1, "Linear.forward", False), (3, "f", True),
                       (3, resume, True), (5, "f", False), (5, resume, False)]
    assert dyn[0]["data"]["frame"] == _short(tmp_path) + f"job.py:{IF_LINE - 2} f"
    assert dyn[2]["data"]["frame"].startswith("modules/linear.py:")  # the module's forward, not Dynamo's wrapper
    assert [e["data"]["reason"] for e in dyn if not e["data"]["recompile"]] == [None] * 5
    for e in dyn[3:5]:  # the guard that failed, as TORCH_LOGS=recompiles would have printed it
        assert "size mismatch at index 0. expected 3, actual 5" in e["data"]["reason"]
    lazy = [e for e in compiles if e["data"]["trigger"] == "lazy_backward"]
    assert len(lazy) == 1 and lazy[0]["step"] == 1 and lazy[0]["data"]["frame"] is None
    # the graph break: once, when first met, with its type and the user's line
    gbs = [e for e in events if e["kind"] == "graph_break"]
    assert len(gbs) == 1 and gbs[0]["step"] == 0
    assert gbs[0]["data"] == {"reason": "Data-dependent branching (" + _short(tmp_path) + f"job.py:{IF_LINE})", "count": 1}
    # the totals at finish
    summary = [e for e in events if e["kind"] == "compile_summary"]
    assert len(summary) == 1
    s = summary[0]["data"]
    assert s["compiles"] == len(dyn) and s["recompiles"] == 2 and s["other_compiles"] == 1
    assert s["compile_s"] == pytest.approx(sum(e["data"]["compile_s"] for e in compiles), abs=1e-4)
    assert [g["reason"] for g in s["graph_breaks"]] == [gbs[0]["data"]["reason"]]
    assert s["graph_breaks"][0]["count"] >= 3  # met at step 0, step 3 and after the reset
    assert sorted(r["reason"][:5] for r in s["recompile_reasons"]) == ["0/0: ", "1/0: "]
    assert s["reasons_dropped"] == 0 and s["events_dropped"] == 0
    assert not [e for e in events if e["kind"] == "cudagraph"]  # CPU: no CUDA graphs


def _short(tmp_path: Path) -> str:
    return tmp_path.name + "/"


def test_without_torch_compile_nothing_is_imported_and_finish_removes_the_wait(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "import fleetscope.agent as fs\n"
        "from fleetscope.agent import compile_watch\n"
        "run = fs.init('no-compile')\n"
        "waiting = [f for f in sys.meta_path if type(f).__name__ == '_DynamoFinder']\n"
        "assert len(waiting) == 1, sys.meta_path\n"
        "with run.step():\n"
        "    torch.ones(3).sum()\n"
        "run.finish()\n"
        "assert not [f for f in sys.meta_path if type(f).__name__ == '_DynamoFinder']\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "assert compile_watch.watching() is None\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_OFFLINE="1", FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr


def test_the_module_imports_and_installs_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from fleetscope.agent import compile_watch\n"
        "class R:\n"
        "    _hooks = []\n"
        "compile_watch.install(R())\n"
        "R._hooks[0].remove()\n"
        "assert not [f for f in sys.meta_path if type(f).__name__ == '_DynamoFinder']\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr


# ---------------------------------------------------------------------- the watcher's parts alone
class FakeRun:
    """What the watcher uses of a run: ``event``, ``_error``, ``step_index``, ``_tid``, ``_hooks``."""

    def __init__(self, raise_on_event: bool = False) -> None:
        self.events: list[tuple[str, int | None, dict[str, Any]]] = []
        self.errors: list[tuple[str, str]] = []
        self.step_index = 7
        self._tid = threading.get_ident()
        self._hooks: list[Any] = []
        self.raise_on_event = raise_on_event

    def event(self, kind: str, step: int | None = None, **data: Any) -> None:
        if self.raise_on_event:
            raise RuntimeError("transport exploded")
        self.events.append((kind, step, data))

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors.append((where, repr(exc)))

    def of(self, kind: str) -> list[tuple[str, int | None, dict[str, Any]]]:
        return [e for e in self.events if e[0] == kind]


def _watch(run: FakeRun, **kw: Any) -> cw.CompileWatch:
    w = cw.CompileWatch(run, **kw)
    w._live = True  # attached without torch._dynamo: the callbacks are driven by hand
    return w


def _compile(w: cw.CompileWatch, trigger: str | None = "DYNAMO") -> None:
    args = types.SimpleNamespace(callback_trigger=types.SimpleNamespace(name=trigger), compile_id="0/0") if trigger else None
    w._on_start(args)
    w._on_end(args)


def test_no_hook_raises_into_the_job_errors_go_to_the_run() -> None:
    run = FakeRun(raise_on_event=True)
    w = _watch(run)
    w._metrics_context = lambda: 1 / 0  # type: ignore[assignment, return-value]  # torch internals changed
    _compile(w)
    w._on_end(object(), 1, 2)  # an end without a start, odd arguments
    w._on_start(42)
    w._on_end(42)
    # log_graph_break called with arguments of another torch version
    wrapper_args: list[tuple[Any, ...]] = [(), (None,), (None, 12, object()), (None, None, None)]
    for a in wrapper_args:
        try:
            w._graph_break_logged(a, {})
        except Exception:  # noqa: BLE001
            pytest.fail("graph break hook raised:\n" + traceback.format_exc())
    w._graph_break("Some break", "x.py:1")
    w._metrics_context = None
    _compile(w)  # sending the event raises
    w.detach()  # the final events raise too
    assert run.errors and all(where.startswith("compile_watch.") for where, _ in run.errors)
    assert {where for where, _ in run.errors} >= {"compile_watch.compile_start", "compile_watch.compile_end"}


def test_reasons_and_compile_events_are_bounded_and_the_overflow_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cw, "MAX_COMPILE_EVENTS", 5)
    run = FakeRun()
    w = _watch(run)
    reasons = iter(f"0/0: tensor 'x' size mismatch at index 0. expected {i}, actual {i + 1}" for i in range(300))
    w._metrics_context = lambda: types.SimpleNamespace(_metrics={"recompile_reason": next(reasons)})  # type: ignore[assignment]
    for i in range(300):
        w._graph_break(f"break kind {i}", f"model.py:{i}")
        _compile(w)
    w.detach()
    assert len(run.of("graph_break")) == cw.MAX_REASONS  # each distinct reason once, up to the bound
    assert len(run.of("compile")) == 5
    s = run.of("compile_summary")[0][2]
    assert s["compiles"] == 300 and s["recompiles"] == 300 and s["events_dropped"] == 295
    assert len(s["graph_breaks"]) == cw.MAX_REASONS and len(s["recompile_reasons"]) == cw.MAX_REASONS
    assert s["reasons_dropped"] == 200  # 100 graph-break and 100 recompile reasons past the bound
    assert all(len(r["reason"]) <= cw.MAX_REASON_CHARS for r in s["recompile_reasons"])


def test_a_repeated_graph_break_is_sent_once_and_counted() -> None:
    run = FakeRun()
    w = _watch(run)
    for _ in range(3):
        w._graph_break_logged((None, "ignored text", types.SimpleNamespace(
            logged=False, gb_type="Data-dependent branching",
            real_stack=[traceback.FrameSummary("/a/b/model.py", 12, "forward")])), {})
        # Dynamo logs each graph break once: an exception already logged is not counted again
        w._graph_break_logged((), {"reason": "x", "exc": types.SimpleNamespace(logged=True, gb_type="Data-dependent branching")})
        _compile(w)
    w.detach()
    assert [e[2] for e in run.of("graph_break")] == [{"reason": "Data-dependent branching (b/model.py:12)", "count": 1}]
    assert run.of("compile_summary")[0][2]["graph_breaks"] == [
        {"reason": "Data-dependent branching (b/model.py:12)", "count": 3}]


def test_the_fallback_graph_break_source_reads_dynamos_list() -> None:
    run = FakeRun()
    w = _watch(run, graph_breaks_from="list")
    reasons: list[Any] = []
    w._gb_list = reasons
    reasons.append(types.SimpleNamespace(reason="generic_jump TensorVariable()\nmore",
                                         user_stack=[traceback.FrameSummary("/x/train.py", 40, "step")]))
    _compile(w)
    reasons.clear()  # torch._dynamo.reset() clears it
    reasons.append(types.SimpleNamespace(reason="Call to `torch._dynamo.graph_break()`", user_stack=[]))
    _compile(w)
    w.detach()
    assert [e[2]["reason"] for e in run.of("graph_break")] == [
        "generic_jump TensorVariable() (x/train.py:40)", "Call to `torch._dynamo.graph_break()`"]


def test_events_made_on_another_thread_wait_for_the_training_thread() -> None:
    run = FakeRun()
    w = _watch(run)
    t = threading.Thread(target=_compile, args=(w,))
    t.start()
    t.join()
    assert run.events == []  # not sent from the compiling thread
    _compile(w)  # the training thread's next event sends it first
    assert [e[0] for e in run.events] == ["compile", "compile"]
    t = threading.Thread(target=_compile, args=(w, "LAZY_BACKWARD"))
    t.start()
    t.join()
    w.detach()  # or finish does
    assert [(e[0], e[2].get("trigger")) for e in run.events] == [
        ("compile", "dynamo"), ("compile", "dynamo"), ("compile", "lazy_backward"), ("compile_summary", None)]
    assert all(e[1] == 7 for e in run.events)  # the run's step


def test_an_older_callback_without_arguments_counts_as_a_dynamo_compile() -> None:
    run = FakeRun()
    w = _watch(run)
    _compile(w, trigger=None)
    w.detach()
    assert run.of("compile")[0][2]["trigger"] == "dynamo"
    assert run.of("compile_summary")[0][2]["compiles"] == 1


def test_cuda_graph_replays_are_counted_on_a_gpu_and_the_method_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    class CUDAGraphTreeManager:
        def execute_node(self, node: Any, new_inputs: Any) -> Any:
            return ("ran", node)

    original = CUDAGraphTreeManager.__dict__["execute_node"]
    fake = types.ModuleType(cw._CUDAGRAPH_TREES)
    fake.CUDAGraphTreeManager = CUDAGraphTreeManager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, cw._CUDAGRAPH_TREES, fake)
    run = FakeRun()
    cpu = _watch(run, cuda=False)
    cpu._maybe_hook_cudagraphs()
    assert CUDAGraphTreeManager.__dict__["execute_node"] is original  # no GPU: nothing wrapped
    w = _watch(run, cuda=True)
    _compile(w)  # the end of a compile looks for cudagraph trees
    mgr = CUDAGraphTreeManager()
    assert [mgr.execute_node(i, []) for i in range(3)] == [("ran", 0), ("ran", 1), ("ran", 2)]
    w.detach()
    assert CUDAGraphTreeManager.__dict__["execute_node"] is original
    assert run.of("cudagraph") == [("cudagraph", 7, {"replays": 3})]


AUTO_JOB = r'''
import functools, json, sys
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
import fleetscope.agent as fs
from agent_testutil import FakeTransport
run = fs.init("auto-compiled", transport=functools.partial(FakeTransport, path=sys.argv[1]), measure_flops=False)
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
                      backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run.instrument(model=model, optimizer=opt)
for step in range(5):
    model(torch.randn(4 if step < 3 else 6, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
run.finish()
'''


def test_automatic_mode_attributes_compiles_to_the_steps_the_optimizer_ends(tmp_path: Path) -> None:
    # measure_flops=False: FLOP counting of the first step stops Dynamo from compiling (see the xfail in
    # tests/server/test_compile_health.py)
    script = tmp_path / "auto_job.py"
    script.write_text(AUTO_JOB)
    out = tmp_path / "auto.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    p = subprocess.run([sys.executable, str(script), str(out), str(HERE)], capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr[-3000:]
    doc = json.loads(out.read_text())
    events = [(r["kind"], r["step"], r["data"].get("trigger"), r["data"].get("recompile"))
              for k, r in doc["records"] if k == "event" and r["kind"] != "memory"]  # memory: its own cadence
    assert events == [("compile", 0, "dynamo", False), ("compile", 0, "lazy_backward", False),
                      ("compile", 3, "dynamo", True), ("compile_summary", 5, None, None)]
