"""Device telemetry reports: a run's per-rank device figures (``GET /api/v1/runs/{id}/devices``, the run
page's device panel), the straggler report joined to them, and nodes ranked by device trouble."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..analysis.devices import (
    attach_device_causes,
    device_cause,
    device_finding,
    device_report,
    rank_device_nodes,
)
from ..analysis.regressions import Regression
from ..store import devices as device_store
from ..store import runs as run_store
from ..store.rows import RunRow
from . import _cache, scope

__all__ = ["run_devices", "devices_of", "with_device_causes", "straggler_device_cause", "node_device_trouble",
           "device_findings", "rank_device_nodes"]


def devices_of(engine: Engine, run_id: int) -> dict[str, Any]:
    """The device report of a run known to exist (no visibility check: callers have done it)."""
    return device_report(run_id, device_store.rank_device_figures(engine, run_id))


def run_devices(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """Per-rank device figures of a run (``analysis.devices.device_report``); None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None or not scope.is_visible(engine, run_id):
        return None
    out = devices_of(engine, run_id)
    out["world_size"] = run.world_size
    _with_sources(engine, run_id, out)
    return out


def _with_sources(engine: Engine, run_id: int, out: dict[str, Any]) -> None:
    """Each rank's ``source``: where its figures came from — ``agent`` (NVML in the job), ``dcgm`` (read by the
    server from dcgm-exporter, server/dcgm.py) or both (``agent+dcgm``)."""
    from ..store.dcgm import rank_sources

    src = rank_sources(engine, run_id)
    for r in out.get("ranks", []):
        r["source"] = "+".join(src.get(int(r["rank"]), [])) or None


def with_device_causes(engine: Engine, run: RunRow, report: dict[str, Any]) -> dict[str, Any]:
    """The straggler report with each straggler's ``cause`` (its device's throttle reason, clocks, errors).
    The device figures are cached with the run's version, like the report (a summary asks several times)."""
    if not report.get("stragglers"):
        return {**report, "devices_throttled": []}
    return attach_device_causes(report, _cache.cached("devices", engine, run, lambda: devices_of(engine, run.id)))


def straggler_device_cause(engine: Engine, run_id: int, rank: int, slowdown: float | None,
                           component: str | None = None) -> dict[str, Any] | None:
    """The device condition of one straggler rank (``analysis.devices.device_cause``; ``component``: where its
    excess is — a throttle does not explain data loading), or None."""
    rep = devices_of(engine, run_id)
    fig = next((r for r in rep["ranks"] if r["rank"] == int(rank)), None)
    return device_cause(fig, slowdown, component)


def node_device_trouble(engine: Engine, *, since_s: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Nodes ranked by device trouble across the runs the reader sees (runs throttled, XID windows, ECC errors)."""
    keys = scope.visible_keys()
    return device_store.node_device_trouble(engine, since_s=since_s, limit=limit,
                                            owner_keys=None if keys is None else sorted(keys))


def device_findings(engine: Engine, run_id: int) -> tuple[list[Regression], set[str]]:
    """The run's ``device`` alert finding (XID / ECC errors, heat or hardware throttling) and the series
    evaluated (``analysis.devices.device_finding``)."""
    if run_store.get_run(engine, run_id, pending=False) is None:
        return [], set()
    return device_finding(run_id, devices_of(engine, run_id))
