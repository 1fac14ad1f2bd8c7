"""The `fleetscope` command line (docs/cli.md)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fleetscope: performance observability for training fleets")
db_app = typer.Typer(no_args_is_help=True, help="Database administration")
token_app = typer.Typer(no_args_is_help=True, help="API tokens")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")

DatabaseUrl = Annotated[
    Optional[str], typer.Option("--database-url", envvar="FLEETSCOPE_DATABASE_URL", help="Postgres URL (else embedded)")
]
DataDir = Annotated[
    Optional[Path], typer.Option("--data-dir", envvar="FLEETSCOPE_DATA_DIR", help="data dir of the embedded Postgres")
]


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("pgserver", "alembic.runtime.plugins", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _settings(**overrides: object):  # type: ignore[no-untyped-def]
    from fleetscope.server.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


#: option (or setting) names as the user typed them, for error messages
_OPTION_OF = {"forwarded_allow_ips": "--forwarded-allow-ips", "alertmanager_url": "--alertmanager-url",
              "metrics_max_runs": "--metrics-max-runs", "retention_blocks_days": "--blocks-days",
              "retention_rollups_days": "--rollups-days", "retention_runs_days": "--runs-days"}


def _checked_settings(**overrides: object):  # type: ignore[no-untyped-def]
    """:func:`_settings`, with a one-line error per bad value (exit 2) instead of a traceback."""
    from pydantic import ValidationError

    try:
        return _settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else "settings"
            where = _OPTION_OF.get(field, "")
            where = f"{where} (FLEETSCOPE_{field.upper()})" if where else f"FLEETSCOPE_{field.upper()}"
            hint = " (allowed: 0 to 36,500 days)" if field.startswith("retention_") and field.endswith("_days") else ""
            typer.secho(f"error: {where}: {err['msg']}{hint}", fg="red", err=True)
        raise typer.Exit(2) from None


def _days(value: float | None) -> float | None:
    """A retention limit: a finite number of days in 0..MAX_RETENTION_DAYS (typer names the option)."""
    import math

    from fleetscope.server.settings import MAX_RETENTION_DAYS

    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_RETENTION_DAYS):
        raise typer.BadParameter(f"must be a number of days from 0 to {MAX_RETENTION_DAYS:,.0f}, got {value}")
    return value


def _run_limit(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= 1_000_000:
        raise typer.BadParameter(f"must be a number of runs from 1 to 1,000,000, got {value}")
    return value


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    no_migrate: Annotated[bool, typer.Option("--no-migrate", help="do not apply migrations on start")] = False,
    insecure_no_auth: Annotated[
        bool, typer.Option("--insecure-no-auth", help="accept ingest without a token (DANGEROUS)")
    ] = False,
    read_auth: Annotated[
        bool, typer.Option("--read-auth", help="the read API, dashboard, /metrics and /docs need a read token")
    ] = False,
    allow_public_reads: Annotated[
        bool, typer.Option("--allow-public-reads",
                           help="serve a non-loopback address without --read-auth (anyone who reaches it reads)")
    ] = False,
    compaction_workers: Annotated[int | None, typer.Option(
        "--compaction-workers", min=0, max=64,
        help="compact in N worker processes (partitioned by run) instead of a thread of the server")] = None,
    forwarded_allow_ips: Annotated[Optional[str], typer.Option(
        "--forwarded-allow-ips", envvar="FLEETSCOPE_FORWARDED_ALLOW_IPS",
        help="proxies (addresses or networks, comma-separated; '*': any) whose X-Forwarded-For names the client "
             "for the failed-auth limit; default: none, X-Forwarded-For is ignored")] = None,
    alertmanager_url: Annotated[Optional[str], typer.Option(
        "--alertmanager-url", envvar="FLEETSCOPE_ALERTMANAGER_URL",
        help="send alerts to this Alertmanager (its /api/v2/alerts; e.g. http://alertmanager:9093)")] = None,
    metrics_max_runs: Annotated[Optional[int], typer.Option(
        "--metrics-max-runs", min=0, max=10_000,
        help="per-run gauges on /metrics for at most this many live runs (default 200)")] = None,
    no_cluster_metrics: Annotated[bool, typer.Option(
        "--no-cluster-metrics",
        help="leave the cluster-wide gauges (runs by status, per-run gauges) off this instance's /metrics")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the API, the dashboard and /metrics in one process (embedded Postgres without a URL)."""
    _setup_logging(verbose)
    settings = _checked_settings(
        host=host, port=port, database_url=database_url, data_dir=data_dir, migrate=not no_migrate,
        insecure_no_auth=insecure_no_auth or None, read_auth=read_auth or None,
        allow_public_unauthenticated=allow_public_reads or None, compaction_workers=compaction_workers,
        forwarded_allow_ips=forwarded_allow_ips, alertmanager_url=alertmanager_url, metrics_max_runs=metrics_max_runs,
        cluster_metrics=False if no_cluster_metrics else None,
    )
    if settings.insecure_no_auth:
        typer.secho("WARNING: authentication is DISABLED (--insecure-no-auth)", fg="red", bold=True, err=True)
    if not _is_loopback(settings.host) and not settings.read_auth:
        if not settings.allow_public_unauthenticated:
            typer.secho(f"error: --host {settings.host} is reachable from other machines and reads are open: add "
                        "--read-auth (reads need a read token), or --allow-public-reads to serve them openly",
                        fg="red", err=True)
            raise typer.Exit(2)
        typer.secho(f"WARNING: serving {settings.host} with open reads (--allow-public-reads): anyone who can reach "
                    "this port reads every run", fg="red", bold=True, err=True)
    from fleetscope.server.serve import run_server
    from fleetscope.webapp import create_web_app

    run_server(settings, app_factory=create_web_app)


