"""The run page's device panel, beside the step heatmap: each rank's SM clock (median over its telemetry
windows) with the ranks whose GPU throttled marked by reason, and a table of the ranks to look at
(throttled, XID or ECC errors) with their clocks against their peers', temperature, power against its
cap, node. Reads only through ``reports.run_devices``; the figure and table builders are pure."""

from __future__ import annotations

from typing import Any

from dash import Input, Output, dcc, html
from fleetscope.server import reports

from . import _state
from .components import callback, graph, loading, section, simple_table
from .figures import Fig, _axis, _layout, empty_figure, plain

__all__ = ["SECTION", "FIGURE", "TABLE", "device_section", "device_figure", "device_table"]

SECTION = "run-devices"
FIGURE = "run-devices-figure"
TABLE = "run-devices-table"
RUN = "run-devices-run"
#: a colour per throttle reason (colour-blind safe, as the rest of the page)
REASON_COLORS = {"power": "#D55E00", "thermal": "#CC79A7", "hw_slowdown": "#E69F00", "power_brake": "#8C564B",
                 "sync_boost": "#999999"}
MAX_TABLE_ROWS = 32


def device_section(run_id: int | None) -> html.Section:
    """The panel: the per-rank clock chart and the table of the ranks to look at."""
    return section("Devices · per-rank GPU telemetry", [
        dcc.Store(id=RUN, data=run_id),
        loading(graph(FIGURE)),
        loading(html.Div(id=TABLE)),
    ], sid=SECTION)


def device_figure(rep: dict[str, Any] | None) -> Fig:
    """SM clock per rank; throttled ranks in their reason's colour; the peers' median as a line."""
    ranks = (rep or {}).get("ranks") or []
    if not any(r.get("sm_clock_mhz") is not None for r in ranks):
        return empty_figure("No device telemetry for this run (the agent sends it where NVML is available: "
                            "pip install 'fleetscope[nvml]' on GPU nodes).")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("sm_clock_mhz") is None:
            continue
        groups.setdefault(r["reason"] if r.get("throttled") else "", []).append(r)
    data: list[dict[str, Any]] = []
    size = 6 if len(ranks) < 2000 else 3
    for reason, rs in sorted(groups.items()):
        name = f"throttled: {reason}" if reason else "not throttled"
        data.append({"type": "scatter", "mode": "markers", "name": name, "x": [r["rank"] for r in rs],
                     "y": [r["sm_clock_mhz"] for r in rs],
                     "marker": {"size": size + (3 if reason else 0), "color": REASON_COLORS.get(reason, "#0072B2"),
                                "symbol": "diamond" if reason else "circle"},
                     "customdata": [[plain(r.get("node") or "?"), round(100 * float(r.get("throttled_share") or 0))]
                                    for r in rs],
                     "hovertemplate": "rank %{x} on %{customdata[0]}: %{y:.0f} MHz, throttled %{customdata[1]} %"
                                      "<extra>" + plain(name) + "</extra>"})
    peers = (rep or {}).get("peers", {}).get("sm_clock_mhz")
    shapes = ([{"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": peers, "y1": peers,
                "line": {"color": "#999999", "width": 1, "dash": "dot"}}] if peers is not None else [])
    n = len((rep or {}).get("throttled_ranks") or [])
    note = (f"median SM clock per rank over its telemetry windows; {n} rank{'s' if n != 1 else ''} throttled "
            f"(a slowing reason active ≥ {100 * float((rep or {}).get('throttled_share_min') or 0.1):.0f} % of the time)"
            + (f"; dotted: the ranks' median {peers:.0f} MHz" if peers is not None else ""))
    return {"data": data, "layout": _layout("GPU clocks by rank", height=300, note=note, hovermode="closest",
                                            x=_axis(title="rank"), y=_axis(title="SM clock (MHz)"), shapes=shapes)}


def _ghz(v: Any) -> str:
    return f"{float(v) / 1000:.2f} GHz" if v is not None else "–"


def device_table(rep: dict[str, Any] | None) -> Any:
    """The ranks to look at: throttled or with XID / ECC errors, worst first."""
    ranks = [r for r in (rep or {}).get("ranks") or [] if r.get("throttled") or r.get("xid") or r.get("ecc_errors")]
    if not (rep or {}).get("ranks"):
        return None
    if not ranks:
        return html.P("No rank's GPU throttled or logged XID / ECC errors.", className="fs-muted", id=f"{TABLE}-none")
    ranks.sort(key=lambda r: (-float(r.get("throttled_share") or 0), -len(r.get("xid") or []), r["rank"]))
    rows = []
    for r in ranks[:MAX_TABLE_ROWS]:
        reason = r.get("reason") or "–"
        share = f"{100 * float(r.get('throttled_share') or 0):.0f} %"
        power = (f"{r['power_w']:.0f} / {r['power_limit_w']:.0f} W" if r.get("power_w") is not None
                 and r.get("power_limit_w") is not None else "–")
        rows.append([str(r["rank"]), plain(r.get("node") or "?"), reason, share,
                     f"{_ghz(r.get('sm_clock_mhz'))} vs {_ghz(r.get('peers_sm_clock_mhz'))}",
                     f"{r['temp_c_max']:.0f} °C" if r.get("temp_c_max") is not None else "–", power,
                     ", ".join(str(x) for x in r.get("xid") or []) or "–", str(r.get("ecc_errors") or 0)])
    more = len(ranks) - len(rows)
    return html.Div([simple_table(["rank", "node", "reason", "throttled", "SM clock vs peers", "max temp",
                                   "power / cap", "XID", "ECC"], rows, tid=f"{TABLE}-rows", numeric=(0, 3, 8),
                                  row_classes=["fs-differs" if r.get("throttled") else "" for r in ranks[:MAX_TABLE_ROWS]]),
                     html.P(f"and {more} more", className="fs-muted") if more > 0 else None])


@callback(Output(FIGURE, "figure"), Output(TABLE, "children"), Input(RUN, "data"))
def _devices(rid: int | None) -> tuple[Fig, Any]:
    if rid is None:
        return empty_figure("No run."), None
    rep = reports.run_devices(_state.engine(), int(rid))
    return device_figure(rep), device_table(rep)
