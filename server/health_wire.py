"""Checks of the run-health event kinds at ingest: ``position``, ``failure`` and ``pause`` (issue 21).

Each check takes an event's ``data`` (already JSON-safe and within MAX_EVENT_VALUES) and its location,
refuses wrong types and numbers out of range with the batch error (422 naming the field), cuts
over-long strings in place and returns True when it cut something (counted as folded). Frames and
stacks hold at most MAX_STACK_FRAMES frames of ``{"file": str, "line": int, "func": str}``.

``validate.py`` registers them in its per-kind checks; ``store/health.py`` stores what passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .limits import MAX_FAILURE_MESSAGE_CHARS, MAX_STACK_FRAMES

__all__ = ["kind_checks", "POSITION_STATES", "FAILURE_SOURCES", "PAUSE_STATES", "HEALTH_KINDS"]

POSITION_STATES = ("in_step", "between_steps")
FAILURE_SOURCES = ("exception", "signal", "exit", "launcher")
PAUSE_STATES = ("begin", "end")
HEALTH_KINDS = ("position", "failure", "pause")
_MAX_SECONDS = 1e9  # ~31 years: a longer duration is garbage
_MAX_INT64 = 2**63 - 1
_MAX_INT32 = 2**31 - 1
_MAX_RANK = 262_143  # runs.MAX_WORLD_SIZE - 1

Check = Callable[[dict[str, Any], str], bool]


def kind_checks(error: Callable[..., Exception]) -> dict[str, Check]:
    """{kind: check} raising ``error(where, message, got=value)`` (validate.BatchError)."""

    def fail(where: str, message: str, got: Any = None) -> Exception:
        return error(where, message, got=got)

    def string(d: dict[str, Any], key: str, where: str, max_len: int, *, required: bool = False,
             choices: tuple[str, ...] = ()) -> bool:
        v = d.get(key)
        if v is None:
            if required:
                raise fail(f"{where}.{key}", "is required")
            return False
        if not isinstance(v, str) or (required and not v):
            raise fail(f"{where}.{key}", "must be a string" + (" (not empty)" if required else ""), got=v)
        if choices and v not in choices:
            raise fail(f"{where}.{key}", f"must be one of {', '.join(choices)}", got=v)
        if len(v) > max_len:
            d[key] = v[: max_len - 1] + "…"
            return True
        return False

    def seconds(d: dict[str, Any], key: str, where: str) -> None:
        v = d.get(key)
        if v is None:
            return
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= _MAX_SECONDS:
            raise fail(f"{where}.{key}", f"must be a number of seconds in 0..{_MAX_SECONDS:.0e}", got=v)

    def integer(d: dict[str, Any], key: str, where: str, lo: int, hi: int) -> None:
        v = d.get(key)
        if v is not None and (type(v) is not int or not lo <= v <= hi):
            raise fail(f"{where}.{key}", f"must be an integer in {lo}..{hi}", got=v)

    def frames(d: dict[str, Any], key: str, where: str) -> bool:
        fs = d.get(key)
        if fs is None:
            return False
        if not isinstance(fs, list):
            raise fail(f"{where}.{key}", "must be a list of frames {file, line, func}", got=fs)
        if len(fs) > MAX_STACK_FRAMES:
            raise fail(f"{where}.{key}", f"has {len(fs)} frames; at most {MAX_STACK_FRAMES} (MAX_STACK_FRAMES), "
                       "innermost last")
        cut = False
        for i, f in enumerate(fs):
            w = f"{where}.{key}[{i}]"
            if not isinstance(f, dict):
                raise fail(w, "must be an object {file, line, func}", got=f)
            extra = set(f) - {"file", "line", "func"}
            if extra:
                raise fail(w, f"unknown keys {sorted(extra)[:4]}; a frame has file, line, func")
            cut |= string(f, "file", w, 256)
            cut |= string(f, "func", w, 256)
            integer(f, "line", w, 0, _MAX_INT32)
        return cut

    def position(d: dict[str, Any], where: str) -> bool:
        string(d, "state", where, 16, required=True, choices=POSITION_STATES)
        cut = string(d, "phase", where, 64)
        seconds(d, "open_s", where)
        cut |= string(d, "source", where, 32)
        c = d.get("collective")
        if c is not None:
            w = f"{where}.collective"
            if not isinstance(c, dict):
                raise fail(w, "must be an object {op, dim, group, seq, bytes, since_s, done} or null", got=c)
            cut |= string(c, "op", w, 64, required=True)
            cut |= string(c, "dim", w, 64)
            cut |= string(c, "group", w, 128)
            integer(c, "seq", w, 0, _MAX_INT64)
            integer(c, "bytes", w, 0, _MAX_INT64)
            seconds(c, "since_s", w)
            done = c.get("done")
            if done is not None and type(done) is not bool:
                raise fail(f"{w}.done", "must be true or false", got=done)
        cut |= frames(d, "stack", where)
        return cut

    def failure(d: dict[str, Any], where: str) -> bool:
        string(d, "source", where, 16, required=True, choices=FAILURE_SOURCES)
        cut = string(d, "exception", where, 256)
        cut |= string(d, "message", where, MAX_FAILURE_MESSAGE_CHARS)
        cut |= frames(d, "frames", where)
        cut |= string(d, "phase", where, 64)
        cut |= string(d, "signal", where, 32)
        integer(d, "exit_code", where, -_MAX_INT32 - 1, _MAX_INT32)
        integer(d, "rank", where, 0, _MAX_RANK)
        return cut

    def pause(d: dict[str, Any], where: str) -> bool:
        cut = string(d, "reason", where, 64, required=True)
        string(d, "state", where, 8, required=True, choices=PAUSE_STATES)
        seconds(d, "expected_s", where)
        seconds(d, "duration_s", where)
        return cut

    return {"position": position, "failure": failure, "pause": pause}
