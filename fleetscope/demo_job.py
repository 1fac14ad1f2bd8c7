"""The demo's live job: a real 4-rank CPU training run (torchrun, gloo) instrumented by the agent."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

__all__ = ["LiveJob", "start_job"]

log = logging.getLogger(__name__)


class LiveJob:
    """A torchrun process group; restarted with a new run name when it ends, stopped by ``stop()``."""

    def __init__(self, server: str, token: str, *, nproc: int = 4, steps: int = 600, sleep_ms: float = 150.0) -> None:
        self.server, self.token, self.nproc, self.steps, self.sleep_ms = server, token, nproc, steps, sleep_ms
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._log_dir = tempfile.mkdtemp(prefix="fleetscope-demo-job-")
        self._thread = threading.Thread(target=self._loop, name="fleetscope-demo-job", daemon=True)

    def start(self) -> LiveJob:
        self._thread.start()
        return self

    def _cmd(self, run_name: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                "-m", "fleetscope.demo_train", "--run-name", run_name, "--steps", str(self.steps),
                "--sleep-ms", str(self.sleep_ms)]

    def _loop(self) -> None:
        import time

        # a new run per demo start (the synthetic history is what re-runs must not duplicate)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        n = 0
        while not self._stop.is_set():
            run_name = f"demo-live-{stamp}" + (f"-{n}" if n else "")
            env = {**os.environ, "FLEETSCOPE_SERVER": self.server, "FLEETSCOPE_TOKEN": self.token,
                   "OMP_NUM_THREADS": "1", "FLEETSCOPE_SPOOL_DIR": os.path.join(self._log_dir, "spool")}
            with open(os.path.join(self._log_dir, f"job-{n}.log"), "wb") as out:
                self._proc = subprocess.Popen(self._cmd(run_name), env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
                rc = self._proc.wait()
            if rc != 0 and not self._stop.is_set():
                log.warning("demo job exited with %s (log: %s)", rc, self._log_dir)
                self._stop.wait(10)
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
        shutil.rmtree(self._log_dir, ignore_errors=True)


def start_job(server: str, token: str) -> LiveJob:
    """Start the live job streaming into ``server``."""
    return LiveJob(server, token).start()
