"""The dashboard: a Dash (Plotly) multi-page app mounted at ``/`` of the API server (see pages/).

``mount(app, state_ref)`` is what ``server.app.create_app`` calls; pages read through the server's
query layer (``server/queries.py``, ``server/views.py``) only. Imported lazily so that importing the
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
