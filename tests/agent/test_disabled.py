"""FLEETSCOPE_DISABLED turns the agent into a no-op; importing the agent never imports torch, the
server or the dashboard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402


def _run_python(code: str, env_extra: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "fleetscope.server", "fleetscope.dashboard", "numpy", "fastapi", "sqlalchemy", "dash")


def test_importing_the_agent_imports_nothing_heavy(tmp_path) -> None:
    got = _run_python(
        f"""
        import json, sys
        import fleetscope.agent as fs
        from fleetscope.agent import clock, collectives, env, memory, mfu, run, torch_hooks
        after_import = sorted(m for m in {HEAVY!r} if m in sys.modules)
        r = fs.init("hygiene", model_family="f", config={{"a": 1}})
        for i in range(3):
            with r.step(tokens=10):
                with r.phase("forward"):
                    pass
        r.finish(timeout=2)
        print(json.dumps({{"after_import": after_import,
                           "after_run": sorted(m for m in {HEAVY!r} if m in sys.modules),
                           "steps": r.stats()["steps"]}}))
        """,
        {"FLEETSCOPE_OFFLINE": "1", "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")},
    )
    assert got == {"after_import": [], "after_run": [], "steps": 3}


def test_disabled_by_env_is_a_noop_that_touches_nothing() -> None:
    got = _run_python(
        """
        import json, sys
        import torch, torch.distributed as dist
        originals = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "barrier")}
        wait = dist.Work.wait
        import fleetscope.agent as fs
        made = []
        r = fs.init("off", transport=lambda c, i: made.append(1))
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = [torch.zeros(1, 2)]
        same_loader = r.instrument(model=model, optimizer=opt, dataloader=loader) is loader
        with r.step(tokens=3) as s:
            with s.phase("forward"):
                model(loader[0]).sum().backward()
            s.count(tokens=1)
        r.event("checkpoint")
        r.finish()
        print(json.dumps({
            "noop": type(r).__name__,
            "transport_made": len(made),
            "same_loader": same_loader,
            "hooks": len(model._forward_hooks) + len(model._forward_pre_hooks),
            "optimizer_hooks": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
            "dist_untouched": all(getattr(dist, n) is f for n, f in originals.items()) and dist.Work.wait is wait,
            "shared_cm": r.step() is r.step() is r.phase("x"),
        }))
        """,
        {"FLEETSCOPE_DISABLED": "1"},
    )
    assert got == {
        "noop": "NoopRun",
        "transport_made": 0,
        "same_loader": True,
        "hooks": 0,
        "optimizer_hooks": 0,
        "dist_untouched": True,
        "shared_cm": True,
    }


def test_disabled_by_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETSCOPE_DISABLED", raising=False)
    before = len(FakeTransport.instances)
    run = fs.init("off", transport=FakeTransport, disabled=True)
    assert isinstance(run, fs.NoopRun)
    assert len(FakeTransport.instances) == before
    with run.step(tokens=1) as s, s.phase("forward"):
        pass
    assert run.flush() is True and run.stats() == {"disabled": True}
    assert fs.get_run() is None


def test_env_disable_wins_over_a_missing_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSCOPE_DISABLED", "1")
    assert isinstance(fs.init("off", transport=FakeTransport), fs.NoopRun)
    monkeypatch.setenv("FLEETSCOPE_DISABLED", "0")
    run = fs.init("on", transport=FakeTransport, collectives=False)
    assert isinstance(run, fs.Run)
    run.finish()
