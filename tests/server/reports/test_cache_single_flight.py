"""The façade's per-run cache computes a value once when several callers ask for it at the same time (a
page's callbacks after a server start), and a failed computation leaves nothing behind."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fleetscope.server.reports import _cache


def test_concurrent_callers_of_one_key_share_one_computation() -> None:
    engine: Any = SimpleNamespace(url="postgresql://single-flight-test")
    run: Any = SimpleNamespace(id=7, version=(1, 2))
    calls: list[int] = []
    start = threading.Barrier(4)
    got: list[Any] = []

    def compute() -> dict[str, int]:
        calls.append(1)
        time.sleep(0.3)  # the others arrive while this runs
        return {"value": 42}

    def ask() -> None:
        start.wait()
        got.append(_cache.cached("single-flight", engine, run, compute))

    try:
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(calls) == 1 and got == [{"value": 42}] * 4
        assert _cache._flights == {}  # nothing kept once every caller is done
        # another key of the same run is computed on its own
        assert _cache.cached("other", engine, run, lambda: 1) == 1 and len(calls) == 1
    finally:
        _cache.forget_run(7)


def test_a_failed_computation_is_not_cached_and_the_next_caller_computes() -> None:
    engine: Any = SimpleNamespace(url="postgresql://single-flight-test")
    run: Any = SimpleNamespace(id=8, version=(1, 1))

    def boom() -> int:
        raise RuntimeError("no")

    try:
        with pytest.raises(RuntimeError):
            _cache.cached("flaky", engine, run, boom)
        assert _cache.cached("flaky", engine, run, lambda: 5) == 5
        assert _cache._flights == {}
    finally:
        _cache.forget_run(8)
