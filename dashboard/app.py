"""Builds the Dash app (Dash Pages) and mounts it at ``/`` inside the FastAPI server.

One Dash (Flask) app per process, built on first use; each FastAPI app that mounts it passes its
own ``app.state`` through the WSGI environ, so pages and callbacks find the right engine even when
one process serves several apps (tests). Routes registered before the mount (``/api/v1``,
``/healthz``, ``/metrics``, ``/docs``, ``/openapi.json``) keep precedence; unknown ``/api/`` paths
stay JSON 404s instead of falling through to the dashboard.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

__all__ = ["mount", "build_dash"]

_ENV_KEY = "fleetscope.app_state"
_dash: Any = None
_lock = threading.Lock()


def build_dash() -> Any:
    """The process's Dash app (created once): pages registered, callbacks attached."""
    global _dash
    with _lock:
        if _dash is not None:
            return _dash
        import dash
        from dash import dcc, html

        from .components import contained, navbar, page_header, render_error

        app = dash.Dash(
            __name__,
            use_pages=True,
            pages_folder="",
            assets_folder=str(Path(__file__).parent / "assets"),
            title="fleetscope",
            suppress_callback_exceptions=True,
            update_title=None,
            serve_locally=True,
        )
        # importing a page module registers its route (dash.register_page), so it follows Dash()
        from .pages import (
            benchmarks,
            cluster,
            compare,
            fleet,
            not_found_404,
            regressions,
            run,
            runs_table,
            scaling,
            utilisation,
        )

        for mod in (fleet, runs_table, run, scaling, compare, regressions, benchmarks, cluster, utilisation,
                    not_found_404):
            entry = dash.page_registry.get(mod.__name__)
            if entry is not None and not entry.get("supplied_layout"):
                # what Dash does for modules it imports from a pages folder itself; a layout that fails (data
                # it did not expect) shows the page's title and "could not render: <reason>", logged, not a 500
                name = str(entry.get("name") or mod.__name__)

                def failed_page(why: str, *_: Any, _name: str = name, **__: Any) -> Any:
                    return html.Div([page_header(_name), render_error(why, what="this page")])

                entry["layout"] = contained(f"the {name} page", fallback=failed_page,
                                            key=lambda *_, **kw: ", ".join(f"{k}={v!r}" for k, v in kw.items()))(mod.layout)
        app.layout = html.Div(
            [navbar(), html.Main(dash.page_container, className="fs-main"), dcc.Store(id="fs-tz", data="UTC")],
            className="fs-root",
        )
        _guard_callbacks(app)
        _dash = app
        return app


def _guard_callbacks(app: Any) -> None:
    """A malformed callback request (not JSON, not an object, an output no callback has) is a 400 with a
    JSON error naming what is wrong — checked before Dash dispatches it, so no traceback is logged for a
    client's mistake — and every HTTP error under ``/_dash-`` answers JSON, not an HTML page."""
    from flask import jsonify, request
    from werkzeug.exceptions import HTTPException

    def bad(status: int, message: str) -> Any:
        resp = jsonify({"error": {"status": status, "code": "bad_request" if status == 400 else "error",
                                  "message": message}, "detail": message})
        resp.status_code = status
        return resp

    @app.server.before_request
    def _check_callback() -> Any:
        if request.method != "POST" or not request.path.endswith("/_dash-update-component"):
            return None
        body = request.get_json(silent=True, force=True)
        if not isinstance(body, dict):
            return bad(400, "malformed callback request: the body must be a JSON object")
        out = body.get("output")
        if not isinstance(out, str) or not isinstance(body.get("inputs", []), list):
            return bad(400, "malformed callback request: 'output' must be a string and 'inputs' a list")
        if out not in app.callback_map:
            return bad(400, f"malformed callback request: no callback has the output {out[:120]!r}")
        for key in ("inputs", "state"):
            for item in body.get(key) or []:
                if not isinstance(item, (dict, list)):
                    return bad(400, f"malformed callback request: each of {key!r} must be an object")
        return None

    @app.server.errorhandler(HTTPException)
    def _http_error(e: HTTPException) -> Any:
        if request.path.startswith("/_dash-") or request.path.endswith("/_dash-update-component"):
            return bad(int(e.code or 500), str(e.description or e.name)[:300])
        return e


def _wsgi_with_state(wsgi: Any, app_state: Any) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        environ[_ENV_KEY] = app_state
        return wsgi(environ, start_response)

    return app


def mount(app: Any) -> None:
    """Mount the dashboard at ``/`` of the FastAPI ``app``; pages read the server's state from
    ``app.state.fs`` (set by the app's lifespan) through the WSGI environ."""
    from a2wsgi import WSGIMiddleware
    from starlette.middleware.gzip import GZipMiddleware
    from starlette.responses import JSONResponse

    dash_app = build_dash()
    inner = GZipMiddleware(WSGIMiddleware(_wsgi_with_state(dash_app.server, app.state), workers=8), minimum_size=2048)

    async def dashboard(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/api/") or path == "/api"):
            await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
            return
        await inner(scope, receive, send)

    app.mount("/", dashboard, name="dashboard")
