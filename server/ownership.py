"""Who may write a run: the run's owner namespace (``runs.owner_key``, migration 0013), cached.

A run is written (batches, traces, finish) only by a principal of its namespace — the token that
registered it, or a token of the same team — by an admin, or, for a run without owner (``''``:
registered with auth disabled or before owners existed), by any ingest token. A run's owner never
changes and run ids are never reused, so the owner of a run id is cached per database (bounded, least
recently used first out); a deleted run is forgotten (:meth:`RunOwners.forget`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from sqlalchemy import Engine

from .auth import Principal
from .store import runs as run_store

__all__ = ["RunOwners", "owners_for", "forbidden_detail"]

#: run ids whose owner a server keeps in memory (a few MB at most)
MAX_CACHED_RUNS = 65_536

_BY_ENGINE: weakref.WeakKeyDictionary[Engine, RunOwners] = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


class RunOwners:
    """run id → owner key of one database, bounded."""

    def __init__(self, engine: Engine, max_entries: int = MAX_CACHED_RUNS) -> None:
        self._engine = weakref.ref(engine)  # weak: the per-engine registry must not keep the engine alive
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def owner_key(self, run_id: int) -> str | None:
        """The run's owner key; None when there is no such run (not cached: it may be created later)."""
        with self._lock:
            key = self._owner.get(run_id)
            if key is not None:
                self._owner.move_to_end(run_id)
                return key
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine of this owner cache is gone")
        exists, key = run_store.owner_key_of(engine, run_id)
        if not exists:
            return None
        with self._lock:
            self._owner[run_id] = key
            while len(self._owner) > self.max_entries:
                self._owner.popitem(last=False)
        return key

    def may_write(self, who: Principal, run_id: int) -> bool:
        """Whether ``who`` may write run ``run_id``; True for an unknown run (the caller answers 404/422)."""
        if who.allows("admin"):
            return True
        key = self.owner_key(run_id)
        return key is None or who.may_write(key)

    def forget(self, run_id: int) -> None:
        with self._lock:
            self._owner.pop(run_id, None)

    def __len__(self) -> int:
        return len(self._owner)


def owners_for(engine: Engine) -> RunOwners:
    """The owner cache of the database behind ``engine`` (one per engine, gone with it)."""
    with _BY_ENGINE_LOCK:
        owners = _BY_ENGINE.get(engine)
        if owners is None:
            owners = _BY_ENGINE[engine] = RunOwners(engine)
        return owners


def forbidden_detail(who: Principal, run_id: int) -> str:
    """Why ``who`` may not write run ``run_id`` (a 403's detail)."""
    return (f"run {run_id} belongs to another owner: token {who.name!r} writes only runs registered by itself or "
            "by a token of its team (or an admin token); register the run with this token to get its own")
