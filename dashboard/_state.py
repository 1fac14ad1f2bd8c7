"""Where pages find the server's engine: the ``app.state`` the mounting FastAPI app put in the WSGI environ."""

from __future__ import annotations

from typing import Any

__all__ = ["engine", "NotReady"]


class NotReady(RuntimeError):
    """The server has not finished starting (no engine yet)."""


def engine() -> Any:
    """The SQLAlchemy engine of the server handling the current request."""
    from flask import request

    st = getattr(request.environ.get("fleetscope.app_state"), "fs", None)
    if st is None:
        raise NotReady("fleetscope is still starting; reload in a moment")
    # who reads: the principal the server's edge authenticated (with --read-auth); the façade then answers
    # for that reader's runs only (server/reports/scope.py). Set on every call: worker threads are reused
    from fleetscope.server.reports import scope

    asgi_scope = request.environ.get("asgi.scope") or {}
    scope.set_viewer((asgi_scope.get("state") or {}).get("principal"))
    # the read pool (its own connections, a statement budget: server/reads.py); ``engine`` before it existed
    return getattr(st, "read_engine", None) or st.engine
