"""``fleetscope import-trace``: reduce Kineto traces (HTA parity), print them, attach them to a run.

Top-level imports stay light (typer + stdlib): ``fleetscope.cli`` imports this module to register
the command, and the reducer (and numpy) load only when the command runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

__all__ = ["import_trace"]


def import_trace(
    path: Annotated[
        Path, typer.Argument(help="a .json/.json.gz trace, or a directory with one trace per rank")
    ],
    include_last_step: Annotated[
        bool,
        typer.Option(
            "--include-last-step", help="analyse the last ProfilerStep too (HTA include_last_profiler_step)"
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the full result as JSON")] = False,
    server: Annotated[
        Optional[str], typer.Option("--server", help="attach the result to a run on this server")
    ] = None,
    token: Annotated[
        Optional[str], typer.Option("--token", envvar="FLEETSCOPE_TOKEN", help="API token")
    ] = None,
    run: Annotated[
        Optional[str], typer.Option("--run", help="name of the run (registered if missing)")
    ] = None,
    num_kernels: Annotated[
        int, typer.Option("--num-kernels", min=1, help="top kernels kept per kernel type")
    ] = 10,
) -> None:
    """Reduce Kineto/Chrome traces to HTA's figures (temporal breakdown, overlap, idle time, kernels,
    per-step decomposition, stragglers), exactly as Holistic Trace Analysis computes them."""
    if server and not run:
        typer.echo("error: --server needs --run NAME (the run to attach the traces to)", err=True)
        raise typer.Exit(2)
    from .errors import TraceError
    from .reduce import reduce_traces

    try:
        result = reduce_traces(path, include_last_step=include_last_step, num_kernels=num_kernels)
    except TraceError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result, default=str))
    else:
        _print_table(result)
    if server:
        assert run is not None
        _attach(result, server=server, token=token, run=run, source=path.name or str(path))


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def _print_table(result: dict[str, Any]) -> None:
    cols = ("kernel_time_us", "idle_pct", "compute_pct", "non_compute_pct", "comm_overlap_pct")
    head = ["rank", "file", *cols]
    rows = [[r, s["source"], *(_fmt(s.get(c)) for c in cols)] for r, s in result["ranks"].items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for line in [head, *rows]:
        typer.echo("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    mode = "with" if result["include_last_step"] else "without"
    typer.echo(f"({mode} the last ProfilerStep; percentages of kernel_time_us, the GPU-active window)")
    st = result.get("stragglers", {})
    for key in ("hta", "corrected"):
        if key in st:
            s = st[key]
            typer.echo(
                f"late-start stragglers ({s['comm_kernel_rule']}): {s['ranks'] or '-'}"
                + (f"  [{s['error']}]" if s.get("error") else "")
            )


def _attach(result: dict[str, Any], *, server: str, token: str | None, run: str, source: str) -> None:
    import httpx

    from fleetscope.client import ApiError, Client

    world = max([s.get("world_size") or 0 for s in result["ranks"].values()] + [len(result["ranks"]), 1])
    try:
        with Client(server, token) as c:
            # registering is idempotent within the token's namespace (its team, else the token): it
            # joins the job's run when the job used a token of the same owner, else makes one of its
            # own — never another owner's run, which would answer 403
            found = [r for r in c.run_list(name=run) if r.get("name") == run]
            body = {**result, "source": source[:512]}
            out = None
            # attach to the run as it is: registering again would reopen a finished run (and page it as
            # stalled); only when it is not ours (403) or too small for the traces (422) register
            for r in found[:1]:
                if int(r.get("world_size") or 0) >= world:
                    resp = c.http.post(f"/api/v1/runs/{r['id']}/traces", json=body)
                    if resp.status_code not in (403, 422):
                        run_id = int(r["id"])
                        out = c._check(resp)
            if out is None:
                meta = {} if found else {"created_by": "import-trace"}
                run_id = c.register_run({"name": run, "world_size": world, "meta": meta})
                out = c._check(c.http.post(f"/api/v1/runs/{run_id}/traces", json=body))
    except ApiError as e:
        if e.status is None:  # no answer: the server was not reached
            typer.echo(f"error: cannot reach {server}: {e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"error: the server refused the traces: {e}", err=True)
        raise typer.Exit(1) from None
    except httpx.HTTPError as e:
        typer.echo(f"error: cannot reach {server}: {e}", err=True)
        raise typer.Exit(2) from None
    print(f"attached {out['stored']} trace summaries to run {run!r} (id {run_id})", file=sys.stderr)
