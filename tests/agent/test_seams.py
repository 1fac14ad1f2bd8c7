"""The agent's seams: the protocols its parts and the tests' fakes satisfy, no import circles, an
``__all__`` in every module, and the server's structured 422 location the agent relies on."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport, ScriptedClock  # noqa: E402
from fleetscope.agent import memory, protocols  # noqa: E402
from fleetscope.agent.clock import CpuClock  # noqa: E402
from fleetscope.agent.config import AgentConfig  # noqa: E402
from fleetscope.agent.transport import Transport as SenderTransport  # noqa: E402

AGENT_DIR = Path(fs.__file__).parent
ROOT = AGENT_DIR.parent


def test_transports_clocks_and_samplers_satisfy_the_protocols(tmp_path: Path) -> None:
    cfg = AgentConfig(offline=True, spool_dir=str(tmp_path))
    real = SenderTransport(cfg, {"name": "seams"})
    try:
        for tx in (real, FakeTransport(cfg, {}), fs._NullTransport(cfg, {})):
            assert isinstance(tx, protocols.Transport), type(tx)
    finally:
        real.close()
    assert isinstance(CpuClock(), protocols.Clock) and isinstance(ScriptedClock(), protocols.Clock)
    for sampler in (memory.NullSampler(), memory.RssSampler()):
        assert isinstance(sampler, protocols.MemorySampler)
    assert fs.Transport is protocols.Transport


@pytest.mark.skipif(shutil.which("mypy", path=os.path.dirname(sys.executable)) is None, reason="needs mypy")
def test_the_test_fakes_satisfy_the_protocols_statically(tmp_path: Path) -> None:
    """What ``Run`` is handed is checked by mypy against the protocols, fakes included (and a wrong
    assignment is caught: the check is real)."""
    head = (
        "from agent_testutil import FakeTransport, ScriptedClock\n"
        "from agent.config import AgentConfig\n"
        "from agent.protocols import Clock, Transport, TransportFactory\n"
        "from agent.transport import Transport as SenderTransport\n"
    )
    (tmp_path / "good.py").write_text(
        head + "t: Transport = FakeTransport(AgentConfig(), {})\n"
        "f: TransportFactory = FakeTransport\n"
        "g: TransportFactory = SenderTransport\n"
        "c: Clock = ScriptedClock()\n"
    )
    (tmp_path / "bad.py").write_text(head + "c: Clock = FakeTransport(AgentConfig(), {})\n")
    mypy = os.path.join(os.path.dirname(sys.executable), "mypy")
    env = {**os.environ, "MYPYPATH": os.path.dirname(__file__)}  # agent_testutil; `agent` from ROOT
    # incremental, in the project's cache (ROOT/.mypy_cache, as tests/test_lint.py's run): torch and the
    # agent are analysed once between the two, not again here (a cache miss re-checks what changed)
    out = subprocess.run(
        [mypy, "--follow-imports=silent", "--ignore-missing-imports",
         str(tmp_path / "good.py"), str(tmp_path / "bad.py")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=240,
    )  # fmt: skip
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "bad.py:5:" in errors[0] and "Incompatible types" in errors[0], out.stdout


def _imports(path: Path) -> set[str]:
    """Agent modules ``path`` imports, anywhere in it (lazy imports inside functions included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif node.module and node.module.startswith("fleetscope.agent."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[2] for a in node.names if a.name.startswith("fleetscope.agent."))
    return out


def test_no_import_circles_in_the_agent() -> None:
    modules = {p.stem: p for p in AGENT_DIR.glob("*.py")}
    graph = {m: {d for d in _imports(p) if d in modules and d != m} for m, p in modules.items()}
    graph["__init__"] = set()  # the package imports its modules; they do not import it
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_agent_module_declares_all() -> None:
    for path in sorted(AGENT_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [
            n for n in tree.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in getattr(n, "targets", [getattr(n, "target", None)]))
        ]  # fmt: skip
        assert names, f"{path.name} has no __all__"
        module: Any = __import__(f"fleetscope.agent.{path.stem}" if path.stem != "__init__" else "fleetscope.agent",
                                 fromlist=["*"])  # fmt: skip
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{path.name}: __all__ names {missing}"


BAD_BATCHES = [
    # (mutation of a good columnar batch, the expected detail.loc)
    (lambda b: b["rank_steps"]["step_s"].__setitem__(1, -1.0), {"section": "rank_steps", "index": 1, "field": "step_s"}),
    (lambda b: b["collectives"]["op"].__setitem__(0, "allreduce_typo"), {"section": "collectives", "index": 0, "field": "op"}),
    (lambda b: b["rank_steps"]["step"].pop(), {"section": "rank_steps", "index": None, "field": "step"}),
    (lambda b: b.__setitem__("events", [{"rank": 0, "seq": 1, "kind": "x", "ts": 1.0, "data": {"a": float("nan")}}]),
     {"section": "events", "index": 0, "field": "data"}),
    (lambda b: b.__setitem__("ranks", [{"rank": 0}, {"rank": 0, "host": 5}]), {"section": "ranks", "index": 1, "field": "host"}),
    (lambda b: b.__setitem__("run_id", "one"), {"section": None, "index": None, "field": "run_id"}),
]  # fmt: skip


@pytest.mark.parametrize("mutate,loc", BAD_BATCHES, ids=[str(loc) for _, loc in BAD_BATCHES])
def test_the_servers_422_detail_carries_a_structured_location(mutate: Any, loc: dict[str, Any]) -> None:
    from fleetscope.agent.batching import build_batch, without_record
    from fleetscope.server.validate import BatchError, validate_batch

    items: list[tuple[str, Any]] = []
    for i in range(3):
        items.append(("rank_step", (0, i, 0.1, 1.7e9) + (None,) * 17))
        items.append(("collective", (0, i, 0, "all_reduce", 2, 4096, 1, 0.001, 0.0005, 1.7e9)))
    batch, _, _ = build_batch(items)
    batch["run_id"] = 1
    mutate(batch)
    with pytest.raises(BatchError) as e:
        validate_batch(batch, lambda run_id: 2)
    detail = e.value.detail()
    assert detail["loc"] == loc
    assert detail["where"] in detail["error"]  # the message and its keys are unchanged
    rest = without_record(batch, loc["section"], loc["index"])  # what the agent resends
    if loc["index"] is None:
        assert rest is None
    else:
        assert rest is not None
        validate_batch(rest, lambda run_id: 2)  # the one bad record gone, the batch is good
