"""The distribution: one wheel whose import names map the top-level folders, importable from the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_built_wheel_contains_and_imports_every_part(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    wheel = next(tmp_path.glob("fleetscope-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("fleetscope/cli.py", "fleetscope/wire.py", "fleetscope/agent/__init__.py", "fleetscope/server/app.py",
              "fleetscope/server/routes/ingest.py", "fleetscope/dashboard/__init__.py",
              "fleetscope/migrations/env.py", "fleetscope/migrations/versions/0001_initial_schema.py"):
        assert f in names, f
    assert not any(n.startswith(("agent/", "server/", "dashboard/", "tests/")) for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    # -S: no site hooks, so the editable install cannot shadow the wheel; deps from site-packages
    code = (
        "import fleetscope, fleetscope.agent, fleetscope.server.app, fleetscope.dashboard, fleetscope.migrations;"
        "import fleetscope.server.db as db, pathlib;"
        f"assert fleetscope.__file__.startswith({str(unpacked)!r}), fleetscope.__file__;"
        "cfg = db._alembic_config('postgresql://x/y');"
        "assert (pathlib.Path(cfg.get_main_option('script_location')) / 'versions').is_dir();"
        "print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(unpacked), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])}
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_agent_import_is_light() -> None:
    code = (
        "import sys, fleetscope.agent;"
        "heavy = [m for m in ('torch', 'fleetscope.server', 'fleetscope.dashboard', 'fastapi', 'sqlalchemy', 'numpy', 'dash')"
        " if m in sys.modules];"
        "assert not heavy, heavy"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
