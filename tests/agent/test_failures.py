"""Failure records (agent/failures.py): an uncaught exception, sys.exit with a code, SIGTERM — real
processes against a loopback receiver; the job's own hooks and exit status stay as they were."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

try:
    from ._receiver import Receiver
except ImportError:  # tests/agent is not a package
    from _receiver import Receiver

pytestmark = pytest.mark.timeout(120)

HEAD = """
import os, sys, time, signal, threading
import fleetscope.agent as fs
run = fs.init("{name}")
def helper_in_user_code(x):
    if x > 2:
        raise ValueError("loss is nan at step %d (token=abc)" % x)
for i in range(6):
    with run.step(tokens=4):
        with run.phase("forward"):
            time.sleep(0.002)
            {body}
"""


def _job(tmp_path: Path, r: Receiver, name: str, body: str, tail: str = "", **env: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(HEAD).format(name=name, body=body) + textwrap.dedent(tail)
    (tmp_path / f"{name}.py").write_text(script)
    full = {**os.environ, "FLEETSCOPE_SERVER": r.url, "FLEETSCOPE_TOKEN": r.token,
            "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, f"{name}.py"], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=90)


def _failures(r: Receiver) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "failure"]


def _finish_status(r: Receiver, timeout: float = 10) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not r.finishes:
        time.sleep(0.05)
    return r.finishes[-1][1] if r.finishes else None


AUTO = """
import time, torch
import fleetscope.agent as fs
torch.set_num_threads(1)
run = fs.init("raises")

def helper_in_user_code(x):
    if x > 2:
        raise ValueError("loss is nan at step %d (token=abc)" % x)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.calls = 0
    def forward(self, x):
        helper_in_user_code(self.calls)
        self.calls += 1
        return self.lin(x)

