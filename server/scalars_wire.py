"""The ``scalars`` event (``run.log``): ``{"rank", "seq", "kind": "scalars", "ts", "step", "data": {name:
number}}``, checked at ingest (``validate._KIND_CHECKS``) and stored by ``store/scalars.py`` in
``run_scalars``, not in ``run_events``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .jsonsafe import UnsafeValue, check_text
from .limits import MAX_SCALAR_NAME_CHARS, MAX_SCALAR_NAMES_PER_RUN

__all__ = ["SCALARS_KIND", "kind_checks", "check_scalars"]

SCALARS_KIND = "scalars"


def check_scalars(data: dict[str, Any], where: str, error: Callable[..., Exception]) -> bool:
    """A non-empty object of at most MAX_SCALAR_NAMES_PER_RUN names (1..MAX_SCALAR_NAME_CHARS characters)
    → finite numbers; raises ``error(where, message, got=...)`` naming the first bad name or value."""
    if not data:
        raise error(where, "a scalars event needs at least one {name: number}")
    if len(data) > MAX_SCALAR_NAMES_PER_RUN:
        raise error(where, f"has {len(data)} names; at most {MAX_SCALAR_NAMES_PER_RUN} (MAX_SCALAR_NAMES_PER_RUN)")
    for name, v in data.items():
        try:
            check_text(name, "name", max_len=MAX_SCALAR_NAME_CHARS)
        except UnsafeValue as err:
            raise error(where, f"scalar name {err.message} (MAX_SCALAR_NAME_CHARS {MAX_SCALAR_NAME_CHARS})",
                        got=str(name)[:64]) from None
        if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > 1e300:
            raise error(f"{where}.{name}", "must be a finite number", got=v)
    return False


def kind_checks(error: Callable[..., Exception]) -> dict[str, Callable[[dict[str, Any], str], bool]]:
    """{kind: check(data, where)} for ``validate._KIND_CHECKS``."""
    return {SCALARS_KIND: lambda data, where: check_scalars(data, where, error)}
