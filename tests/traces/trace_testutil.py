"""Helpers of the trace tests: where the shared Kineto traces are, cached reductions, HTA's figures."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINETO = Path(os.environ.get("FLEETSCOPE_KINETO_DIR", ROOT / "tests" / "data" / "kineto"))
EXPECTED = json.loads((Path(__file__).with_name("hta_expected.json")).read_text())
SETS = ("hta_sampled_2rank", "hta_nccl_2rank_r0_a100", "hta_a100_vs_v100_pair")
MODES = ("default", "last")

def needs_data(fn):  # type: ignore[no-untyped-def]
    """The shared traces are part of the repository (tests/data/kineto): their absence is a failure."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert KINETO.is_dir(), f"Kineto traces not found at {KINETO} (FLEETSCOPE_KINETO_DIR)"
        return fn(*args, **kwargs)

    return wrapper


@functools.cache
def _parsed(trace_set: str) -> Any:
    from fleetscope.traces import TraceSet

    return TraceSet(KINETO / trace_set)


@functools.cache
def reduced(trace_set: str, mode: str) -> dict[str, Any]:
    """fleetscope's reduction of one shared set (each set is parsed once per session, analysed per mode)."""
    return _parsed(trace_set).reduce(include_last_step=mode == "last", num_kernels=5)


def expected_rows(table: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(set, mode, row) for every row of one of HTA's tables, for parametrisation."""
    out = []
    for key, tables in sorted(EXPECTED["sets"].items()):
        trace_set, mode = key.split("/")
        for row in tables.get(table, []):
            out.append((trace_set, mode, row))
    return out


def row_id(p: tuple[str, str, dict[str, Any]]) -> str:
    trace_set, mode, row = p
    parts = [trace_set.removeprefix("hta_"), mode]
    for k in ("rank", "stream", "idle_category", "kernel_type", "name70"):
        if k in row:
            parts.append(f"{k}={str(row[k])[:24]}")
    return "-".join(parts)


def write_trace(
    path: Path, events: list[dict[str, Any]], *, meta: dict[str, Any] | None = None, gz: bool = False
) -> Path:
    """A Kineto-shaped trace file (distributedInfo before traceEvents, as Kineto writes it)."""
    import gzip

    doc = {"schemaVersion": 1, **(meta or {}), "traceEvents": events}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def kernel(name: str, ts: float, dur: float, stream: int, corr: int, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr, "device": 0}}  # fmt: skip


def launch(ts: float, corr: int, dur: float = 2) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}  # fmt: skip


def cpu(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}
