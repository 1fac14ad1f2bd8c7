"""The whole web application of ``fleetscope serve``: the API server with the dashboard mounted at ``/``.

The server package never imports the dashboard; this composition root joins them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

__all__ = ["create_web_app"]


def create_web_app(settings: Any, *, database_url: str | None = None, start_background: bool = True) -> FastAPI:
    """``create_app`` (ingest, read API, /healthz, /metrics) plus the Dash dashboard at ``/``."""
    from fleetscope.dashboard.app import mount
    from fleetscope.server.app import create_app

    app = create_app(settings, database_url=database_url, start_background=start_background)
    mount(app)
    return app
