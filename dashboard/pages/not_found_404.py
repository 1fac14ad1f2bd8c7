"""Any other path: say so and link back."""

from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from ..components import empty_state, page_header

dash.register_page(__name__, path="/404", name="Not found", title="fleetscope · not found")


def layout(**_: Any) -> html.Div:
    return html.Div([page_header("Page not found"),
                     empty_state("Nothing here", "Pages: fleet /, run /runs/<id>, /scaling, /compare, /regressions, /benchmarks."),
                     dcc.Link("← fleet", href="/")])
