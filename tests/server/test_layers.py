"""The layers of the server, checked on the source (ast, no database): no import cycle between its
modules (function-level imports included), and every SQL statement in the store."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
PKG = "fleetscope.server"

#: files that still hold SQL while their owner rewires them onto the store (remove when done)
SQL_PENDING: dict[str, str] = {}

_SQL_START = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|COPY|WITH|CREATE|DROP|ALTER|TRUNCATE)\s")
_DB_CALLS = {"execute", "executemany", "exec_driver_sql", "copy"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SERVER).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PKG, *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SERVER.rglob("*.py")}


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the server modules it imports, anywhere in the file (top level or inside functions).
    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, path, node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def sql_sites(path: Path) -> list[str]:
    """Where a file builds or runs SQL: SQL string literals (upper-case keyword first, also the start
    of an f-string), ``text(...)``, and ``.execute/.executemany/.exec_driver_sql/.copy(<sql>)`` calls."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SQL_START.match(node.value):
            if id(node) not in docs:
                out.append(f"{path.name}:{node.lineno}: SQL text {node.value.strip()[:40]!r}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _DB_CALLS and (f.attr != "copy" or node.args):
                out.append(f"{path.name}:{node.lineno}: .{f.attr}(...)")
            elif isinstance(f, ast.Name) and f.id == "text":
                out.append(f"{path.name}:{node.lineno}: text(...)")
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_the_server_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40 and graph[f"{PKG}.reports.runs"]  # the graph is really built
    assert find_cycles(graph) == []


def test_the_cycle_finder_finds_a_function_level_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_every_sql_statement_is_in_the_store() -> None:
    offenders = {}
    for top in ("server", "dashboard"):
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel.startswith("server/store/") or rel.startswith("server/models.py") or rel in SQL_PENDING:
                continue
            sites = sql_sites(path)
            if sites:
                offenders[rel] = sites
    assert offenders == {}


def test_the_sql_check_sees_sql() -> None:
    assert len(sql_sites(SERVER / "store" / "runs.py")) > 10
    assert sql_sites(SERVER / "reports" / "runs.py") == []


def _imports_of(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions), absolute, from its own package."""
    pkg = {"dashboard": "fleetscope.dashboard", "fleetscope": "fleetscope"}[path.relative_to(ROOT).parts[0]]
    rel = path.relative_to(ROOT).with_suffix("").parts[1:]
    mod = ".".join([pkg, *[p for p in rel if p != "__init__"]])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, path, node)
            out |= {f"{src}.{a.name}" for a in node.names} | {src}
    return out


def test_the_dashboard_reads_only_through_the_facade() -> None:
    """Team scoping and read budgets live in the read façade (server/reports): a page that reached the
    store or the analysis directly could bypass them."""
    offenders = {}
    for path in (ROOT / "dashboard").rglob("*.py"):
        bad = sorted(m for m in _imports_of(path) if m.startswith("fleetscope.server")
                     and not m.startswith("fleetscope.server.reports") and m != "fleetscope.server")
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def test_the_cli_runs_no_sql() -> None:
    offenders = {str(p.relative_to(ROOT)): sql_sites(p) for p in (ROOT / "fleetscope").glob("*.py") if sql_sites(p)}
    assert offenders == {}
