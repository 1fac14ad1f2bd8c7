"""Commands ``fleetscope detect``, ``check`` and ``bench`` (registered by ``fleetscope.cli``).

None of them needs the server package: ``detect`` runs the change-point detector
(``fleetscope.changepoint``) locally, ``check`` asks a server over HTTP, ``bench`` runs the
microbenchmarks (``fleetscope.bench``) and posts them. Top-level imports stay light (typer +
stdlib): numpy, httpx and torch are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

__all__ = ["detect", "check", "bench"]

Server = Annotated[str, typer.Option("--server", envvar="FLEETSCOPE_SERVER", help="fleetscope server base URL")]
Token = Annotated[Optional[str], typer.Option("--token", envvar="FLEETSCOPE_TOKEN", help="API token")]


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def detect(
    file: Annotated[str, typer.Argument(help="JSON array of numbers (null = missing); '-' or nothing reads stdin")] = "-",
) -> None:
    """Print the change points of a JSON series (index of the first point after each change), found
    by the detector and default configuration that raise regression alerts."""
    try:
        raw = sys.stdin.read() if file == "-" else Path(file).read_text()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise _fail(f"cannot read a JSON array from {file!r}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("values"), list):
        data = data["values"]
    if not isinstance(data, list) or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                             for v in data):
        raise _fail("expected a JSON array of numbers")
    from .changepoint import change_points

    values = [float("nan") if v is None else float(v) for v in data]
    typer.echo(json.dumps({"change_points": change_points(values)}))


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "s":
        return f"{v * 1e3:.2f} ms" if abs(v) < 1 else f"{v:.3f} s"
    if unit == "":
        return f"{100 * v:.2f}%"
    return f"{v:,.1f} {unit}"


def check(
    server: Server,
    run: Annotated[str | None, typer.Option("--run", help="run name (your runs: a read token with a team sees "
                                                          "only its team's)")] = None,
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the server's verdict as JSON")] = False,
    run_id: Annotated[int | None, typer.Option("--run-id", help="the run's id, when a name is ambiguous")] = None,
) -> None:
    """CI gate: exit 0 when the run shows no regression against its family's baseline (runs of the same
    owner: its team's, or its token's), 1 when it does (printing what and by how much), 2 on usage or
    connection errors — and when --run names runs of several jobs (several owners): give --run-id."""
    import httpx

    if (run is None) == (run_id is None):
        raise _fail("give --run NAME or --run-id ID")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=60.0) as c:
            if run_id is not None:
                rid = run_id
                run = run or f"id {run_id}"
            else:
                # the name as a value (eq:), never read as an operator prefix
                r = c.get("/api/v1/runs", params={"name": f"eq:{run}", "limit": 50})
                if r.status_code != 200:
                    raise _fail(f"listing runs failed: HTTP {r.status_code}")
                runs = r.json().get("runs", [])
                if not runs:
                    raise _fail(f"no run named {run!r} on {server}")
                rid = runs[0]["id"]
                # names are unique per owner (team or token) and attempt: the attempts of one job share its
                # job id; runs of several jobs under one name are several owners' — refuse to guess
                jobs = {x.get("job_id") or f"run:{x['id']}" for x in runs}
                if len(jobs) > 1:
                    listing = ", ".join(f"{x['id']} (started {x.get('started_at') or '?'})" for x in runs[:10])
                    raise _fail(f"{len(runs)} runs of {len(jobs)} jobs are named {run!r} (several owners): "
                                f"{listing}; give --run-id, or use a read token of your team")
            r = c.get(f"/api/v1/runs/{rid}/check")
            if r.status_code == 404:
                raise _fail(f"no run with id {rid} on {server} (or not one your token may read)")
            if r.status_code != 200:
                raise _fail(f"check failed: HTTP {r.status_code} {r.text[:200]}")
            res = r.json()
    except httpx.HTTPError as e:
        raise _fail(f"cannot reach {server}: {e}") from None
    if as_json:
        typer.echo(json.dumps(res, indent=2))
    base = res["baseline"]
    if not res["regressed"]:
        if not as_json:
            n = len(base["runs"])
            typer.echo(f"OK: run {run!r} shows no regression"
                       + (f" against {n} baseline run(s) ({base['match']})" if n else " (no baseline runs yet)"))
        raise typer.Exit(0)
    if not as_json:
        for g in res["regressions"]:
            unit = g.get("unit", "")
            how = (f"vs the median of {g['baseline_runs']} baseline run(s)" if "baseline_runs" in g
                   else f"from step {g.get('first_bad_step')} within the run (p = {g.get('p_value', 0):.3g})")
            typer.echo(f"REGRESSION: {g['metric']} {_fmt(g['before'], unit)} -> {_fmt(g['after'], unit)} "
                       f"({100 * g['change']:+.1f}%) {how}")
    raise typer.Exit(1)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def bench(
    server: Annotated[Optional[str], typer.Option("--server", envvar="FLEETSCOPE_SERVER",
                                                  help="post the results to this server (else print only)")] = None,
    token: Token = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="series key (default: this host's name)")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes: a smoke test in seconds")] = False,
    threads: Annotated[int, typer.Option("--threads", min=1, help="CPU threads per process")] = 1,
    git_commit: Annotated[Optional[str], typer.Option("--git-commit", help="commit to record (default: git HEAD)")] = None,
) -> None:
    """Cluster microbenchmarks recorded as benchmark series: matmul TFLOP/s by size and dtype,
    all_reduce busbw by message size (gloo on CPU, NCCL on GPUs), host→device bandwidth on GPU."""
    from .bench import run_all

    results = run_all(quick=quick, threads=threads)
    commit = git_commit or os.environ.get("FLEETSCOPE_GIT_COMMIT") or _git_commit()
    for r in results:
        r["git_commit"] = commit
        params = ",".join(f"{k}={v}" for k, v in r["params"].items())
        typer.echo(f"{r['name']}[{params}]: {r['value']:.4g} {r['unit']}")
    if not server:
        return
    import httpx

    body: dict[str, Any] = {"cluster": cluster or socket.gethostname(), "points": results}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.post(server.rstrip("/") + "/api/v1/benchmarks", json=body, headers=headers, timeout=60.0)
    except httpx.HTTPError as e:
        raise _fail(f"cannot reach {server}: {e}") from None
    if resp.status_code != 200:
        raise _fail(f"posting results failed: HTTP {resp.status_code} {resp.text[:200]}")
    typer.echo(f"posted {len(results)} points to {server} ({len(resp.json()['series'])} series)", err=True)


baseline_app = typer.Typer(help="Pinned regression baselines: what `fleetscope check` compares against.",
                           no_args_is_help=True)


@baseline_app.command("pin")
def baseline_pin(
    run: Annotated[Optional[str], typer.Argument(help="the run's name (your runs)")] = None,
    server: Server = "http://127.0.0.1:8000",
    token: Token = None,
    run_id: Annotated[Optional[int], typer.Option("--run-id", help="the run's id, when a name is ambiguous")] = None,
) -> None:
    """Pin RUN as the baseline of its family and config signature (in your namespace: your team's runs):
    `fleetscope check` then compares later runs with it and the runs that passed after it, so a regression
    that persists fails every check until a new baseline is pinned. Exit 0 when pinned, 2 otherwise."""
    import httpx

    if (run is None) == (run_id is None):
        raise _fail("give RUN (a name) or --run-id ID")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=60.0) as c:
            if run_id is None:
                r = c.get("/api/v1/runs", params={"name": f"eq:{run}", "limit": 50})
                if r.status_code != 200:
                    raise _fail(f"listing runs failed: HTTP {r.status_code}")
                runs = r.json().get("runs", [])
                if not runs:
                    raise _fail(f"no run named {run!r} on {server}")
                if len({x.get("job_id") or f"run:{x['id']}" for x in runs}) > 1:
                    raise _fail(f"{len(runs)} runs of several jobs are named {run!r}: "
                                + ", ".join(str(x["id"]) for x in runs[:10]) + "; give --run-id")
                run_id = int(runs[0]["id"])
            r = c.post("/api/v1/baselines", json={"run_id": run_id})
            if r.status_code != 200:
                raise _fail(f"pinning failed: HTTP {r.status_code} {r.text[:200]}")
            out = r.json()
    except httpx.HTTPError as e:
        raise _fail(f"cannot reach {server}: {e}") from None
    typer.echo(f"pinned run {out['name']!r} (id {out['run_id']}) as the baseline of {out['model_family']} "
               f"(config signature {out['config_signature'] or 'none'})")
