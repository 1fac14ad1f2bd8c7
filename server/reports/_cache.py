"""The façade's per-process cache: values computed for a run, reused until the run changes.

A run changes when compaction folds data into it or its status changes (``RunRow.version``); a
finished run's reports are computed once per process. Keys hold the engine (its object and URL),
so a new database never reuses an entry. Bounded LRU: at most ``_MAX_ENTRIES`` entries and about
``_MAX_BYTES`` of values (sizes estimated when stored: numpy buffers, strings and containers, large
containers from a sample); a value larger than a quarter of it is returned but not kept.
``forget_run`` drops a run's entries (a deleted run keeps no memory here). One computation per key at
a time: a caller asking for a value another thread is computing waits for it instead of computing it
again (a page's callbacks ask for the same report at once after a server start)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import Engine

from ..store import runs as run_store
from ..store.rows import RunRow

__all__ = ["cached", "cached_by_id", "engine_key", "get", "put", "clear", "forget_run", "approx_size", "cached_bytes"]

T = TypeVar("T")
_MAX_ENTRIES = 4096
_MAX_BYTES = 256 << 20
_lock = threading.Lock()
_entries: OrderedDict[tuple[Hashable, ...], tuple[Hashable, Any, int]] = OrderedDict()
_bytes = 0
_SAMPLE = 64  # items of a larger container that are walked; the rest is estimated from them


def approx_size(value: Any, max_nodes: int = 100_000) -> int:
    """Approximate bytes held by ``value``: numpy arrays by their buffers, strings and bytes by their
    length, containers and objects (``__dict__`` / ``__slots__``) by their items — of a container
    of more than ``_SAMPLE`` items, the first ones stand for the rest. Shared objects count once."""
    total = 0
    seen: set[int] = set()
    stack: list[tuple[Any, float]] = [(value, 1.0)]
    nodes = 0
    while stack and nodes < max_nodes:
        v, w = stack.pop()
        nodes += 1
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, np.ndarray):
            total += int(w * (v.nbytes + 112))
            if v.dtype == object:
                stack.extend((x, w * v.size / min(v.size, _SAMPLE)) for x in v.flat[:_SAMPLE])
        elif isinstance(v, (str, bytes, bytearray)):
            total += int(w * (len(v) + 49))
        elif isinstance(v, (int, float, bool)) or v is None:
            total += int(w * 28)
        elif isinstance(v, dict):
            n = len(v)
            total += int(w * (64 + 40 * n))
            k = w * n / min(n, _SAMPLE) if n else w
            for i, (a, b) in enumerate(v.items()):
                if i >= _SAMPLE:
                    break
                stack.append((a, k))
                stack.append((b, k))
        elif isinstance(v, (list, tuple, set, frozenset)):
            n = len(v)
            total += int(w * (56 + 8 * n))
            k = w * n / min(n, _SAMPLE) if n else w
            for i, x in enumerate(v):
                if i >= _SAMPLE:
                    break
                stack.append((x, k))
        elif hasattr(v, "__dict__"):
            total += int(w * 64)
            stack.append((vars(v), w))
        elif hasattr(v, "__slots__"):
            total += int(w * 64)
            stack.extend((getattr(v, a), w) for a in v.__slots__ if hasattr(v, a))
        else:
            total += int(w * 64)
    return total


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
    global _bytes
    size = approx_size(value)
    with _lock:
        old = _entries.pop(key, None)
        if old is not None:
            _bytes -= old[2]
        if size > _MAX_BYTES // 4:
            return  # too large to keep: computed again when asked again
        _entries[key] = (version, value, size)
        _bytes += size
        while len(_entries) > _MAX_ENTRIES or _bytes > _MAX_BYTES:
            _k, (_v, _x, n) = _entries.popitem(last=False)
            _bytes -= n


_flights_lock = threading.Lock()
_flights: dict[tuple[Hashable, ...], list[Any]] = {}  # key -> [RLock, callers holding or waiting for it]


def _compute(key: tuple[Hashable, ...], version: Hashable, fn: Callable[[], T]) -> T:
    """``fn()`` once per key at a time: concurrent callers of the same key wait for the first one's value."""
    with _flights_lock:
        flight = _flights.setdefault(key, [threading.RLock(), 0])
        flight[1] += 1
    try:
        with flight[0]:
            hit, value = get(key, version)  # computed by the caller this one waited for
            if hit:
                return value  # type: ignore[no-any-return]
            value = fn()
            put(key, version, value)
            return value
    finally:
        with _flights_lock:
            flight[1] -= 1
            if flight[1] == 0:
                _flights.pop(key, None)


def cached(name: Hashable, engine: Engine, run: RunRow, fn: Callable[[], T]) -> T:
    """``fn()`` for ``run``, reused while ``run.version`` stays the same (no query)."""
    key = (engine_key(engine), run.id, name)
    hit, value = get(key, run.version)
    if hit:
        return value  # type: ignore[no-any-return]
    return _compute(key, run.version, fn)


def cached_by_id(name: Hashable, engine: Engine, run_id: int, fn: Callable[[], T]) -> T:
    """``fn()`` for a run known by its id; the freshness check costs one primary-key read."""
    version = run_store.run_version(engine, run_id)
    key = (engine_key(engine), run_id, name)
    hit, value = get(key, version)
    if hit:
        return value  # type: ignore[no-any-return]
    return _compute(key, version, fn)


def clear() -> None:
    """Forget every cached value (tests; benchmarks measuring the cold path)."""
    global _bytes
    with _lock:
        _entries.clear()
        _bytes = 0


def forget_run(run_id: int) -> None:
    """Forget every value cached for the run (it was deleted)."""
    global _bytes
    with _lock:
        for key in [k for k in _entries if len(k) > 1 and k[1] == run_id]:
            _bytes -= _entries.pop(key)[2]


def cached_bytes() -> tuple[int, int]:
    """(entries, approximate bytes) held now."""
    with _lock:
        return len(_entries), _bytes
