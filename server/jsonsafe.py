"""Checks for free-form values clients send (run config and meta, event data, benchmark params, names):
bounded nesting and size, valid Unicode, no NUL, numbers that fit — so that what is accepted can be
stored by Postgres and read back by every page. Pure functions; callers turn ``UnsafeValue`` into
their own 4xx naming the field."""

from __future__ import annotations

import math
from typing import Any, TypeVar

_T = TypeVar("_T")

__all__ = ["UnsafeValue", "check_json", "check_text", "valid_text", "valid_json", "MAX_DEPTH", "MAX_ITEMS", "MAX_INT"]

MAX_DEPTH = 16
MAX_ITEMS = 10_000
MAX_INT = 2**63 - 1
MAX_FLOAT = 1e300


class UnsafeValue(ValueError):
    """A value that cannot be accepted; ``where`` names it (``config.optimizer.lr``), ``message`` says why."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


def check_text(s: Any, where: str, *, max_len: int = 256, allow_empty: bool = False) -> str:
    """A string of valid Unicode (no lone surrogates), without NUL, of at most ``max_len`` characters."""
    if not isinstance(s, str):
        raise UnsafeValue(where, f"must be a string, got {type(s).__name__}")
    if not s and not allow_empty:
        raise UnsafeValue(where, "must not be empty")
    if len(s) > max_len:
        raise UnsafeValue(where, f"must be at most {max_len} characters (got {len(s)})")
    if "\x00" in s:
        raise UnsafeValue(where, "must not contain NUL characters")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeValue(where, "must be valid Unicode (a lone surrogate was sent)") from None
    return s


def check_json(v: Any, where: str, *, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> None:
    """A JSON value of at most ``max_depth`` levels and ``max_items`` values, with string keys, valid
    strings, integers within int64 and finite floats within ±1e300."""
    budget = [max_items]

    def walk(x: Any, path: str, depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise UnsafeValue(where, f"has more than {max_items} values")
        if depth > max_depth:
            raise UnsafeValue(path, f"is nested too deeply (more than {max_depth} levels)")
        if isinstance(x, dict):
            for k, y in x.items():
                if not isinstance(k, str):
                    raise UnsafeValue(path, f"keys must be strings, got {type(k).__name__}")
                check_text(k, f"{path} (a key)", max_len=256)
                walk(y, f"{path}.{k}", depth + 1)
        elif isinstance(x, list):
            for i, y in enumerate(x):
                walk(y, f"{path}[{i}]", depth + 1)
        elif isinstance(x, str):
            check_text(x, path, max_len=65_536, allow_empty=True)
        elif isinstance(x, bool) or x is None:
            pass
        elif isinstance(x, int):
            if not -MAX_INT <= x <= MAX_INT:
                raise UnsafeValue(path, "is an integer out of range (beyond 64 bits)")
        elif isinstance(x, float):
            if not math.isfinite(x) or abs(x) > MAX_FLOAT:
                raise UnsafeValue(path, "must be a finite number")
        else:
            raise UnsafeValue(path, f"must be JSON, got {type(x).__name__}")

    walk(v, where, 0)


def valid_text(v: str | None, *, max_len: int = 256) -> str | None:
    """``check_text`` for a pydantic validator: None passes, a bad string raises ValueError (a 422)."""
    if v is not None:
        try:
            check_text(v, "value", max_len=max_len)
        except UnsafeValue as e:
            raise ValueError(e.message) from None
    return v


def valid_json(v: _T, *, max_depth: int = MAX_DEPTH) -> _T:
    """``check_json`` for a pydantic validator: raises ValueError naming the path inside the value."""
    try:
        check_json(v, "value", max_depth=max_depth)
    except UnsafeValue as e:
        raise ValueError(f"{e.where.replace('value', '', 1).lstrip('.') or 'it'}: {e.message}") from None
    return v
