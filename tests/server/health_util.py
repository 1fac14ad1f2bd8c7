"""Helpers of the run-health tests: batches of steps, positions, failures and pauses sent through the
real ingest of a live server, and polling the real ``/health`` route."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

_SEQ = itertools.count(1)

#: low thresholds so the tests see every transition in seconds
FAST = {"health_interval_s": 0.2, "stall_min_s": 2.0, "stall_factor": 3.0, "stall_first_s": 3.0,
        "stall_silence_s": 6.0, "alert_interval_s": 0.2, "public_url": "https://fleet.example"}


def nodes(world: int, per_node: int = 4) -> list[dict[str, Any]]:
    return [{"rank": r, "host": f"n{r // per_node:04d}", "node": f"n{r // per_node:04d}", "local_rank": r % per_node}
            for r in range(world)]


def steps_batch(run_id: int, world: int, steps: Iterable[int], *, t0: float, step_s: float = 0.5,
                data_s: float = 0.0, **extra: Any) -> dict[str, Any]:
    cols: dict[str, list[Any]] = {"rank": [], "step": [], "step_s": [], "ts": [], "data_s": []}
    for s in steps:
        for r in range(world):
            cols["rank"].append(r)
            cols["step"].append(s)
            cols["step_s"].append(step_s)
            cols["ts"].append(t0 + s * step_s)
            cols["data_s"].append(data_s)
    return {"v": 1, "run_id": run_id, "rank_steps": cols, **extra}


def event(rank: int, kind: str, data: dict[str, Any], *, step: int | None = None, ts: float | None = None) -> dict[str, Any]:
    return {"rank": rank, "seq": next(_SEQ), "kind": kind, "ts": time.time() if ts is None else ts, "step": step,
            "data": data}


def frame(file: str, line: int, func: str) -> dict[str, Any]:
    return {"file": file, "line": line, "func": func}


def waiting(rank: int, step: int, op: str, seq: int, dim: str | None = "dp", open_s: float = 30.0) -> dict[str, Any]:
    """A rank blocked in a collective."""
    return event(rank, "position", {
        "state": "in_step", "phase": "backward", "open_s": open_s, "source": "agent",
        "collective": {"op": op, "dim": dim, "group": "0", "seq": seq, "bytes": 1 << 20, "since_s": open_s - 1,
                       "done": False},
        "stack": [frame("/ws/train.py", 88, "main"), frame("/torch/distributed/c10d.py", 2501, "all_reduce")],
    }, step=step)


def stuck(rank: int, step: int, seq_done: int, frames: list[dict[str, Any]], phase: str = "data",
          open_s: float = 30.0) -> dict[str, Any]:
    """A rank inside its step, not in any collective (its last one, ``seq_done``, done)."""
    return event(rank, "position", {
        "state": "in_step", "phase": phase, "open_s": open_s, "source": "agent",
        "collective": {"op": "all_reduce", "dim": "dp", "group": "0", "seq": seq_done, "bytes": 1 << 20,
                       "since_s": 40.0, "done": True},
        "stack": frames,
    }, step=step)


def health(srv: Any, run_id: int) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/api/v1/runs/{run_id}/health", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, every: float = 0.2,
             tick: Callable[[], None] | None = None) -> Any:
    """Poll ``pred`` until it returns something truthy (``tick`` between polls); fail with the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"condition not met in {timeout:.0f} s; last value: {last!r}")


def state_is(srv: Any, run_id: int, *states: str) -> Callable[[], dict[str, Any] | None]:
    def pred() -> dict[str, Any] | None:
        h = health(srv, run_id)
        stored = srv.state.health
        # the pass has concluded it too (runs.status follows), not only the read
        run = httpx.get(f"{srv.url}/api/v1/runs/{run_id}", timeout=30).json()
        ok = h["state"] in states and (stored is None or run["status"] == _status(h["state"], run["status"]))
        return h if ok else None
    return pred


def _status(state: str, current: str) -> str:
    return current if state == "finished" else state


def alerts(srv: Any, **params: Any) -> list[dict[str, Any]]:
    return httpx.get(f"{srv.url}/api/v1/alerts", params=params, timeout=30).json()["alerts"]


#: one position per rank, inserted in SQL (generate_series): every rank blocked in all_reduce #12 on dim dp
#: with a 2-frame stack, except the ranks ≡ :off (mod :every), stuck in their data loader after #11
BULK_POSITIONS = """
INSERT INTO run_positions (run_id, rank, seq, ts, step, state, phase, open_s, coll_op, coll_dim, coll_group, coll_seq,
                           coll_bytes, coll_since_s, coll_done, stack, source, received_at)
SELECT :r, g, 100, extract(epoch FROM now()), 5, 'in_step', CASE WHEN g % :every = :off THEN 'data' ELSE 'backward' END,
       30.0, 'all_reduce', 'dp', '0', CASE WHEN g % :every = :off THEN 11 ELSE 12 END, 1048576, 29.0,
       g % :every = :off,
       CASE WHEN g % :every = :off
            THEN '[{"file": "/ws/train.py", "line": 90, "func": "main"},
                   {"file": "/ws/data/loader.py", "line": 211, "func": "__next__"}]'::jsonb
            ELSE '[{"file": "/ws/train.py", "line": 88, "func": "main"},
                   {"file": "/torch/distributed/c10d.py", "line": 2501, "func": "all_reduce"}]'::jsonb END,
       'agent', now()
FROM generate_series(0, :w - 1) AS g
"""

#: the ranks of a run, :per to a node named n000000, n000001 …
BULK_RANKS = """
INSERT INTO ranks (run_id, rank, host, node, local_rank)
SELECT :r, g, 'n' || lpad((g / :per)::text, 6, '0'), 'n' || lpad((g / :per)::text, 6, '0'), g % :per
FROM generate_series(0, :w - 1) AS g
"""


def bulk_run(engine: Any, run_id: int, world: int, *, every: int = 128, off: int = 77, per_node: int = 8) -> None:
    """Every rank of ``run_id`` (its ``ranks`` rows and one position each) in two statements."""
    from sqlalchemy import text

    with engine.begin() as c:
        c.execute(text(BULK_RANKS), {"r": run_id, "w": world, "per": per_node})
        c.execute(text(BULK_POSITIONS), {"r": run_id, "w": world, "every": every, "off": off})
