"""How the server is put together: every write route is guarded by the one token dependency, and the
server package never imports the dashboard (``fleetscope.webapp`` joins them)."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _dependency_names(route) -> set[str]:  # type: ignore[no-untyped-def]
    return {getattr(d.call, "__name__", "") for d in route.dependant.dependencies}


def test_every_write_route_declares_the_token_dependency() -> None:
    from fastapi.routing import APIRoute
    from fleetscope.server.routes import alerts, benchmarks, health, ingest, runs, traces

    routes = [r for m in (alerts, benchmarks, health, ingest, runs, traces) for r in m.router.routes]
    writes = [r for r in routes if isinstance(r, APIRoute) and r.methods - {"GET", "HEAD", "OPTIONS"}]
    assert len(writes) >= 7, [r.path for r in writes]
    for r in writes:
        names = _dependency_names(r)
        assert any(n.startswith("require_") and n.endswith("_token") for n in names), (r.path, names)
    admin = {r.path for r in writes if "require_admin_token" in _dependency_names(r)}
    assert admin == {"/alerts/{alert_id}/ack", "/alerts/{alert_id}/resolve", "/runs/{run_id}"}


def test_every_write_route_answers_401_without_a_token_and_writes_nothing(live_server) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    posts = ["/api/v1/ingest", "/api/v1/runs", "/api/v1/runs/1/finish", "/api/v1/runs/1/traces",
             "/api/v1/benchmarks", "/api/v1/alerts/1/ack", "/api/v1/alerts/1/resolve"]
    with httpx.Client(base_url=live_server.url) as c:
        for path in posts:
            r = c.post(path, json={"name": "x"}, headers={"Authorization": "Bearer fs_wrong"})
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert r.headers.get("www-authenticate") == "Bearer"
    with live_server.app.state.fs.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(("." * node.level) + node.module)
    return out


def test_server_never_imports_the_dashboard() -> None:
    offenders = []
    for f in (ROOT / "server").rglob("*.py"):
        for mod in _imports(f):
            if "dashboard" in mod:
                offenders.append(f"{f.relative_to(ROOT)}: {mod}")
    assert not offenders, offenders


def test_no_string_imports_in_the_packages() -> None:
    offenders = []
    for part in ("server", "dashboard", "agent", "fleetscope"):
        for f in (ROOT / part).rglob("*.py"):
            if "importlib" in _imports(f) or "import_module(" in f.read_text():
                offenders.append(str(f.relative_to(ROOT)))
    assert not offenders, offenders
