"""``server/analysis`` is pure: no database driver, engine, store loader or façade — only the typed
rows of ``store.rows``, numpy and the standard library — checked on the source and on import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ANALYSIS = Path(__file__).resolve().parents[3] / "server" / "analysis"

_FORBIDDEN_TOP = ("sqlalchemy", "psycopg", "psycopg_pool", "fastapi", "alembic")
_FORBIDDEN_SERVER = ("db", "reports", "compactor", "ingest", "alerts", "app", "deps", "rank_matrix", "routes")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in the file, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.level, f"{node.module}.{a.name}" if node.module else a.name) for a in node.names]
    return out


def test_analysis_imports_no_database_store_loader_or_facade() -> None:
    files = sorted(ANALYSIS.glob("*.py"))
    assert len(files) >= 8
    offenders = []
    for f in files:
        for level, mod in _imports(f):
            name = mod.removeprefix("fleetscope.server.") if level == 0 else mod
            if level == 0 and mod.split(".")[0] in _FORBIDDEN_TOP:
                offenders.append(f"{f.name}: {mod}")
            elif (level >= 2 or mod.startswith("fleetscope.server.")) and (
                name.split(".")[0] in _FORBIDDEN_SERVER or (name.startswith("store.") and not name.startswith("store.rows."))
            ):
                offenders.append(f"{f.name}: {'.' * level}{mod}")
            elif "Engine" in mod or "engine" in mod.split("."):
                offenders.append(f"{f.name}: {mod}")
    assert offenders == []


def test_importing_the_analysis_loads_no_database_driver() -> None:
    mods = ", ".join(f"fleetscope.server.analysis.{f.stem}" for f in sorted(ANALYSIS.glob("*.py")) if f.stem != "__init__")
    code = (f"import sys, {mods}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'psycopg', 'fastapi')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
