"""House style is part of the test command: ruff over the packages, mypy over the typed ones."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "fleetscope", "agent", "server", "dashboard", "tests", "bench"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy", "agent", "server", "fleetscope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
