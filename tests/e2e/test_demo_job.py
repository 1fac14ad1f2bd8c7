"""The demo's live job when it cannot run: one plain line saying what failed and what to do, no restart
loop, and the demo keeps serving the history."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

from fleetscope.demo_job import LiveJob, failure_reason

FS = [sys.executable, "-m", "fleetscope.cli"]

_CRASH = (
    "import sys\n"
    "print('[rank1]: Traceback (most recent call last):')\n"
    "print('[rank1]:   File \"train.py\", line 3, in <module>')\n"
    "print('[rank1]: RuntimeError: boom: the model does not fit')\n"
    "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ')\n"
    "sys.exit(3)\n"
)


def test_failure_reason_names_the_ranks_exception_not_torchruns_wrapper() -> None:
    text = ("W1203 launching\n[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: bad shape\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert failure_reason(text, 1) == "ValueError: bad shape"
    assert failure_reason("nothing useful\n", 137) == "exit code 137"


def test_crashed_job_is_reported_once_and_not_restarted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = LiveJob("http://127.0.0.1:9", "t", log_dir=tmp_path / "logs",
                  command=lambda run: [sys.executable, "-c", _CRASH]).start()
    job.join(60)
    try:
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("fleetscope demo:")]
        assert len(lines) == 1, err
        assert "RuntimeError: boom: the model does not fit" in lines[0]
        assert "not restarted" in lines[0] and "--no-job" in lines[0] and str(tmp_path / "logs" / "job-0.log") in lines[0]
        assert job.starts == 1 and job.failure is not None
        assert sorted(p.name for p in (tmp_path / "logs").glob("job-*.log")) == ["job-0.log"]
    finally:
        job.stop()


def test_finished_job_starts_again_under_a_new_run_name(tmp_path: Path) -> None:
    names: list[str] = []

    def cmd(run: str) -> list[str]:
        names.append(run)
        return [sys.executable, "-c", "pass"]

    job = LiveJob("http://127.0.0.1:9", "t", log_dir=tmp_path / "logs", command=cmd).start()
    deadline = time.monotonic() + 60
    while job.starts < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.stop()
    assert job.failure is None and len(names) >= 3 and len(set(names)) == len(names), names


def test_demo_without_torch_says_once_what_to_do_and_keeps_serving_the_history(tmp_data_dir: Path,
                                                                                 tmp_path: Path) -> None:
    hide = tmp_path / "no-torch"
    (hide / "torch").mkdir(parents=True)
    (hide / "torch" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    port = free_port()
    proc = subprocess.Popen([*FS, "demo", "--port", str(port), "--data-dir", str(tmp_data_dir), "--small"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        loaded = False
        while time.monotonic() < deadline and proc.poll() is None and not loaded:
            try:
                loaded = len(httpx.get(f"{url}/api/v1/runs", params={"limit": 500}, timeout=5).json()["runs"]) > 20
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        assert loaded, "the demo did not serve its history"
        time.sleep(15)  # longer than the old 10 s restart loop: a loop would have repeated itself
        assert proc.poll() is None, "the demo must keep serving when its live job cannot run"
        runs = httpx.get(f"{url}/api/v1/runs", params={"limit": 500}, timeout=10).json()["runs"]
        assert not [r for r in runs if r["name"].startswith("demo-live-")]
        assert httpx.get(f"{url}/", timeout=30).status_code == 200
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    lines = [ln for ln in out.splitlines() if "live training job" in ln]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("fleetscope demo: ") and "needs PyTorch" in lines[0]
    assert 'pip install -e ".[dev]"' in lines[0] and "keeps serving the history" in lines[0]
