"""The demo's live job: a real 4-rank CPU training run (torchrun, gloo) instrumented by the agent.

When the job cannot run (PyTorch missing, a crash, a port taken), the demo says so once, in one plain
line with what to do, and keeps serving the history: a job that failed is not restarted, because a
restart would fail the same way. A job that finishes its steps is started again under a new run name,
so the dashboard always has a live run.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["LiveJob", "start_job", "failure_reason"]

log = logging.getLogger(__name__)

_PREFLIGHT = (
    "import torch, torch.distributed as d\n"
    "assert d.is_available() and d.is_gloo_available(), 'torch.distributed with gloo is not available'\n"
)
_RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)\d*\]:\s?")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)$")
_WRAPPERS = ("ChildFailedError", "torch.distributed.elastic")


def failure_reason(log_text: str, returncode: int) -> str:
    """The most telling line of a failed job's output: the first exception raised by a rank, else the
    last exception line, else the exit code. torchrun's own wrapper exceptions are skipped."""
    found: list[str] = []
    for raw in log_text.splitlines():
        line = _RANK_PREFIX.sub("", raw).strip()
        m = _EXC_LINE.match(line)
        if m and not any(w in line for w in _WRAPPERS):
            found.append(m.group(1))
    if found:
        reason = found[0]
        return reason if len(reason) <= 300 else reason[:297] + "..."
    return f"exit code {returncode}"


class LiveJob:
    """A torchrun process group, restarted under a new run name when it finishes; stopped by ``stop()``.

    ``failure`` holds the one-line reason once the job failed (then nothing is restarted)."""

    def __init__(self, server: str, token: str, *, nproc: int = 4, steps: int = 600, sleep_ms: float = 150.0,
                 log_dir: str | os.PathLike[str], python: str = sys.executable,
                 command: Callable[[str], list[str]] | None = None) -> None:
        self.server, self.token, self.nproc, self.steps, self.sleep_ms = server, token, nproc, steps, sleep_ms
        self.python = python
        self.log_dir = Path(log_dir)
        self.failure: str | None = None
        self.starts = 0
        self._custom = command is not None
        self._command = command or self._torchrun
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleetscope-demo-job", daemon=True)

    def start(self) -> LiveJob:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in self.log_dir.glob("job-*.log"):
            old.unlink(missing_ok=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _torchrun(self, run_name: str) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                "-m", "fleetscope.demo_train", "--run-name", run_name, "--steps", str(self.steps),
                "--sleep-ms", str(self.sleep_ms)]

    def _fail(self, message: str) -> None:
        self.failure = message
        # one plain line on the demo's console; the dashboard keeps serving the history
        print(f"fleetscope demo: {message}", file=sys.stderr, flush=True)

    def _preflight(self) -> str | None:
        """Why the job cannot start at all, checked in the interpreter that will run it."""
        if self._custom:
            return None
        try:
            r = subprocess.run([self.python, "-c", _PREFLIGHT], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"cannot run {self.python}: {e}"
        if r.returncode == 0:
            return None
        reason = failure_reason(r.stderr, r.returncode)
        if "No module named 'torch'" in r.stderr or "No module named torch" in r.stderr:
            return (f"the live training job needs PyTorch, which this Python ({self.python}) cannot import "
                    f"({reason}); install it with: pip install -e \".[dev]\" (CPU build torch==2.13.0), "
                    "then restart the demo. The dashboard keeps serving the history.")
        return (f"the live training job cannot start: PyTorch is broken here ({reason}); reinstall it with "
                "pip install -e \".[dev]\", then restart the demo. The dashboard keeps serving the history.")

    def _loop(self) -> None:
        try:
            self._run()
        except Exception as e:  # the demo's server must outlive whatever happens here
            self._fail(f"the live training job failed to start ({type(e).__name__}: {e}); "
                       "the dashboard keeps serving the history.")

    def _run(self) -> None:
        reason = self._preflight()
        if reason is not None:
            self._fail(reason)
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")  # a new run per demo start; the history is what must not duplicate
        n = 0
        while not self._stop.is_set():
            run_name = f"demo-live-{stamp}" + (f"-{n}" if n else "")
            env = {**os.environ, "FLEETSCOPE_SERVER": self.server, "FLEETSCOPE_TOKEN": self.token,
                   "OMP_NUM_THREADS": "1", "FLEETSCOPE_SPOOL_DIR": str(self.log_dir / "spool")}
            path = self.log_dir / f"job-{n}.log"
            with open(path, "wb") as out:
                self._proc = subprocess.Popen(self._command(run_name), env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
                self.starts += 1
                rc = self._proc.wait()
            if self._stop.is_set():
                return
            if rc != 0:
                why = failure_reason(path.read_text(errors="replace"), rc)
                self._fail(f"the live training job failed ({why}); it is not restarted and the dashboard keeps "
                           f"serving the history. Full output: {path}. Fix the cause and restart the demo, "
                           "or run it with --no-job.")
                return
            n += 1

    def stop(self, timeout: float = 20.0) -> None:
        self._stop.set()
        p = self._proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._thread.join(timeout)


def start_job(server: str, token: str, *, log_dir: str | os.PathLike[str]) -> LiveJob:
    """Start the live job streaming into ``server``; its output goes to ``log_dir``."""
    return LiveJob(server, token, log_dir=log_dir).start()
