"""Analysis: bottlenecks, stragglers, scaling, regressions (docs/metrics.md).

Public functions (engine first, then keyword arguments; docs/analysis.md has the signatures).
Imported lazily, so ``fleetscope.server.analysis.cli`` stays light for the command line.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = [
    "run_stragglers",
    "run_bottlenecks",
    "run_goodput",
    "collective_efficiency",
    "scaling",
    "compare_runs",
    "run_stats",
    "check_run",
    "detect",
    "change_points",
    "fold_rank_rollups",
]

_WHERE = {
    "run_stragglers": "stragglers",
    "run_bottlenecks": "bottlenecks",
    "run_goodput": "goodput",
    "collective_efficiency": "collectives",
    "scaling": "scaling",
    "compare_runs": "scaling",
    "run_stats": "runstats",
    "check_run": "regressions",
    "detect": "changepoint",
    "change_points": "changepoint",
    "fold_rank_rollups": "rollups",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """``scaling`` names both a submodule and its function: importing the submodule binds it on the
    package, which would hide the function; keep the function bound instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "scaling" and isinstance(value, types.ModuleType) and hasattr(value, "scaling"):
            value = value.scaling
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
