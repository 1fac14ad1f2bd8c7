"""The dashboard: a Dash (Plotly) multi-page app mounted at ``/`` of the API server (see pages/).

``mount(app)`` is what ``fleetscope.webapp.create_web_app`` calls (the server never imports the
dashboard); pages read through the server's read façade only. Imported lazily so that importing the
package does not load Dash.
"""

from __future__ import annotations

from typing import Any

__all__ = ["mount", "build_dash"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
