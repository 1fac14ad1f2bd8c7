"""The read model: every report the API routes and the dashboard pages show, composed from the store
(``fleetscope.server.store``: SQL, typed rows) and the analysis (``fleetscope.server.analysis``: pure
functions). Routes and pages call only this package (and the ``downsample`` helpers).

A run summary, for example (``GET /api/v1/runs/{id}/summary``)::

    routes/runs.py get_summary
      └ reports.run_summary                          reports/runs.py
          ├ store.runs.get_run          → RunRow      (+ counts landed but not compacted)
          ├ figures: cache → store.aggregates (run_stats row, else one aggregate query)
          │            → analysis.figures.run_figures → RunFigures
          ├ stragglers: store.ranks (rollups, hosts) → analysis.stragglers.straggler_report
          └ bottlenecks: store.collectives + store.ranks → analysis.collectives, analysis.bottlenecks
      → one dict (schemas.SummaryResponse)

Reports of a run are cached per process until the run changes (``RunRow.version``); per-run figures
are also kept in ``run_stats``. ``clear_caches()`` forgets the in-process part.
"""

from __future__ import annotations

from typing import Any

from ..analysis.explain import format_bandwidth  # one bandwidth format for pages, alerts and Slack
from ._cache import clear as clear_caches
from ._cache import forget_run
from .fleet import compare_runs, compare_view, families, fleet_rows, run_options, scaling, scaling_view
from .kernels import run_kernels
from .nodes import node_detail, node_list
from .overlap import run_overlap
from .pages import (
    bottleneck_report,
    collectives_view,
    comm_by_dim_of_runs,
    comm_dim_series,
    modality_series,
    rank_heatmap,
    rank_slowdown,
    ranking_from_shares,
    run_page_summary,
    run_series,
    straggler_view,
)
from .regressions import (
    alert_series,
    alerts_view,
    benchmark_regressions,
    benchmark_series,
    benchmarks_view,
    check_run,
    get_alert,
    list_alerts,
    list_baselines,
    pin_baseline,
    run_series_regressions,
    slow_node_findings,
    step_shift_regression,
    straggler_finding,
)
from .runs import (
    bottlenecks,
    collective_efficiency,
    database_ok,
    figures,
    get_run,
    goodput,
    list_runs,
    run_collectives,
    run_compile,
    run_events,
    run_folded,
    run_graph_collectives,
    run_summary,
    run_traces,
    stragglers,
    with_figures,
)

__all__ = [
    "clear_caches", "forget_run", "scope",
    # runs
    "get_run", "list_runs", "figures", "with_figures", "run_summary", "bottlenecks", "stragglers",
    "collective_efficiency", "run_collectives", "goodput", "run_events", "run_folded", "run_traces", "database_ok",
    "run_compile", "run_graph_collectives", "run_kernels", "run_overlap",
    # nodes across runs
    "node_list", "node_detail",
    # run page
    "run_page_summary", "run_series", "modality_series", "collectives_view", "comm_dim_series", "comm_by_dim_of_runs", "straggler_view", "bottleneck_report",
    "ranking_from_shares", "rank_heatmap", "rank_slowdown",
    # across runs
    "fleet_rows", "families", "run_options", "compare_runs", "compare_view", "scaling", "scaling_view",
    # regressions, alerts, benchmarks
    "run_series_regressions", "benchmark_regressions", "step_shift_regression", "straggler_finding", "slow_node_findings", "check_run",
    "pin_baseline", "list_baselines",
    "list_alerts", "get_alert", "alerts_view", "alert_series", "benchmark_series", "benchmarks_view",
]  # fmt: skip


# ------------------------------------------------------------------------------ who sees which run
# Every report of one run (a façade function whose second parameter is ``run_id``) answers for the
# current reader only (``scope``): for a run of another namespace, "not found" — None where the report
# answers None for a missing run, else ``scope.RunNotVisible`` (a LookupError).
from . import scope  # noqa: E402
from .devices import device_findings, node_device_trouble, rank_device_nodes, run_devices  # noqa: E402  (device telemetry)

__all__ += ["run_devices", "node_device_trouble", "device_findings", "rank_device_nodes"]
__all__ += ["format_bandwidth"]

_NONE_WHEN_MISSING = {"get_run", "run_summary", "run_page_summary", "check_run", "node_detail"}

from .projection import run_projection, scaling_projections, track_record  # noqa: E402  (projections, track record)

__all__ += ["run_projection", "track_record", "scaling_projections"]
_NONE_WHEN_MISSING.add("run_projection")

from .memory_modules import memory_report  # noqa: E402  (memory per module, checkpointing advice)

__all__ += ["memory_report"]
_NONE_WHEN_MISSING.add("memory_report")

from .utilisation import UtilisationError, fleet_utilisation  # noqa: E402  (fleet utilisation: GPU-hours)

__all__ += ["fleet_utilisation", "UtilisationError"]


def _scoped(name: str, fn: Any) -> Any:
    import functools

    @functools.wraps(fn)
    def wrapper(engine: Any, run_id: Any, *args: Any, **kwargs: Any) -> Any:
        if scope.visible_keys() is not None and isinstance(run_id, int) and not scope.is_visible(engine, run_id):
            if name in _NONE_WHEN_MISSING:
                return None
            raise scope.RunNotVisible(run_id)
        return fn(engine, run_id, *args, **kwargs)

    return wrapper


def _scope_reports() -> None:
    import inspect

    g = globals()
    for name in __all__:
        fn = g.get(name)
        if not inspect.isfunction(fn):
            continue
        params = list(inspect.signature(fn).parameters)
        if len(params) >= 2 and params[1] == "run_id":
            g[name] = _scoped(name, fn)


_scope_reports()
