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
    return st.engine
