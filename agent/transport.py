"""The agent's transport: an O(1) bounded queue on the training thread, one background sender per process.

The training thread only appends ``(kind, record)`` to a deque. A daemon sender thread, started on the
first ``submit``, wakes every ``flush_interval_s`` (jittered) or when a batch is full, builds columnar
wire batches, and delivers them (``_http.Client``: retries, backoff, 413 splitting). What cannot be
delivered goes to the disk spool (``spool.Spool``), which is replayed, oldest first, after the next
successful send. Drops are counted by reason and sent as ``agent_drops`` events. See
docs/agent-transport.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import random
import threading
import time
import weakref
from collections import deque
from typing import Any

from fleetscope.wire import SECTIONS, WIRE_VERSION

from ._http import Client, LogOnce, Result
from .config import AgentConfig
from .spool import Spool, default_spool_dir, read_segment

__all__ = ["Transport", "build_batch", "AGENT_EVENT_SEQ_BASE"]

logger = logging.getLogger(__name__)

AGENT_EVENT_SEQ_BASE = 1 << 30
"""The agent's own events (``agent_drops``) use seq in [2**30, 2**31): the server keys events by
(run, rank, seq) as int32, and instrumentation numbers its events from 0. The offset grows with wall
time (seconds since 2023-11-14), so a restarted process never reuses one."""
_SEQ_EPOCH = 1_700_000_000
_FINISH = "__finish__"
_ROW_KINDS = {kind: (section, fields) for section, (kind, fields) in SECTIONS.items()}


def _plain(obj: Any) -> Any:
    """A JSON-safe copy (run_info travels as JSON and inside msgpack spool frames)."""
    return json.loads(json.dumps(obj, default=str))


def _good_row(row: Any, width: int, required: tuple[tuple[int, bool], ...]) -> bool:
    if not isinstance(row, (tuple, list)) or len(row) != width:
        return False
    for i, is_float in required:
        v = row[i]
        if v is None or (is_float and isinstance(v, float) and not math.isfinite(v)):
            return False
    return True


def _finite_or_none(col: tuple[Any, ...]) -> list[Any]:
    """Optional float columns: NaN/inf mean "not measured" (the server rejects non-finite numbers)."""
    out = list(col)
    for i, v in enumerate(out):
        if isinstance(v, float) and not math.isfinite(v):
            out[i] = None
    return out


_REQUIRED = {
    section: tuple((i, f.type == "float") for i, f in enumerate(fields) if f.required)
    for section, (_, fields) in SECTIONS.items()
}


def build_batch(items: list[tuple[str, Any]]) -> tuple[dict[str, Any], int, dict[str, int]]:
    """Columnar wire batch (``run_id`` None) from queued (kind, record) items, order kept.

    Returns (batch, records in it, dropped by reason). All-None columns are omitted; rows of the wrong
    width or with a missing/non-finite required value are dropped as "malformed".
    """
    rows: dict[str, list[Any]] = {kind: [] for kind in _ROW_KINDS}
    ranks: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    dropped: dict[str, int] = {}
    for kind, rec in items:
        lst = rows.get(kind)
        if lst is not None:
            lst.append(rec)
        elif kind == "rank" and isinstance(rec, dict):
            ranks.append(rec)
        elif kind == "event" and isinstance(rec, dict):
            events.append(rec)
        else:
            reason = "malformed" if kind in ("rank", "event") else "unknown_kind"
            dropped[reason] = dropped.get(reason, 0) + 1
    batch: dict[str, Any] = {"v": WIRE_VERSION, "run_id": None}
    n = 0
    for kind, (section, fields) in _ROW_KINDS.items():
        rs = rows[kind]
        if not rs:
            continue
        required = _REQUIRED[section]
        good = [r for r in rs if _good_row(r, len(fields), required)]
        if len(good) < len(rs):
            dropped["malformed"] = dropped.get("malformed", 0) + len(rs) - len(good)
        if not good:
            continue
        cols: dict[str, list[Any]] = {}
        for f, col in zip(fields, zip(*good, strict=True), strict=True):
            if any(v is not None for v in col):  # an all-None column means "not measured": omit it
                cols[f.name] = _finite_or_none(col) if f.type == "float" and not f.required else list(col)
        batch[section] = cols
        n += len(good)
    if ranks:
        batch["ranks"] = ranks
        n += len(ranks)
    if events:
        batch["events"] = events
        n += len(events)
    return batch, n, dropped


class Transport:
    """Queue records on the training thread; batch, send, retry, spool and replay them on a sender thread."""

    def __init__(self, config: AgentConfig, run_info: dict[str, Any]) -> None:
        self.config = config
        self._run_info = _plain(run_info)
        self._cap = config.queue_max_records
        self._batch_max = config.batch_max_records
        self._log = LogOnce(logger)
        self._stop = threading.Event()
        self._client: Client | None = None
        if config.server and not config.offline:
            self._client = Client(
                config.server,
                config.token,
                request_timeout_s=config.request_timeout_s,
                backoff_initial_s=config.backoff_initial_s,
                backoff_max_s=config.backoff_max_s,
                stop=self._stop,
                limit=self._limit,
                log_once=self._log,
            )
        elif not config.offline and not config.disabled:
            self._log(
                "no-server",
                logging.WARNING,
                "fleetscope: no server configured (FLEETSCOPE_SERVER); agent data goes to the spool only",
            )
        self.spool = Spool(
            config.spool_dir or default_spool_dir(),
            max_bytes=config.spool_max_bytes,
            segment_max_bytes=config.spool_segment_max_bytes,
        )
        self._closed = False
        self._fresh_state()
        if config.disabled:
            self.submit = _noop_submit  # type: ignore[method-assign]
        self._install_hooks()

    def _fresh_state(self) -> None:
        """Everything a forked child must not share with its parent."""
        self._queue: deque[tuple[str, Any]] = deque()
        self._queue_full = 0
        self._late = 0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_req = 0
        self._flush_done = 0
        self._sender_exited = False
        self._handoff = threading.Lock()
        self._inflight: list[tuple[str, Any]] | None = None
        self._hard_deadline: float | None = None
        self._auth_refused = False  # a 401/403 was seen: sending again with this token is pointless
        self._taken = 0
        self._sent = 0
        self._replayed = 0
        self._spooled = 0
        self._batches = 0
        self._finished = 0
        self._drops: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        self._rank: int | None = None
        self._last_step: int | None = None
        self._event_seq = 0
        self._down = False
        self._probe_at = 0.0
        self._probe_failures = 0
        self._final_probe = False
        self._adopt = True
        self._replay_pos: dict[Any, int] = {}  # segment -> index of the next frame to replay
        self._internal_errors = 0

    def _install_hooks(self) -> None:
        ref = weakref.ref(self)

        def after_in_child() -> None:
            t = ref()
            if t is not None:
                t._after_fork_in_child()

        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=after_in_child)
        atexit.register(_close_at_exit, ref)

    def _after_fork_in_child(self) -> None:
        """A forked child (e.g. a DataLoader worker) gets a fresh, lazy transport: no parent records."""
        try:
            self._stop = threading.Event()
            if self._closed:
                self._stop.set()
            self._fresh_state()
            self._log = LogOnce(logger)
            if self._client is not None:
                self._client.reset_after_fork(self._stop)
                self._client.log_once = self._log
            self.spool.reset_after_fork()
        except Exception:  # never break the child
            pass

    # -- the hot path -------------------------------------------------------------------------------

    def submit(self, kind: str, record: Any) -> None:
        """Queue one record (O(1), never blocks, never raises); dropped and counted when the queue is full."""
        try:
            q = self._queue
            if len(q) >= self._cap:
                self._queue_full += 1
                return
            if self._closed:
                self._late += 1
                return
            q.append((kind, record))
            if self._thread is None:
                self._start()
            elif len(q) >= self._batch_max and not self._wake.is_set():
                self._wake.set()
        except Exception:
            self._internal_error("submit")

    def finish_run(self, status: str = "finished") -> None:
        """Queue ``POST /runs/{id}/finish`` after everything queued so far (best effort, never blocks)."""
        try:
            if self._closed:
                return
            self._queue.append((_FINISH, status))  # past the cap on purpose: one item, and it matters
            if self._thread is None:
                self._start()
            else:
                self._wake.set()
        except Exception:
            self._internal_error("finish_run")

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None:
                return
            t = threading.Thread(target=self._run, name="fleetscope-sender", daemon=True)
            self._thread = t
            try:
                t.start()
            except RuntimeError:  # interpreter shutting down: close() spools what is queued
                self._log(
                    "no-thread", logging.WARNING, "fleetscope: cannot start the sender thread; spooling"
                )

    # -- flush / close / stats ------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Hand off everything queued so far (sent, spooled, or counted as dropped); False on timeout."""
        try:
            t = self._thread
            if t is None or not t.is_alive() or self._closed:
                return not self._queue
            if threading.current_thread() is t:
                return False
            with self._cond:
                self._flush_req += 1
                mine = self._flush_req
            self._wake.set()
            with self._cond:
                return self._cond.wait_for(lambda: self._flush_done >= mine or self._sender_exited, timeout)
        except Exception:
            self._internal_error("flush")
            return False

    def close(self, timeout: float | None = None) -> None:
        """Flush within ``exit_timeout_s`` (or ``timeout``); what is left is spooled, never waited on. Idempotent."""
        try:
            with self._close_lock:
                if self._closed:
                    return
                self._closed = True
            budget = self.config.exit_timeout_s if timeout is None else max(0.0, timeout)
            start = time.monotonic()
            deadline = start + budget
            reserve = min(0.5, 0.2 * budget)  # time kept back to spool what the network did not take
            self._hard_deadline = deadline - reserve
            self._stop.set()
            self._wake.set()
            t = self._thread
            if t is not None and t.ident is not None:
                t.join(max(0.0, self._hard_deadline - time.monotonic()))
                if t.is_alive() and self._client is not None:
                    self._client.abort()  # break a request stuck on a hung server
                    t.join(max(0.0, deadline - time.monotonic()))
            self._spool_leftovers(deadline)  # a no-op when the sender handled everything
            self.spool.close(timeout=max(0.0, deadline - time.monotonic()))
            if self._client is not None:
                self._client.close()
        except Exception:
            self._internal_error("close")
        finally:
            with self._cond:
                self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counters: submitted, queued, sent, spooled, replayed, dropped (by reason), retries, batches."""
        queued = len(self._queue)
        return {
            "submitted": self._taken + queued + self._queue_full + self._late,
            "queued": queued,
            "sent": self._sent,
            "spooled": self._spooled,
            "replayed": self._replayed,
            "dropped": self._drop_counts(),
            "retries": self._client.retries if self._client is not None else 0,
            "batches": self._batches,
            "finished": self._finished,
            "spool_bytes": self.spool.bytes,
            "internal_errors": self._internal_errors,
            "server_down": self._down,
        }

    # -- the sender thread ----------------------------------------------------------------------------

    def _limit(self) -> float | None:
        return self._hard_deadline

    def _interval(self) -> float:
        return max(0.01, self.config.flush_interval_s * random.uniform(0.9, 1.1))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self._interval())
                self._wake.clear()
                if self._stop.is_set():
                    break
                self._cycle(final=False)
            self._cycle(final=True)
        except BaseException:  # the thread must end quietly whatever happens (e.g. interpreter teardown)
            self._internal_error("sender")
        finally:
            try:
                self.spool.close(timeout=1.0)
            except Exception:
                pass
            with self._cond:
                self._sender_exited = True
                self._cond.notify_all()

    def _cycle(self, *, final: bool) -> None:
        with self._cond:
            gen = self._flush_req
        try:
            self._drain(final=final)
            with self._cond:
                self._flush_done = max(self._flush_done, gen)
                self._cond.notify_all()
            if (
                not final
                and self._client is not None
                and (not self._down or time.monotonic() >= self._probe_at)
            ):
                self._replay()  # while the server is down, the first frame doubles as the probe
            elif final and self._client is not None and self._hard_deadline is not None and not self._auth_refused:
                # the server is reachable at exit: use what is left of the exit budget to replay what an
                # outage spooled, so a job that outlived the outage leaves nothing behind
                self._replay(deadline=self._hard_deadline)
        except Exception:
            self._internal_error("sender")

    def _take(self) -> list[tuple[str, Any]]:
        """Pop up to one batch, stopping after a finish marker; the items stay "in flight" until handled."""
        items: list[tuple[str, Any]] = []
        pop = self._queue.popleft
        with self._handoff:
            try:
                while len(items) < self._batch_max:
                    item = pop()
                    items.append(item)
                    if item[0] == _FINISH:
                        break
            except IndexError:
                pass
            self._inflight = items
        self._taken += sum(1 for k, _ in items if k != _FINISH)
        return items

    def _still_mine(self, items: list[tuple[str, Any]]) -> bool:
        """Whether close() has not taken over these in-flight items (then it spools them itself)."""
        with self._handoff:
            return self._inflight is items

    def _drain(self, *, final: bool) -> None:
        reported = False
        while True:
            items = self._take()
            if not reported:
                ev = self._drops_event()
                if ev is not None:
                    items.append(("event", ev))
                    reported = True
            if not items:
                return
            try:
                if items[-1][0] == _FINISH:
                    if len(items) > 1:
                        self._deliver_items(items[:-1], final=final, owner=items)
                    self._deliver({"finish": items[-1][1]}, 0, final=final, owner=items)
                else:
                    self._deliver_items(items, final=final, owner=items)
            except Exception:
                self._internal_error("deliver")
                if self._still_mine(items):  # keep the data: spool it as it is
                    try:
                        self._spool_items(items)
                    except Exception:
                        self._count_drop("internal_error", len(items))
            finally:
                with self._handoff:
                    if self._inflight is items:
                        self._inflight = None

    def _deliver_items(
        self, items: list[tuple[str, Any]], *, final: bool, owner: list[tuple[str, Any]]
    ) -> None:
        batch, n, dropped = build_batch(items)
        for reason, k in dropped.items():
            self._count_drop(reason, k)
        self._learn(batch)
        if n:
            self._deliver({"batch": batch}, n, final=final, owner=owner)

    def _learn(self, batch: dict[str, Any]) -> None:
        """Remember this process's rank and last step (for the agent's own events)."""
        rs = batch.get("rank_steps")
        if rs:
            if self._rank is None:
                self._rank = rs["rank"][0]
            self._last_step = rs["step"][-1]
        elif self._rank is None:
            for key in ("collectives", "modality_tokens"):
                sec = batch.get(key)
                if sec:
                    self._rank = sec["rank"][0]
                    break
            else:
                for r in batch.get("ranks", ()):
                    if isinstance(r.get("rank"), int):
                        self._rank = r["rank"]
                        break

    def _deliver(self, payload: dict[str, Any], n: int, *, final: bool, owner: list[tuple[str, Any]]) -> None:
        client = self._client
        now = time.monotonic()
        if self._down and final and not self._final_probe:
            self._final_probe = True  # at exit, one try in case the server came back since the last probe
            self._probe_at = now
        if client is None or (self._down and now < self._probe_at):
            if self._still_mine(owner):
                self._to_spool(payload, n)
            return
        res = client.deliver(
            self._run_info,
            payload,
            n,
            deadline=now + self.config.retry_deadline_s,
            max_attempts=1 if (self._down or final) else None,
        )
        self._account(res, replay=False)
        if res.reason == "unauthorized":
            self._auth_refused = True
        if res.unsent:
            self._mark_down()
            if self._still_mine(owner):
                for p, k in res.unsent:
                    self._to_spool(p, k)
        elif res.sent or res.finished:
            self._mark_up()

    def _account(self, res: Result, *, replay: bool) -> None:
        if replay:
            self._replayed += res.sent
        else:
            self._sent += res.sent
        self._batches += res.batches
        self._finished += res.finished
        for reason, k in res.dropped.items():
            self._count_drop(reason, k)

    def _mark_down(self) -> None:
        self._probe_failures += 1
        if not self._down:
            self._down = True
            self._probe_failures = 1
        d = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (self._probe_failures - 1))
        self._probe_at = time.monotonic() + d * random.uniform(0.5, 1.0)

    def _mark_up(self) -> None:
        if self._down:
            self._adopt = True
        self._down = False
        self._probe_failures = 0

    def _to_spool(self, payload: dict[str, Any], n: int) -> None:
        frame = {"v": 1, "run_info": self._run_info, **payload}
        if "batch" in frame:
            frame["batch"] = {**frame["batch"], "run_id": None}  # resolved again on replay
        try:
            written, evicted = self.spool.append(frame, n)
        except OSError as e:
            self._log(
                "spool-error",
                logging.ERROR,
                "fleetscope: cannot write the spool in %s (%s); dropping data",
                self.spool.directory,
                e,
            )
            self._count_drop("spool_error", n)
            return
        self._count_drop("spool_full", evicted)
        if written:
            self._spooled += n
        else:
            self._count_drop("spool_full", n)
        if evicted or not written:
            self._log(
                "spool-full",
                logging.WARNING,
                "fleetscope: spool in %s reached spool_max_bytes=%d; dropping the oldest data",
                self.spool.directory,
                self.spool.max_bytes,
            )

    def _replay(self, deadline: float | None = None) -> None:
        """Resend spooled frames, oldest first; a segment is deleted once all its frames were accepted.
        With ``deadline`` (the final flush at exit) it runs after shutdown began, until the deadline."""
        client = self._client
        if client is None:
            return
        if self._adopt:
            self._adopt = False
            self.spool.adopt_orphans()
        if not self.spool.has_pending():
            return
        for path in self.spool.pending():
            try:
                seg = read_segment(path)
            except FileNotFoundError:  # evicted, or taken by `fleetscope upload`
                self.spool.forget(path)
                self._replay_pos.pop(path, None)
                continue
            start = self._replay_pos.get(path, 0)
            if seg.corrupt and start == 0:
                self._count_drop("spool_corrupt", len(seg.corrupt))
                self._log(
                    "spool-corrupt",
                    logging.WARNING,
                    "fleetscope: skipped %d corrupt frame(s) in %s",
                    len(seg.corrupt),
                    path,
                )
            for i in range(start, len(seg.frames)):
                if deadline is None:
                    if self._stop.is_set() or len(self._queue) >= self._batch_max:
                        return  # live data first; resume at this frame next time
                elif time.monotonic() >= deadline:
                    return  # out of exit budget: the rest stays spooled for `fleetscope upload`
                self._replay_pos[path] = i
                frame = seg.frames[i]
                try:
                    payload = frame.payload()
                except ValueError:
                    self._count_drop("spool_corrupt", 1)
                    self._replay_pos[path] = i + 1
                    continue
                res = client.deliver(
                    payload["run_info"],
                    payload,
                    frame.records,
                    deadline=time.monotonic() + self.config.retry_deadline_s if deadline is None else deadline,
                    max_attempts=1 if (self._down or deadline is not None) else None,
                )
                self._account(res, replay=True)
                if res.unsent:
                    self._mark_down()
                    return  # the file keeps every frame until all were accepted; resume here later
                self._mark_up()
            self.spool.remove(path)
            self._replay_pos.pop(path, None)

    def _spool_leftovers(self, deadline: float) -> None:
        """close() on the caller's thread: spool what the sender did not handle (in flight, then queued)."""
        items: list[tuple[str, Any]] = []
        if self._handoff.acquire(timeout=max(0.0, min(0.2, deadline - time.monotonic()))):
            try:
                if self._inflight:
                    items.extend(self._inflight)
                self._inflight = None
            finally:
                self._handoff.release()
        pop = self._queue.popleft
        k = len(items)
        try:
            while True:
                items.append(pop())
        except IndexError:
            pass
        self._taken += sum(1 for kind, _ in items[k:] if kind != _FINISH)
        chunk: list[tuple[str, Any]] = []
        for item in items:
            if item[0] == _FINISH:
                self._spool_items(chunk)
                chunk = []
                self._to_spool({"finish": item[1]}, 0)
            else:
                chunk.append(item)
                if len(chunk) >= self._batch_max:
                    self._spool_items(chunk)
                    chunk = []
        self._spool_items(chunk)

    def _spool_items(self, items: list[tuple[str, Any]]) -> None:
        if not items:
            return
        batch, n, dropped = build_batch(items)
        for reason, k in dropped.items():
            self._count_drop(reason, k)
        if n:
            self._to_spool({"batch": batch}, n)

    # -- drops and internal errors -------------------------------------------------------------------

    def _count_drop(self, reason: str, n: int) -> None:
        if n:
            self._drops[reason] = self._drops.get(reason, 0) + n

    def _drop_counts(self) -> dict[str, int]:
        d = dict(self._drops)
        if self._queue_full:
            d["queue_full"] = self._queue_full
        if self._late:
            d["after_close"] = self._late
        return d

    def _drops_event(self) -> dict[str, Any] | None:
        """An ``agent_drops`` event with the cumulative counts, when they changed since the last one."""
        counts = self._drop_counts()
        if counts == self._reported:
            return None
        self._reported = counts
        seq = max(self._event_seq + 1, AGENT_EVENT_SEQ_BASE + int(time.time()) - _SEQ_EPOCH)
        self._event_seq = seq
        rank = self._rank if self._rank is not None else _env_rank()
        return {
            "rank": rank,
            "seq": seq,
            "kind": "agent_drops",
            "ts": time.time(),
            "step": self._last_step,
            "data": dict(counts),
        }

    def _internal_error(self, where: str) -> None:
        """The one place internal errors end: counted, logged once per place, never raised."""
        try:
            self._internal_errors += 1
            self._log(
                f"internal-{where}",
                logging.ERROR,
                "fleetscope agent: internal error in %s (ignored)",
                where,
                exc_info=True,
            )
        except Exception:
            pass


def _env_rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 0


def _noop_submit(kind: str, record: Any) -> None:
    return None


def _close_at_exit(ref: weakref.ReferenceType[Transport]) -> None:
    t = ref()
    if t is not None:
        t.close()
