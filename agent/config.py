"""Agent configuration: one keyword-only dataclass, validated at construction, filled from env vars."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["AgentConfig"]


def _env_bool(name: str) -> bool | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    return v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(kw_only=True)
class AgentConfig:
    """Settings of the in-job agent. Every field has an env var or a safe default."""

    server: str | None = None
    """Base URL of the fleetscope server (FLEETSCOPE_SERVER), e.g. http://127.0.0.1:8000."""
    token: str | None = field(default=None, repr=False)
    """Bearer token for ingest (FLEETSCOPE_TOKEN). Never logged."""
    spool_dir: str | None = None
    """Directory of the disk spool (FLEETSCOPE_SPOOL_DIR); default: a per-user cache dir."""
    offline: bool = False
    """Write only the spool, for `fleetscope upload` later (FLEETSCOPE_OFFLINE=1)."""
    disabled: bool = False
    """Every agent call becomes a near-free no-op (FLEETSCOPE_DISABLED=1)."""
    queue_max_records: int = 100_000
    """Bound of the in-memory queue; beyond it records are dropped and counted."""
    batch_max_records: int = 5_000
    """Flush a batch once it holds this many records."""
    flush_interval_s: float = 2.0
    """Flush at least this often (jittered ±10 %)."""
    request_timeout_s: float = 10.0
    """Timeout of one HTTP request."""
    retry_deadline_s: float = 30.0
    """Give up retrying a batch after this long and spool it."""
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    spool_max_bytes: int = 512 * 1024 * 1024
    """Cap of the disk spool; beyond it the oldest frames are dropped and counted."""
    spool_segment_max_bytes: int = 8 * 1024 * 1024
    """Seal (fsync + rename) a spool segment once it holds this many bytes; also the replay read size."""
    exit_timeout_s: float = 5.0
    """Budget of the flush at exit/finish; what is left is spooled, never waited on."""
    collective_aggregate_threshold: int = 64
    """Above this many collective calls in one step, aggregate per (op, group, size bucket)."""
    collectives: bool = True
    """Record torch.distributed collectives (wraps its functions once init ran)."""
    trace_every_steps: int = 0
    """Sampled tracing (FLEETSCOPE_TRACE_EVERY): every K steps profile a few steps with torch.profiler and
    send the reduced trace (agent/tracing.py). 0 = off."""
    trace_active_steps: int = 2
    """Steps profiled per sampled window."""
    measure_flops: bool = True
    """Without given/estimated FLOPs, count them once with FlopCounterMode over the first step."""
    memory_every_steps: int = 1
    """Sample memory every N steps (0 = never)."""
    clock: str = "auto"
    """Step timing: "cuda" (events, resolved lazily), "cpu" (monotonic), "auto" (CUDA once initialised)."""
    max_pending_steps: int = 256
    """GPU: steps whose events are not yet complete, kept at most; older ones are dropped and counted."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"AgentConfig.{f.name} must be >= 0, got {v!r}")
        if self.batch_max_records < 1:
            raise ValueError(f"AgentConfig.batch_max_records must be >= 1, got {self.batch_max_records}")
        if self.queue_max_records < self.batch_max_records:
            raise ValueError("AgentConfig.queue_max_records must be >= batch_max_records")
        if self.clock not in ("auto", "cpu", "cuda"):
            raise ValueError(f"AgentConfig.clock must be 'auto', 'cpu' or 'cuda', got {self.clock!r}")
        if self.server is not None:
            self.server = self.server.rstrip("/")

    @classmethod
    def from_env(cls, **overrides: Any) -> AgentConfig:
        """Build from FLEETSCOPE_* env vars; explicit keyword arguments win."""
        env: dict[str, Any] = {}
        if os.environ.get("FLEETSCOPE_SERVER"):
            env["server"] = os.environ["FLEETSCOPE_SERVER"]
        if os.environ.get("FLEETSCOPE_TOKEN"):
            env["token"] = os.environ["FLEETSCOPE_TOKEN"]
        if os.environ.get("FLEETSCOPE_SPOOL_DIR"):
            env["spool_dir"] = os.environ["FLEETSCOPE_SPOOL_DIR"]
        if os.environ.get("FLEETSCOPE_TRACE_EVERY"):
            try:
                env["trace_every_steps"] = int(os.environ["FLEETSCOPE_TRACE_EVERY"])
            except ValueError:
                raise ValueError(
                    f"FLEETSCOPE_TRACE_EVERY must be an integer, got {os.environ['FLEETSCOPE_TRACE_EVERY']!r}"
                ) from None
        for name, key in (("FLEETSCOPE_OFFLINE", "offline"), ("FLEETSCOPE_DISABLED", "disabled")):
            b = _env_bool(name)
            if b is not None:
                env[key] = b
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)
