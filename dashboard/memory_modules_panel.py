"""Memory explained: the run page's "Memory per module" panel, below the memory chart. The modules that hold
the most (saved activations, parameters, gradients, optimizer state of the rank with the largest
footprint), the step's peak split into those parts plus temporaries (estimated), the imbalance across
ranks, and the checkpointing advice with its price. Data: ``reports.memory_report`` (the same report as
``GET /api/v1/runs/{id}/memory``). Module names are user text: Dash escapes them (no HTML is built)."""

from __future__ import annotations

from typing import Any

from dash import Input, Output, html
from fleetscope.server import reports

from . import _state
from .components import callback, loading, section
from .theme import fmt_bytes, fmt_num, fmt_s

__all__ = ["memory_modules_section", "memory_modules_view", "PANEL", "TOP"]

RUN = "run-id"  # the run page's store of the run id (pages/run.py)
PANEL = "run-memory-modules"
TOP = 12  # modules listed
_PARTS = (("params_bytes", "parameters", "#0072B2"), ("grads_bytes", "gradients", "#56B4E9"),
          ("optimizer_bytes", "optimizer state", "#009E73"), ("activations_bytes", "activations", "#E69F00"),
          ("temporaries_bytes", "temporaries (estimated)", "#BBBBBB"))


def memory_modules_section() -> Any:
    """The panel's place on the run page (filled by the callback from the run id)."""
    return loading(html.Div(id=PANEL))


def _held(m: dict[str, Any]) -> float:
    return float(sum(m.get(k) or 0 for k in ("activation_bytes", "param_bytes", "grad_bytes", "optim_bytes")))


def _peak_bar(bd: dict[str, Any]) -> Any:
    peak = float(bd.get("peak_bytes") or 0)
    total = max(peak, sum(float(bd.get(k) or 0) for k, _, _ in _PARTS)) or 1.0
    bars, legend = [], []
    for key, label, colour in _PARTS:
        v = float(bd.get(key) or 0)
        bars.append(html.Div(title=f"{label}: {fmt_bytes(v)}",
                             style={"width": f"{100 * v / total:.2f}%", "background": colour, "height": "14px",
                                    "display": "inline-block"}))
        legend.append(html.Span([html.Span("■ ", style={"color": colour}), f"{label} {fmt_bytes(v)}  "]))
    return html.Div([
        html.Div([html.B("Peak "), fmt_bytes(peak), " = "], className="fs-muted"),
        html.Div(bars, style={"width": "100%", "whiteSpace": "nowrap", "lineHeight": "0"}, id=f"{PANEL}-peak"),
        html.Div(legend, className="fs-footnote"),
        html.Div(str(bd.get("note") or ""), className="fs-footnote"),
    ])


def _table(mods: list[dict[str, Any]]) -> Any:
    head = html.Tr([html.Th(h) for h in ("module", "type", "activations", "params", "grads", "optimizer",
                                         "checkpointed", "forward FLOPs")])
    rows = [html.Tr([html.Td(m.get("name")), html.Td(m.get("type") or ""), html.Td(fmt_bytes(m.get("activation_bytes"))),
                     html.Td(fmt_bytes(m.get("param_bytes"))), html.Td(fmt_bytes(m.get("grad_bytes"))),
                     html.Td(fmt_bytes(m.get("optim_bytes"))), html.Td("yes" if m.get("checkpointed") else ""),
                     html.Td(fmt_num(m.get("flops")) if m.get("flops") is not None else "–")])
            for m in mods]
    return html.Table([html.Thead(head), html.Tbody(rows)], className="fs-table", id=f"{PANEL}-table")


def _advice(report: dict[str, Any]) -> Any:
    items = []
    for a in report.get("checkpoint_advice") or []:
        price = []
        if a.get("step_s_cost") is not None:
            price.append(f"{'+' if a['step_s_cost'] >= 0 else '−'}{fmt_s(abs(a['step_s_cost']))} per step")
        if a.get("recompute_flops") is not None:
            price.append(f"recompute {fmt_num(a['recompute_flops'])} FLOPs per step")
        items.append(html.Div([html.B(a.get("label") or a.get("action")), html.Span(" · " + " · ".join(price) if price else ""),
                               html.Div(str(a.get("framing") or ""), className="fs-footnote")], className="fs-finding"))
    target = report.get("target_bytes")
    basis = f"target {fmt_bytes(target)} ({report.get('target_basis')})" if target is not None else ""
    if not items:
        items.append(html.Div(str(report.get("advice_note") or ""), className="fs-muted"))
    return html.Div([html.Div([html.B("Activation checkpointing: "), basis], className="fs-muted"), *items],
                    id=f"{PANEL}-advice")


def memory_modules_view(report: dict[str, Any] | None) -> Any:
    """The panel from a memory report; None when the run has no per-module measurement."""
    if not report or not report.get("modules"):
        return None
    mods = sorted(report["modules"], key=lambda m: -_held(m))[:TOP]
    imb = report.get("module_imbalance") or {}
    imb_txt = " · ".join(f"{label} max/median {imb[k]:.2f}×" for k, label in (
        ("activation_bytes", "activations"), ("param_bytes", "parameters"), ("optim_bytes", "optimizer state"))
        if imb.get(k) is not None)
    peak_imb = report.get("imbalance")
    head = [f"rank {report.get('modules_rank')}'s modules (the largest footprint)",
            f"{len(report.get('ranks') or [])} ranks measured"]
    if peak_imb is not None:
        head.append(f"peak max/median {peak_imb:.2f}×")
    if report.get("measure_cost_s") is not None:
        head.append(f"measured once, {fmt_s(report['measure_cost_s'])}")
    bd = report.get("breakdown")
    return section("Memory per module", [
        html.Div(" · ".join(head), className="fs-muted"),
        _peak_bar(bd) if bd else None,
        html.Div(imb_txt, className="fs-footnote", id=f"{PANEL}-imbalance") if imb_txt else None,
        _table(mods),
        _advice(report),
        html.Div("Activations: bytes each module saved for backward in one micro-batch (each storage once); "
                 "forward FLOPs per micro-batch; sharded figures (FSDP, TP, ZeRO) are this rank's shards.",
                 className="fs-footnote"),
    ], sid="run-memory-modules-section")


@callback(Output(PANEL, "children"), Input(RUN, "data"))
def _panel(rid: int | None) -> Any:
    if rid is None:
        return None
    return memory_modules_view(reports.memory_report(_state.engine(), int(rid)))
