"""Agent configuration: one frozen keyword-only dataclass, validated at construction, filled from env vars.

Every setting's default is written once, in its field below, and read from the object by everyone
else (no ``getattr(config, name, default)``). ``AgentConfig.from_env`` reads the FLEETSCOPE_*
variables named in the fields' metadata. A variable whose value is unusable (``FLEETSCOPE_TRACE_EVERY=often``,
``FLEETSCOPE_OFFLINE=maybe``, a server URL that is not http(s)) is reported once per process (a log
warning) and ignored, so its field keeps the default: a typo in a job's environment must not kill the
job. A bad keyword argument, by contrast, is the caller's bug and raises ``ValueError`` at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .urls import split_server_url

__all__ = ["AgentConfig", "ENV_VARS"]

log = logging.getLogger(__name__)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_warned: set[str] = set()  # env var values already reported (once per process)


def _env(var: str) -> dict[str, str]:
    return {"env": var}


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Settings of the in-job agent. Every field has a default; some also an env var (``from_env``)."""

    server: str | None = field(default=None, metadata=_env("FLEETSCOPE_SERVER"))
    """Base URL of the fleetscope server, http(s)://host[:port][/prefix]; None: spool only."""
    token: str | None = field(default=None, repr=False, metadata=_env("FLEETSCOPE_TOKEN"))
    """Bearer token for ingest. Never logged."""
    spool_dir: str | None = field(default=None, metadata=_env("FLEETSCOPE_SPOOL_DIR"))
    """Directory of the disk spool; None: $XDG_CACHE_HOME/fleetscope/spool (~/.cache/...)."""
    offline: bool = field(default=False, metadata=_env("FLEETSCOPE_OFFLINE"))
    """Write only the spool, for `fleetscope upload` later."""
    disabled: bool = field(default=False, metadata=_env("FLEETSCOPE_DISABLED"))
    """Every agent call becomes a near-free no-op (init returns a NoopRun)."""
    queue_max_records: int = 100_000
    """Bound of the in-memory queue; beyond it records are dropped and counted (queue_full)."""
    batch_max_records: int = 5_000
    """Flush a batch once it holds this many records (>= 1, <= queue_max_records)."""
    flush_interval_s: float = 2.0
    """Flush at least this often (jittered ±10 %)."""
    request_timeout_s: float = 10.0
    """Timeout of one HTTP request."""
    retry_deadline_s: float = 30.0
    """Give up retrying a batch after this long and spool it."""
    backoff_initial_s: float = 0.2
    """First retry delay; it doubles per attempt ("equal jitter") up to backoff_max_s."""
    backoff_max_s: float = 10.0
    """Cap of the retry delay and of the interval between probes of a server marked down."""
    spool_max_bytes: int = 512 * 1024 * 1024
    """Cap of the disk spool; beyond it the oldest frames are dropped and counted (spool_full)."""
    spool_segment_max_bytes: int = 8 * 1024 * 1024
    """Seal (fsync + rename) a spool segment once it holds this many bytes; also the replay read size."""
    exit_timeout_s: float = 5.0
    """Budget of the flush at exit/finish; what is left is spooled, never waited on."""
    collective_aggregate_threshold: int = 64
    """Above this many collective calls in one step, aggregate per (op, group, size bucket)."""
    collectives: bool = True
    """Record torch.distributed collectives (wraps its functions once init ran)."""
    trace_every_steps: int = field(default=0, metadata=_env("FLEETSCOPE_TRACE_EVERY"))
    """Sampled tracing: every K steps profile trace_active_steps steps with torch.profiler (0 = off)."""
    trace_active_steps: int = 2
    """Steps profiled per sampled window (>= 1; at most trace_every_steps are)."""
    measure_flops: bool = True
    """Without given/estimated FLOPs, count them once with FlopCounterMode over the first step."""
    memory_every_steps: int = 1
    """Sample memory every N steps (0 = never)."""
    clock: str = "auto"
    """Step timing: "cuda" (events, resolved lazily), "cpu" (monotonic), "auto" (CUDA once initialised)."""
    max_pending_steps: int = 256
    """GPU: steps whose events are not yet complete, kept at most; older ones are dropped and counted."""
    heartbeat_s: float = field(default=5.0, metadata=_env("FLEETSCOPE_HEARTBEAT_S"))
    """While a step is open longer than usual, one ``position`` event per this many seconds (0 = off)."""
    stack_after_s: float = field(default=30.0, metadata=_env("FLEETSCOPE_STACK_AFTER_S"))
    """Positions carry the training thread's Python stack once the step has been open this long."""
    device_sample_s: float = field(default=1.0, metadata=_env("FLEETSCOPE_DEVICE_SAMPLE_S"))
    """Device telemetry (NVML, on the sender thread): sample the rank's GPU at most this often (0 = off)."""
    device_window_s: float = field(default=30.0, metadata=_env("FLEETSCOPE_DEVICE_WINDOW_S"))
    """Device telemetry: one aggregated ``device`` event per this many seconds (min/mean/max, reasons)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            err = _field_error(f.name, getattr(self, f.name))
            if err is not None:
                raise ValueError(f"AgentConfig.{f.name} {err}")
        if self.queue_max_records < self.batch_max_records:
            raise ValueError("AgentConfig.queue_max_records must be >= batch_max_records")
        if self.server is not None:
            object.__setattr__(self, "server", self.server.rstrip("/"))

    @classmethod
    def from_env(cls, **overrides: Any) -> AgentConfig:
        """Build from FLEETSCOPE_* env vars; explicit keyword arguments (not None) win. An unusable
        variable is reported once and ignored (its field keeps the default)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata.get("env")
            raw = os.environ.get(var) if var else None
            if var is None or not raw or overrides.get(f.name) is not None:
                continue
            parse = _PARSERS.get(f.type if isinstance(f.type, str) else "", str)
            try:
                value = parse(raw)
            except ValueError as e:
                err: str | None = str(e)
            else:
                err = _field_error(f.name, value)
            if err is None:
                values[f.name] = value
            else:
                _warn_once(var, raw, err, f.default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


ENV_VARS: dict[str, str] = {f.metadata["env"]: f.name for f in fields(AgentConfig) if "env" in f.metadata}
"""FLEETSCOPE_* variable -> the AgentConfig field it sets."""


def _parse_bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("must be one of 1/true/yes/on or 0/false/no/off")


def _parse_float(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise ValueError("must be a number") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return v


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("must be an integer") from None


# field annotation (a string: ``from __future__ import annotations``) -> parser of its env var
_PARSERS: dict[str, Callable[[str], Any]] = {"bool": _parse_bool, "int": _parse_int, "float": _parse_float}


def _field_error(name: str, v: object) -> str | None:
    """What is wrong with value ``v`` of field ``name`` (None if nothing); cross-field rules aside."""
    kind = _KINDS.get(name)
    if kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
        return f"must be an integer, got {v!r}"
    if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
        return f"must be a number, got {v!r}"
    if kind in ("int", "float") and v < 0:  # type: ignore[operator]
        return f"must be >= 0, got {v!r}"
    if name in ("server", "token") and v is not None and not isinstance(v, str):
        return f"must be a string, got {type(v).__name__}"
    if name in ("batch_max_records", "trace_active_steps") and isinstance(v, int) and v < 1:
        return f"must be >= 1, got {v!r}"
    if name == "clock" and v not in ("auto", "cpu", "cuda"):
        return f"must be 'auto', 'cpu' or 'cuda', got {v!r}"
    if name == "server" and isinstance(v, str):
        try:
            split_server_url(v)
        except ValueError as e:
            return str(e)
    if name == "token" and isinstance(v, str) and any(c in v for c in "\r\n\0"):
        return "must not contain line breaks or NUL (it travels in an HTTP header)"
    return None


_KINDS: dict[str, str] = {f.name: str(f.type) for f in fields(AgentConfig)}


def _warn_once(var: str, raw: str, err: str, default: object) -> None:
    key = f"{var}={raw!r}"
    if key in _warned:
        return
    _warned.add(key)
    shown = "<redacted>" if var == "FLEETSCOPE_TOKEN" else repr(raw)
    fallback = "no token" if var == "FLEETSCOPE_TOKEN" else repr(None if default is MISSING else default)
    log.warning("fleetscope: ignoring %s=%s (%s); using the default, %s", var, shown, err, fallback)
