"""Where pages find the server's engine: the ``state_ref`` the mounting FastAPI app put in the WSGI environ."""

from __future__ import annotations

from typing import Any

__all__ = ["engine", "NotReady"]


class NotReady(RuntimeError):
    """The server has not finished starting (no engine yet)."""


def engine() -> Any:
    """The SQLAlchemy engine of the server handling the current request."""
    from flask import request

    ref = request.environ.get("fleetscope.state_ref") or {}
    st = ref.get("state")
    if st is None:
        raise NotReady("fleetscope is still starting; reload in a moment")
    return st.engine
