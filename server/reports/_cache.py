"""The façade's per-process cache: values computed for a run, reused until the run changes.

A run changes when compaction folds data into it or its status changes (``RunRow.version``); a
finished run's reports are computed once per process. Keys hold the engine (its object and URL),
so a new database never reuses an entry. Bounded LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from sqlalchemy import Engine

from ..store import runs as run_store
from ..store.rows import RunRow

__all__ = ["cached", "cached_by_id", "engine_key", "get", "put", "clear"]

T = TypeVar("T")
_MAX_ENTRIES = 4096
_lock = threading.Lock()
_entries: OrderedDict[tuple[Hashable, ...], tuple[Hashable, Any]] = OrderedDict()


def engine_key(engine: Engine) -> tuple[int, str]:
    """Cache key of a database: the engine object and its URL."""
    return id(engine), str(engine.url)


def get(key: tuple[Hashable, ...], version: Hashable) -> tuple[bool, Any]:
    with _lock:
        hit = _entries.get(key)
        if hit is not None and hit[0] == version:
            _entries.move_to_end(key)
            return True, hit[1]
    return False, None


def put(key: tuple[Hashable, ...], version: Hashable, value: Any) -> None:
    with _lock:
        _entries[key] = (version, value)
        _entries.move_to_end(key)
        while len(_entries) > _MAX_ENTRIES:
            _entries.popitem(last=False)


def cached(name: Hashable, engine: Engine, run: RunRow, fn: Callable[[], T]) -> T:
    """``fn()`` for ``run``, reused while ``run.version`` stays the same (no query)."""
    key = (engine_key(engine), run.id, name)
    hit, value = get(key, run.version)
    if hit:
        return value  # type: ignore[no-any-return]
    value = fn()
    put(key, run.version, value)
    return value


def cached_by_id(name: Hashable, engine: Engine, run_id: int, fn: Callable[[], T]) -> T:
    """``fn()`` for a run known by its id; the freshness check costs one primary-key read."""
    version = run_store.run_version(engine, run_id)
    key = (engine_key(engine), run_id, name)
    hit, value = get(key, version)
    if hit:
        return value  # type: ignore[no-any-return]
    value = fn()
    put(key, version, value)
    return value


def clear() -> None:
    """Forget every cached value (tests; benchmarks measuring the cold path)."""
    with _lock:
        _entries.clear()