m = Model()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
run.instrument(model=m, optimizer=opt)
for i in range(6):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_uncaught_exception_is_recorded_and_still_printed(tmp_path: Path) -> None:
    (tmp_path / "raises.py").write_text(AUTO)
    with Receiver() as r:
        full = {**os.environ, "FLEETSCOPE_SERVER": r.url, "FLEETSCOPE_TOKEN": r.token,
                "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "raises.py"], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=90)
        assert res.returncode == 1
        assert "ValueError: loss is nan at step 3" in res.stderr  # the original excepthook ran
        assert _finish_status(r) == "failed"
        f = _failures(r)
    assert len(f) == 1, f
    ev = f[0]
    d = ev["data"]
    assert ev["step"] == 3 and ev["rank"] == 0
    assert d["source"] == "exception" and d["exception"] == "ValueError"
    assert d["message"] == "loss is nan at step 3 (token=abc)"
    assert d["phase"] == "forward" and d["rank"] == 0 and d["signal"] is None and d["exit_code"] is None
    assert d["frames"][-1] == {"file": "raises.py", "line": 9, "func": "helper_in_user_code"}
    assert d["frames"][-2]["func"] == "forward" and d["frames"][0]["func"] == "<module>"
    assert len(d["frames"]) <= 12
    assert any(f["file"].startswith("torch/") for f in d["frames"])  # torch's module call in between


def test_exception_in_a_manual_step_names_the_step(tmp_path: Path) -> None:
    with Receiver() as r:
        res = _job(tmp_path, r, "manual", "helper_in_user_code(i)")
        assert res.returncode == 1
        assert _finish_status(r) == "failed"
        f = _failures(r)
    assert len(f) == 1 and f[0]["step"] == 3
    assert f[0]["data"]["frames"][-1]["func"] == "helper_in_user_code"


def test_long_message_is_cut(tmp_path: Path) -> None:
    with Receiver() as r:
        res = _job(tmp_path, r, "longmsg", "raise RuntimeError('x' * 5000)")
        assert res.returncode == 1
        assert _finish_status(r) == "failed"
        d = _failures(r)[0]["data"]
    assert d["exception"] == "RuntimeError" and d["message"] == "x" * 1000


def test_sys_exit_with_a_code(tmp_path: Path) -> None:
    with Receiver() as r:
        res = _job(tmp_path, r, "exits", "sys.exit(3) if i == 2 else None")
        assert res.returncode == 3
        assert _finish_status(r) == "failed"
        f = _failures(r)
    assert len(f) == 1
    d = f[0]["data"]
    assert d["source"] == "exit" and d["exit_code"] == 3 and f[0]["step"] == 2
    assert d["frames"][-1]["file"] == "exits.py"
    with Receiver() as r2:
        res = _job(tmp_path, r2, "exits0", "sys.exit(0) if i == 2 else None")
        assert res.returncode == 0
        assert _finish_status(r2) == "finished"
        assert not _failures(r2)


def test_sigterm_is_recorded_and_the_process_still_dies_of_it(tmp_path: Path) -> None:
    with Receiver() as r:
        res = _job(tmp_path, r, "termed", "os.kill(os.getpid(), signal.SIGTERM) if i == 4 else None")
        assert res.returncode == -signal.SIGTERM
        assert _finish_status(r) == "failed"
        f = _failures(r)
    assert len(f) == 1
    d = f[0]["data"]
    assert d["source"] == "signal" and d["signal"] == "SIGTERM" and f[0]["step"] == 4 and d["phase"] == "forward"


def test_jobs_own_sigterm_handler_and_helper_thread_errors_are_left_alone(tmp_path: Path) -> None:
    tail = """
    """
    body = "pass"
    script_env: dict[str, str] = {}
    own = """
import signal as _s
_s.signal(_s.SIGTERM, lambda *a: (sys.stdout.write("own handler\\n"), sys.stdout.flush()))
"""
    # the job installs its handler before init: the agent must not replace it
    head = textwrap.dedent(HEAD).replace("import fleetscope.agent as fs", own + "import fleetscope.agent as fs")
    (tmp_path / "own.py").write_text(head.format(name="own", body=body) + textwrap.dedent("""
        def worker():
            raise KeyError("helper thread")
        t = threading.Thread(target=worker); t.start(); t.join()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        run.finish()
    """) + tail)
    with Receiver() as r:
        full = {**os.environ, "FLEETSCOPE_SERVER": r.url, "FLEETSCOPE_TOKEN": r.token,
                "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool"), **script_env}
        res = subprocess.run([sys.executable, "own.py"], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stderr
        assert "own handler" in res.stdout
        assert "KeyError: 'helper thread'" in res.stderr  # threading's own hook still printed it
        assert _finish_status(r) == "finished"
        assert not _failures(r)


def test_manual_phase_the_exception_left_names_the_failure() -> None:
    """Manual mode: ``with run.phase("optimizer")`` has closed by the time the step aborts; the phase
    the exception left (the innermost) is still the one the failure names."""
    import fleetscope.agent as fs
    from agent_testutil import FakeTransport

    run = fs.init("manual-phase-failure", transport=FakeTransport, collectives=False)
    try:
        with run.step():
            with run.phase("forward"):
                pass
        try:
            with run.step():
                with run.phase("backward"):
                    with run.phase("optimizer"):
                        raise ValueError("boom")
        except ValueError:
            pass
        assert run._aborted_at == (1, "optimizer")
        try:  # the next step's exception outside any phase names none
            with run.step():
                raise KeyError("x")
        except KeyError:
            pass
        assert run._aborted_at == (1, None)  # an aborted step does not advance the index
    finally:
        run.finish()


ELASTIC_LAUNCHER = """
import sys
import torch  # before the agent starts workers: this process gets the zero-code hooks, for now
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from fleetscope.agent import auto, failures

before = (failures.is_launcher(), len(auto._module_hooks) > 0)
cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="custom-launch", rdzv_backend="c10d",
                   rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
try:
    elastic_launch(cfg, sys.executable)("worker.py")
except ChildFailedError:
    pass
after = (failures.is_launcher(), len(auto._module_hooks), len(auto._opt_hooks))
print("before", before, "after", after, flush=True)
"""

ELASTIC_WORKER = """
import os, sys, time
if os.environ["LOCAL_RANK"] == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(30)  # torn down by the agent once rank 1 has exited
"""


def test_any_process_that_runs_the_elastic_agent_is_the_launcher(tmp_path: Path) -> None:
    """Keyed on torch's elastic agent starting workers, not on the command's name (``accelerate launch``
    runs torchrun's ``run`` in its own process): a plain ``python launch.py`` calling ``elastic_launch``
    under ``fleetscope run`` reports its failed worker, and loses the hooks that wait for training."""
    (tmp_path / "launch.py").write_text(ELASTIC_LAUNCHER)
    (tmp_path / "worker.py").write_text(ELASTIC_WORKER)
    with Receiver() as r:
        full = {k: v for k, v in os.environ.items() if k not in ("FLEETSCOPE_JOB_ID", "FLEETSCOPE_LAUNCH_ID",
                                                                 "FLEETSCOPE_RUN_NAME", "TORCHELASTIC_RUN_ID")}
        full.update({"FLEETSCOPE_SERVER": r.url, "FLEETSCOPE_TOKEN": r.token, "OMP_NUM_THREADS": "1",
                     "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")})
        res = subprocess.run([sys.executable, "-m", "fleetscope.cli", "run", "--name", "elastic", "--",
                              sys.executable, "launch.py"], cwd=tmp_path, env=full, capture_output=True, text=True,
                             timeout=90)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert "before (False, True) after (True, 0, 0)" in res.stdout, res.stdout + res.stderr[-4000:]
        assert _finish_status(r) == "failed"
        f = _failures(r)
        posts = list(r.run_posts)
    by_rank = {e["data"]["rank"]: e["data"] for e in f}
    assert by_rank[1]["source"] == "launcher" and by_rank[1]["exit_code"] == 3 and by_rank[1]["signal"] is None, f
    assert by_rank[1]["local_rank"] == 1 and by_rank[1]["pid"] > 0
    if 0 in by_rank:  # stopped by the agent after rank 1 exited: not a cause
        assert by_rank[0]["signal"] == "SIGTERM" and by_rank[0].get("torn_down") is True, f
    assert [p.get("name") for p in posts] == ["elastic"] and posts[0]["job_id"] == "custom-launch", posts
