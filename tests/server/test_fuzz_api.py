"""Schemathesis over the whole OpenAPI document, against the real server over HTTP, with Unicode edge
cases (NUL bytes, any code point) and a short, seeded budget: 0 server errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def test_fuzzing_every_operation_finds_no_server_error(live_server: Any, tmp_path: Path) -> None:
    st = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    cmd = [st, "run", f"{live_server.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", "20", "--seed", "20261203", "--mode", "all", "--workers", "2",
           "--generation-allow-x00", "true", "--generation-codec", "utf-8", "--generation-database", "none",
           "--header", f"Authorization: Bearer {live_server.token}", "--no-color",
           "--report", "junit", "--report-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert "Server error" not in out.stdout, tail
    m = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= 500 and m.group(1) == m.group(2), tail
    assert re.search(r"Tested: (\d+)", out.stdout) and int(re.search(r"Tested: (\d+)", out.stdout).group(1)) >= 15, tail
