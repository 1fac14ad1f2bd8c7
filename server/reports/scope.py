"""Who sees which runs: the read side of team namespaces, enforced in the read façade.

A run lives in its owner's namespace (``runs.owner_key``: ``team:<team>`` for runs registered by a token
with a team, ``token:<id>`` without, ``''`` without a token). A reader whose token has a team sees its
team's runs and runs without an owner; an admin, a read token without a team and an anonymous reader
(a server without ``--read-auth``) see every run. Whoever serves a request says who reads with
:func:`viewing` (the API's ``ReadState`` dependency, the dashboard's ``_state.engine()``); every report
of the façade then answers for that reader only:

- lists (runs, the fleet, pickers, alerts, compare, scaling, regressions' baselines shown) leave the
  other namespaces' runs out, in SQL where the list is paged (``run_query``);
- a report of one run (``get_run``, ``run_summary``, any façade function whose second argument is
  ``run_id``) answers as if the run did not exist (None, or :class:`RunNotVisible`, a ``LookupError``).

Background passes (compaction, health, alerts) set no reader and see everything.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine

__all__ = ["viewing", "set_viewer", "visible_keys", "owner_keys_for", "is_visible", "visible_rows", "RunNotVisible",
           "check_visible"]

#: the namespaces the current reader sees; None: every run
_VIEW: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("fleetscope_view", default=None)

T = TypeVar("T")


class RunNotVisible(LookupError):
    """A run the current reader may not see (answered as "not found")."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id} not found")


def owner_keys_for(principal: Any) -> frozenset[str] | None:
    """The namespaces ``principal`` reads: None (all) for no principal, an admin or a token without a team;
    its team's and the unowned runs for a token with a team."""
    if principal is None or principal.allows("admin") or not getattr(principal, "team", None):
        return None
    return frozenset({principal.owner_key, ""})


def set_viewer(principal: Any) -> None:
    """The reader of the rest of this context (a request's task or the dashboard's worker thread)."""
    _VIEW.set(owner_keys_for(principal))


@contextmanager
def viewing(principal: Any) -> Iterator[None]:
    token = _VIEW.set(owner_keys_for(principal))
    try:
        yield
    finally:
        _VIEW.reset(token)


def visible_keys() -> frozenset[str] | None:
    """The namespaces the current reader sees; None: every run."""
    return _VIEW.get()


def is_visible(engine: Engine, run_id: int) -> bool:
    """Whether the current reader may see run ``run_id`` (True for a run that does not exist: the caller
    answers "not found" for it anyway)."""
    keys = _VIEW.get()
    if keys is None:
        return True
    from ..ownership import owners_for

    key = owners_for(engine).owner_key(int(run_id))
    return key is None or key in keys


def check_visible(engine: Engine, run_id: int) -> None:
    """Raise :class:`RunNotVisible` when the current reader may not see the run."""
    if not is_visible(engine, run_id):
        raise RunNotVisible(int(run_id))


def visible_rows(rows: Iterable[T], key: Any = lambda r: r.owner_key) -> list[T]:
    """The rows (RunRows, or anything ``key`` maps to an owner key) the current reader may see."""
    keys = _VIEW.get()
    rows = list(rows)
    if keys is None:
        return rows
    return [r for r in rows if (key(r) or "") in keys]