@app.command()
def retention(
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    apply: Annotated[bool, typer.Option("--apply", help="carry the pass out (default: only show it)")] = False,
    blocks_days: Annotated[float | None, typer.Option(
        callback=_days, help="drop per-rank blocks of runs older than this many days (0..36500)")] = None,
    rollups_days: Annotated[float | None, typer.Option(
        callback=_days, help="drop per-step rows of runs older than this many days (0..36500)")] = None,
    runs_days: Annotated[float | None, typer.Option(
        callback=_days, help="delete runs older than this many days (0..36500)")] = None,
    limit: Annotated[int | None, typer.Option(callback=_run_limit, help="at most this many runs (1..1000000)")]
    = None,
) -> None:
    """Preview (default) or apply the retention policy: FLEETSCOPE_RETENTION_* settings, or these options."""
    _setup_logging()
    settings = _checked_settings(database_url=database_url, data_dir=data_dir, retention_blocks_days=blocks_days,
                                 retention_rollups_days=rollups_days, retention_runs_days=runs_days)
    from fleetscope.server import retention as ret
    from fleetscope.server.db import make_engine, resolve_database_url, upgrade

    if not ret.policy_for(settings, None).any and not settings.retention_overrides:
        typer.secho("no retention limit set: give --blocks-days / --rollups-days / --runs-days or "
                    "FLEETSCOPE_RETENTION_* settings", fg="yellow", err=True)
        raise typer.Exit(2)
    url, pg = resolve_database_url(settings.database_url, settings.data_dir)
    try:
        upgrade(url)
        engine = make_engine(url, pool_size=2)
        try:
            rows = ret.apply(engine, settings, limit=limit) if apply else [a.as_dict() for a in ret.plan(engine, settings, limit=limit)]
        finally:
            engine.dispose()
    finally:
        if pg is not None:
            pg.stop()
    verb = "done" if apply else "would do"
    typer.echo(f"retention {verb}: {len(rows)} run(s)")
    for r in rows:
        extra = f" ({r['steps']} steps)" if "steps" in r else (f" ({r['rows']} rows)" if "rows" in r else "")
        typer.echo(f"  {r['action']:8} run {r['run_id']} {r['name']} [{r['family'] or '-'}] {r['age_days']} days{extra}")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    data_dir: DataDir = None,
    no_job: Annotated[bool, typer.Option("--no-job", help="skip the live 4-rank CPU training job")] = False,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    small: Annotated[bool, typer.Option("--small", help="a smaller history (tests, slow machines)")] = False,
    exit_when_loaded: Annotated[bool, typer.Option("--exit-when-loaded", hidden=True)] = False,
) -> None:
    """Serve plus a synthetic fleet history (and a live CPU job): every page has data."""
    _setup_logging()
    settings = _settings(host=host, port=port, data_dir=data_dir)
    from fleetscope.demo import run_demo

    run_demo(settings, with_job=not no_job, small=small, exit_when_loaded=exit_when_loaded)


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Apply the schema migrations."""
    _setup_logging()
    from fleetscope.server.db import resolve_database_url, upgrade

    settings = _settings(database_url=database_url, data_dir=data_dir)
    url, pg = resolve_database_url(settings.database_url, settings.data_dir)
    try:
        upgrade(url)
        typer.echo("database schema is up to date")
    finally:
        if pg:
            pg.stop()


@db_app.command("distribute")
def db_distribute(database_url: DatabaseUrl = None) -> None:
    """Distribute the migrated schema on a Citus coordinator (per-run tables by run_id, co-located;
    the rest reference tables). Idempotent: a second run changes nothing."""
    _setup_logging()
    from sqlalchemy.exc import SQLAlchemyError

    from fleetscope.server.db import distribute_database
    from fleetscope.server.store.citus import NotCitus

    settings = _settings(database_url=database_url)
    if not settings.database_url:
        typer.secho("error: --database-url (FLEETSCOPE_DATABASE_URL) must name the Citus coordinator", fg="red", err=True)
        raise typer.Exit(2)
    url = settings.database_url
    where = url.rsplit("@", 1)[-1]
    try:
        plan, done, nodes = distribute_database(url)
    except NotCitus as e:
        typer.secho(f"error: {where} is not a Citus coordinator: {e} there (and on its workers), "
                    "register the workers (citus_add_node), then rerun", fg="red", err=True)
        raise typer.Exit(1) from None
    except (ValueError, SQLAlchemyError) as e:
        msg = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        typer.secho(f"error: distributing the schema on {where} failed: {msg}", fg="red", err=True)
        raise typer.Exit(1) from None
    if done:
        typer.echo(f"distributed {len(done)} tables ({len(plan.distributed)} per-run tables by run_id, "
                   f"co-located with {plan.colocate_with}; {len(plan.reference)} reference tables)")
    else:
        typer.echo(f"already distributed: nothing to do ({len(plan.distributed)} per-run tables, "
                   f"{len(plan.reference)} reference tables)")
    typer.echo("shards per node: " + (", ".join(f"{k} {v}" for k, v in nodes.items()) or "none"))


_T = TypeVar("_T")


def _with_engine(database_url: str | None, data_dir: Path | None, fn: Callable[[Any], _T]) -> _T:
    """Run ``fn(engine)`` on the configured database (embedded Postgres started and stopped around it)."""
    from fleetscope.server.db import make_engine, resolve_database_url, upgrade

    settings = _settings(database_url=database_url, data_dir=data_dir)
    url, pg = resolve_database_url(settings.database_url, settings.data_dir)
    try:
        upgrade(url)
        engine = make_engine(url, pool_size=1)
        try:
            return fn(engine)
        finally:
            engine.dispose()
    finally:
        if pg:
            pg.stop()


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option("--name", help="what the token is for (unique among active tokens)")],
    scope: Annotated[str, typer.Option("--scope", help="ingest (write run data), read (read API/dashboard) or admin")]
    = "ingest",
    expires_in: Annotated[Optional[float], typer.Option("--expires-in", help="days until it expires (default: never)")]
    = None,
    team: Annotated[Optional[str], typer.Option(
        "--team", help="tokens of one team share their runs (register, write, finish them); default: the token "
                       "alone owns the runs it registers")] = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Create an API token; prints it as the last line (only its hash is stored)."""
    from fleetscope.server.auth import TokenError, create_token

    try:
        token = _with_engine(database_url, data_dir,
                             lambda e: create_token(e, name, scope=scope, expires_in_days=expires_in, team=team))
    except TokenError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    of_team = f" of team {team!r}" if team else ""
    typer.echo(f"created {scope} token {name!r}{of_team} (store it now: it is not shown again)", err=True)
    typer.echo(token)


