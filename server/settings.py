"""Server settings: one pydantic-settings class (FLEETSCOPE_<NAME> environment variables), built by the CLI
and passed to `create_app` — never created at import time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "default_data_dir", "MAX_RETENTION_DAYS"]

#: the longest retention limit, in days (100 years)
MAX_RETENTION_DAYS = 36_500.0


def default_data_dir() -> Path:
    """The user's data dir for fleetscope (XDG on Linux), overridable by FLEETSCOPE_DATA_DIR."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "fleetscope"


def default_read_concurrency() -> int:
    """Half the CPUs this process may run on, at least 1. A read is CPU work in two places at once (its
    Postgres backend and the serving process, which holds the interpreter lock while it decodes and
    renders); with more reads at once than half the cores, the threads that hold the lock are preempted
    and the event loop (``/healthz``, the edge) waits behind them: on 2 cores, ten worst-case readers gave
    a /healthz p99 of 117-151 ms with 2 reads at once and 27 ms with 1 (bench/reads.py)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, cpus // 2)


class Settings(BaseSettings):
    """Settings of `fleetscope serve`; every field reads FLEETSCOPE_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="FLEETSCOPE_", extra="ignore")

    database_url: str | None = Field(default=None, description="Postgres URL; embedded Postgres if unset")
    data_dir: Path = Field(default_factory=default_data_dir, description="embedded Postgres + state")
    host: str = "127.0.0.1"
    port: int = 8000
    insecure_no_auth: bool = Field(default=False, description="accept ingest without a token (loud)")
    read_auth: bool = Field(default=False, description="the read API, dashboard, /metrics and /docs need a read token")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Host header names accepted besides loopback "
                                     "and the bind address ('*': any)")
    allow_public_unauthenticated: bool = Field(default=False, description="serve reads on a non-loopback address "
                                               "without --read-auth")
    auth_fail_limit: int = Field(default=20, ge=1, le=100_000, description=(
        "failed authentications per window, counted per credential (a token, case-insensitively), per client "
        "address without a token, and per client address by distinct bad tokens; over a limit, 429 without a "
        "database lookup — a token that may be valid is still looked up, so a valid token is never locked out"))
    auth_fail_window_s: float = Field(default=60.0, gt=0, description="the window of auth_fail_limit")
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "addresses or networks of proxies whose X-Forwarded-For names the client (comma-separated; '*': any "
        "peer). Empty (default): X-Forwarded-For is ignored, the TCP peer is the client"))
    max_trace_body_bytes: int = Field(default=8 * 1024 * 1024, description="trace-summary upload limit (413)")
    migrate: bool = True
    max_body_bytes: int = Field(default=32 * 1024 * 1024, description="ingest body limit, as sent (413)")
    max_decoded_bytes: int = Field(default=256 * 1024 * 1024, description="ingest body limit decompressed")
    max_batch_records: int = Field(default=1_000_000, description="records in one batch (413)")
    ingest_concurrency: int = Field(default=4, description="batches written to Postgres at once")
    ingest_queue: int = Field(default=32, description="batches waiting for a writer before 503")
    backlog_max_rows: int = Field(default=5_000_000, description="uncompacted rows before 429")
    compact_interval_s: float = Field(default=1.0, description="how often raw rows are compacted")
    compact_grace_s: float = Field(default=10.0, description="wait this long for a step's missing ranks")
    compaction_workers: int = Field(default=0, ge=0, le=64, description=(
        "compaction processes; 0: a thread of the server process compacts. With N > 0 the server only "
        "serves and N worker processes compact in parallel (partitioned by run)"))
    retention_blocks_days: float | None = Field(default=None, ge=0, le=MAX_RETENTION_DAYS, allow_inf_nan=False,
                                                description=("drop a finished run's per-rank blocks this many days "
                                                             "after it last changed (None: keep)"))
    retention_rollups_days: float | None = Field(default=None, ge=0, le=MAX_RETENTION_DAYS, allow_inf_nan=False,
                                                 description="drop its per-step rows too")
    retention_runs_days: float | None = Field(default=None, ge=0, le=MAX_RETENTION_DAYS, allow_inf_nan=False,
                                              description="delete the run")
    retention_overrides: dict[str, dict[str, float | None]] | None = Field(default=None, description=(
        'per family: {"family": {"blocks_days": 7, "rollups_days": 90, "runs_days": null}} (JSON)'))
    retention_interval_s: float = Field(default=3600.0, gt=0, description="how often retention is applied")
    retention_batch_runs: int = Field(default=20, ge=1, description="runs thinned or deleted per pass at most")
    pool_size: int = Field(default=8, ge=1, le=256, description="database connections for ingest, compaction and "
                           "the background passes (reads have their own pool: read_pool_size)")
    read_pool_size: int = Field(default=8, ge=1, le=256, description=(
        "database connections for the read API and the dashboard, apart from ingest's, so reads never starve it"))
    read_concurrency: int = Field(default_factory=default_read_concurrency, ge=1, le=256, description=(
        "API reads served at once (default: half the CPUs this process may use, at least 1); more wait up to "
        "read_timeout_s for a turn, then get a 503 (keeps a burst of expensive reads from taking every core from "
        "ingest and /healthz)"))
    read_timeout_s: float = Field(default=5.0, gt=0, le=3600, allow_inf_nan=False, description=(
        "every statement of a read (API, dashboard) is cancelled by Postgres after this long; the client gets a "
        "503 naming the budget. A client that goes away cancels its read at once"))
    public_url: str | None = Field(default=None, description="dashboard base URL used in deep links")
    slack_webhook_url: str | None = Field(default=None, repr=False)
    alert_webhook_url: str | None = Field(default=None, repr=False, description="generic JSON webhook for alerts")
    alertmanager_url: str | None = Field(default=None, repr=False, description=(
        "Alertmanager base URL (http://alertmanager:9093): alerts are POSTed to its /api/v2/alerts, "
        "with endsAt when they resolve"))
    metrics_max_runs: int = Field(default=200, ge=0, le=10_000, description=(
        "per-run gauges on /metrics for at most this many running/stalled/hung runs, the most recently "
        "active first (0: none)"))
    cluster_metrics: bool = Field(default=True, description=(
        "export the cluster-wide gauges (fleetscope_cluster_*, fleetscope_run_*) on /metrics; turn off on "
        "all instances but one, or aggregate them with max()"))
    alerts_enabled: bool = Field(default=True, description="run regression detection after compaction passes")
    alert_interval_s: float = Field(default=5.0, description="at most one detection pass this often")
    alert_step_check_interval_s: float = Field(default=60.0, description="within-run detection per running run")
    # run health (docs/metrics.md "Run states"): stalled / hung / failed, and their alerts
    health_enabled: bool = Field(default=True, description="run the health pass (run states, hang/failure alerts)")
    health_interval_s: float = Field(default=5.0, gt=0, le=60, description="how often the health pass runs")
    stall_min_s: float = Field(default=60.0, gt=0, description="a run is stalled after at least this long without a step")
    stall_factor: float = Field(default=10.0, gt=0, description="... or this many times its p99 step time, if longer")
    stall_first_s: float = Field(default=600.0, gt=0, description="before its first step: stalled after this long")
    stall_silence_s: float = Field(default=30.0, gt=0, description="a rank whose last position is older is silent")
    pause_max_s: float = Field(default=1800.0, gt=0,
                               description="a declared pause holds off the stall detector at most max(2 × expected, this)")
    # failed-auth limiter (server/edge.py, docs/security.md)
    auth_known_tokens_refresh_s: float = Field(default=2.0, gt=0, le=3600, allow_inf_nan=False, description=(
        "while an address or a credential is over auth_fail_limit, a token is looked up only if its prefix is "
        "that of a token not revoked; the list of prefixes is re-read at most this often (a token created "
        "since is known within this time)"))

    # device telemetry from outside the job (server/dcgm.py, docs/operations.md "GPU telemetry from dcgm-exporter")
    dcgm_targets: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "dcgm-exporter scrape URLs, one per node: NODE=URL, comma-separated, or @FILE with one per line (NODE: "
        "the node name the job's ranks report). Joined to the ranks on that node of running runs without agent "
        "telemetry"))
    dcgm_prometheus_url: str | None = Field(default=None, description=(
        "Prometheus base URL holding dcgm-exporter's series (http://prometheus:9090): read with one instant "
        "query per pass instead of (or besides) dcgm_targets"))
    dcgm_node_label: str = Field(default="Hostname", max_length=128, description=(
        "the label naming the node in dcgm-exporter's series (Hostname; kubernetes_node or node under Kubernetes)"))
    dcgm_interval_s: float = Field(default=30.0, ge=1.0, le=3600, description="how often dcgm-exporter is read")
    dcgm_timeout_s: float = Field(default=5.0, gt=0, le=60, description="the time one scrape / query may take")

    @field_validator("retention_overrides", mode="before")
    @classmethod
    def _overrides(cls, v: Any) -> Any:
        return parse_overrides(v)

    @field_validator("allowed_hosts", "forwarded_allow_ips", "dcgm_targets", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        """FLEETSCOPE_ALLOWED_HOSTS=a.example.com,b.example.com"""
        if isinstance(v, str):
            return [h.strip() for h in v.split(",") if h.strip()]
        return v

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _ip_networks(cls, v: list[str]) -> list[str]:
        """Each entry an IP address or network (10.0.0.0/8, ::1), or '*'."""
        import ipaddress

        for a in v:
            if a == "*":
                continue
            try:
                ipaddress.ip_network(a, strict=False)
            except ValueError:
                raise ValueError(f"forwarded_allow_ips: {a[:80]!r} is not an IP address or network "
                                 "(give addresses or CIDR networks, comma-separated, or '*')") from None
        return v

    @field_validator("dcgm_targets")
    @classmethod
    def _dcgm_targets(cls, v: list[str]) -> list[str]:
        """Each entry NODE=URL or @FILE (checked when the reader starts: the file may change)."""
        for a in v:
            node, sep, url = a.partition("=")
            if not a.startswith("@") and (not sep or not node.strip() or not url.strip().startswith(("http://", "https://"))):
                raise ValueError(f"dcgm_targets: {a[:80]!r} is not NODE=URL (e.g. node0001=http://node0001:9400/metrics) "
                                 "or @FILE")
        return v


def parse_overrides(v: Any) -> dict[str, dict[str, float]] | None:
    """``{"family": {"blocks_days": 7, ...}}`` from JSON text or a dict; a clear error otherwise."""
    if v is None or v == "":
        return None
    if isinstance(v, str):
        import json

        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"retention_overrides must be JSON: {e}") from None
    if not isinstance(v, dict):
        raise ValueError("retention_overrides must be an object {family: {blocks_days, rollups_days, runs_days}}")
    keys = {"blocks_days", "rollups_days", "runs_days"}
    for fam, pol in v.items():
        if not isinstance(pol, dict) or not set(pol) <= keys:
            raise ValueError(f"retention_overrides[{fam!r}] must be an object with some of {sorted(keys)}")
        for k, x in pol.items():
            if x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool)
                                  or not 0 <= x <= MAX_RETENTION_DAYS):
                raise ValueError(f"retention_overrides[{fam!r}].{k} must be a number of days from 0 to "
                                 f"{MAX_RETENTION_DAYS:,.0f}, or null")
    return v
