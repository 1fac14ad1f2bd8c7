"""``fleetscope project RUN_ID --world-size N [--tp --pp --micro-batches --bucket-bytes --global-batch]``: the
run's step, MFU and tokens/s projected to another layout (``GET /api/v1/runs/{id}/projection``, estimated,
with its error band and what it rests on). Top-level imports stay light (typer + stdlib)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from .analysis_cli import Server, Token

__all__ = ["project"]


def _fmt(v: Any, unit: str = "", scale: float = 1.0) -> str:
    return "–" if v is None else f"{v * scale:.4g}{unit}"


def project(
    run_id: Annotated[int, typer.Argument(help="the run to project from")],
    world_size: Annotated[int, typer.Option("--world-size", "-n", help="target world size (GPUs)")],
    server: Server,
    token: Token = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="tensor-parallel degree (default: the run's)")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="pipeline-parallel degree (default: the run's)")] = None,
    micro_batches: Annotated[Optional[int], typer.Option("--micro-batches", help="pipeline micro-batches")] = None,
    bucket_bytes: Annotated[Optional[int], typer.Option("--bucket-bytes", help="gradient bucket size")] = None,
    global_batch: Annotated[bool, typer.Option("--global-batch", help="hold the global batch (strong scaling) "
                                                                      "instead of the per-replica batch")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the server's answer as JSON")] = False,
) -> None:
    """Project a run to another world size / tp / pp / micro-batch count from its own measurements."""
    from .client import ApiError, Client

    try:
        with Client(server, token) as c:
            out = c.projection(run_id, world_size=world_size, tp=tp, pp=pp, micro_batches=micro_batches,
                               bucket_bytes=bucket_bytes, batch="global" if global_batch else None)
    except ApiError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    if out.get("status") != "ok":
        typer.echo(f"not enough data to project run {run_id}:")
        for m in out.get("missing") or []:
            typer.echo(f"  - {m}")
        raise typer.Exit(1)
    t, band = out["target"], out["error_band"] or {}
    typer.echo(f"run {run_id} at {t['world_size']} GPUs (dp {t['dp']} × tp {t['tp']} × pp {t['pp']}), estimated "
               f"±{100 * (band.get('relative') or 0):.0f} %:")
    typer.echo(f"  step       {_fmt(out['step_s'], ' s')}   (measured {_fmt(out['baseline']['step_s'], ' s')} "
               f"at {out['baseline']['layout']['world_size']} GPUs)")
    typer.echo(f"  MFU        {_fmt(out['mfu'], ' %', 100)}")
    typer.echo(f"  tokens/s   {_fmt(out['tokens_per_s'])}")
    measured = out["basis"].get("measured_parts") or {}
    for k, v in (out.get("parts") or {}).items():
        if v or measured.get(k):
            typer.echo(f"  {k:<15} {_fmt(measured.get(k), ' s'):>10} → {_fmt(v, ' s')}")
    typer.echo(f"  busbw: {out['basis'].get('sizes')}; from {', '.join(out['basis'].get('sources') or []) or 'the run'}")