@token_app.command("list")
def token_list(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """List tokens: name, scope, team, state, created, last used, expiry (never the secret)."""
    from fleetscope.server.auth import list_tokens

    rows = _with_engine(database_url, data_dir, list_tokens)

    def ts(v: Any) -> str:
        return v.strftime("%Y-%m-%d %H:%M") if v is not None else "-"

    typer.echo(f"{'NAME':<24} {'SCOPE':<7} {'TEAM':<16} {'STATE':<8} {'PREFIX':<9} {'CREATED':<17} {'LAST USED':<17} "
               "EXPIRES")
    for r in rows:
        typer.echo(f"{r['name'][:24]:<24} {r['scope']:<7} {(r.get('team') or '-')[:16]:<16} {r['state']:<8} "
                   f"{r['prefix']:<9} {ts(r['created_at']):<17} {ts(r['last_used_at']):<17} {ts(r['expires_at'])}")


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="name of the token to revoke")],
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Revoke a token by name: every server instance refuses it from the next request on."""
    from fleetscope.server.auth import revoke_token

    n = _with_engine(database_url, data_dir, lambda e: revoke_token(e, name))
    if not n:
        typer.echo(f"error: no active token named {name!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {n} token(s) named {name!r}")


@app.command()
def upload(
    spool_dir: Annotated[Path, typer.Argument(help="spool directory written by the agent")],
    server: Annotated[str, typer.Option("--server", envvar="FLEETSCOPE_SERVER")],
    token: Annotated[Optional[str], typer.Option("--token", envvar="FLEETSCOPE_TOKEN")] = None,
) -> None:
    """Send spooled (offline) agent data to a server."""
    _setup_logging()
    from fleetscope.upload import upload as do_upload

    res = do_upload(str(spool_dir), server, token)
    typer.echo(res)
    if res.get("failed"):
        raise typer.Exit(1)


@app.command("delete-run")
def delete_run(
    run: Annotated[str, typer.Argument(help="run id or name")],
    server: Annotated[str, typer.Option("--server", envvar="FLEETSCOPE_SERVER", help="fleetscope server base URL")],
    token: Annotated[Optional[str], typer.Option("--token", envvar="FLEETSCOPE_TOKEN",
                                                 help="admin token (prefer FLEETSCOPE_TOKEN: argv is visible in ps)")]
    = None,
) -> None:
    """Delete a run and everything that hangs off it (needs an admin token)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=120.0) as c:
            rid: int | None = int(run) if run.isdigit() else None
            if rid is None:
                r = c.get("/api/v1/runs", params={"name": run, "limit": 10})
                found = [x for x in (r.json().get("runs", []) if r.status_code == 200 else []) if x["name"] == run]
                if r.status_code != 200 or not found:
                    typer.echo(f"error: no run named {run!r} (HTTP {r.status_code})", err=True)
                    raise typer.Exit(1)
                if len(found) > 1:  # names are unique per owner only: deleting needs the exact run
                    ids = ", ".join(str(x["id"]) for x in found)
                    typer.echo(f"error: {len(found)} runs are named {run!r} (ids {ids}); give the run id", err=True)
                    raise typer.Exit(1)
                rid = int(found[0]["id"])
            r = c.delete(f"/api/v1/runs/{rid}")
    except httpx.HTTPError as e:
        typer.echo(f"error: cannot reach {server}: {e}", err=True)
        raise typer.Exit(2) from None
    if r.status_code != 200:
        typer.echo(f"error: HTTP {r.status_code}: {r.text[:300]}", err=True)
        raise typer.Exit(1)
    rows = r.json()["deleted"]
    typer.echo(f"deleted run {rid}: " + ", ".join(f"{t} {n}" for t, n in rows.items() if n))


# Commands that live with their parts. Their modules keep top-level imports light (typer + stdlib),
# importing heavy dependencies inside the command function.
def _register_part_commands() -> None:
    from .analysis_cli import baseline_app, bench, check, detect
    from .launcher import run as launch_run
    from .projection_cli import project
    from .simulate import simulate
    from .traces.cli import import_trace

    for name, fn in (("simulate", simulate), ("import-trace", import_trace), ("detect", detect), ("check", check),
                     ("bench", bench), ("project", project)):
        app.command(name)(fn)
    app.add_typer(baseline_app, name="baseline")
    # `fleetscope run [OPTIONS] -- COMMAND ...`: everything after -- is COMMAND's, options included
    app.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})(launch_run)


_register_part_commands()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
