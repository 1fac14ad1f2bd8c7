"""The agent's transport: an O(1) bounded queue on the training thread, one background sender per process.

The training thread only appends ``(kind, record)`` to a deque. A daemon sender thread, started on the
first ``submit``, wakes every ``flush_interval_s`` (jittered) or when a batch is full, builds columnar
wire batches (``batching.build_batch``) and hands each to the delivery policy (``delivery.Delivery``:
send through ``api_client.Client``, or spool; circuit breaker; replay). Drops are counted by reason
and sent as ``agent_drops`` events (drop_report.py). ``Transport`` satisfies ``protocols.Transport``. See
docs/agent-transport.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from .api_client import Client, LogOnce, Payload
from .batching import Item, build_batch
from .config import AgentConfig
from .delivery import Delivery
from .drop_report import AGENT_EVENT_SEQ_BASE, DropReport
from .spool import Spool, default_spool_dir

__all__ = ["Transport", "build_batch", "AGENT_EVENT_SEQ_BASE"]

logger = logging.getLogger(__name__)

_FINISH = "__finish__"


def _plain(obj: Any) -> Any:
    """A JSON-safe copy (run_info travels as JSON and inside msgpack spool frames)."""
    return json.loads(json.dumps(obj, default=str))


class Transport:
    """Queue records on the training thread; batch, send, retry, spool and replay them on a sender thread."""

    def __init__(self, config: AgentConfig, run_info: dict[str, Any]) -> None:
        self.config = config
        self._run_info: dict[str, Any] = _plain(run_info)
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
        # sender-thread callbacks (health.py): ``observe(items)`` sees what each cycle takes from the
        # queue, ``watch()`` may return one event to send (a position) after each cycle's drain
        self.observe: Callable[[list[Item]], None] | None = None
        self.watch: Callable[[], dict[str, Any] | None] | None = None
        self.expanders: dict[str, Callable[[Any, Callable[[str, object], None]], None]] = {}
        """Queue kinds whose item the sender thread turns into records (kind -> fn(item, submit)): the
        run's step end queues raw marks (step_end.DEFERRED_STEP) and its records are built here."""
        self._fresh_state()
        if config.disabled:
            self.submit = _noop_submit  # type: ignore[method-assign]
        self._install_hooks()

    def _fresh_state(self) -> None:
        """Everything a forked child must not share with its parent."""
        self._queue: deque[Item] = deque()
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
        self._inflight: list[Item] | None = None
        self._hard_deadline: float | None = None
        self._taken = 0
        self._report = DropReport()
        self._internal_errors = 0
        self._delivery = Delivery(
            self.config,
            self._run_info,
            self._client,
            self.spool,
            self._log,
            stop=self._stop,
            live_waiting=self._live_waiting,
        )

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
            self._log = LogOnce(logger)
            if self._client is not None:
                self._client.reset_after_fork(self._stop)
                self._client.log_once = self._log
            self.spool.reset_after_fork()
            self._fresh_state()
        except Exception:  # never break the child
            pass

    # -- the hot path -------------------------------------------------------------------------------

    def submit(self, kind: str, record: object) -> None:
        """Queue one record (O(1), never blocks, never raises); dropped and counted when the queue is full."""
        try:
            q = self._queue
            n = len(q)
            if n >= self._cap:
                self._queue_full += 1
                return
            if self._closed:
                self._late += 1
                return
            q.append((kind, record))
            if self._thread is None:
                self._start()
            elif n >= self._batch_max - 1 and not self._wake.is_set():  # the queue holds n + 1 now
                self._wake.set()
        except Exception:
            self._internal_error("submit")

    def finish_run(self, status: str) -> None:
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
                self._log("no-thread", logging.WARNING, "fleetscope: cannot start the sender thread; spooling")

    # -- flush / close / stats ------------------------------------------------------------------------

    def update_run_meta(self, **items: Any) -> None:
        """Add ``items`` to the run's meta (keys it already has are kept): the next delivery registers the
        changed run info again, and the server merges the new keys into the run's meta. Never raises."""
        try:
            meta = self._run_info.get("meta")
            meta = dict(meta) if isinstance(meta, dict) else {}
            new = {k: v for k, v in _plain(items).items() if k not in meta}
            if new:
                self._run_info["meta"] = {**meta, **new}  # one assignment: the sender never sees it half-made
        except Exception:  # noqa: BLE001
            pass

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
        d = self._delivery
        return {
            "submitted": self._taken + queued + self._queue_full + self._late,
            "queued": queued,
            "sent": d.sent,
            "spooled": d.spooled,
            "replayed": d.replayed,
            "dropped": self._drop_counts(),
            "retries": self._client.retries if self._client is not None else 0,
            "batches": d.batches,
            "finished": d.finished,
            "spool_bytes": self.spool.bytes,
            "internal_errors": self._internal_errors,
            "server_down": d.down,
        }

    # -- the sender thread ----------------------------------------------------------------------------

    def _limit(self) -> float | None:
        return self._hard_deadline

    def _live_waiting(self) -> bool:
        return len(self._queue) >= self._batch_max

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
            watch = self.watch
            if watch is not None and not final:
                ev = watch()
                if ev is not None:
                    self.submit("event", ev)
                    self._drain(final=final)
            with self._cond:
                self._flush_done = max(self._flush_done, gen)
                self._cond.notify_all()
            self._delivery.after_drain(final=final, hard_deadline=self._hard_deadline)
        except Exception:
            self._internal_error("sender")

    def _take(self) -> list[Item]:
        """Pop up to one batch, stopping after a finish marker; the items stay "in flight" until handled."""
        items: list[Item] = []
        pop = self._queue.popleft
        expanders = self.expanders
        with self._handoff:
            try:
                while len(items) < self._batch_max:
                    item = pop()
                    if item[0] in expanders:
                        self._expand(item, items)
                        continue
                    items.append(item)
                    if item[0] == _FINISH:
                        break
            except IndexError:
                pass
            self._inflight = items
        self._taken += sum(1 for k, _ in items if k != _FINISH)
        return items

    def _expand(self, item: Item, into: list[Item]) -> None:
        """The records of a queued item of an ``expanders`` kind, appended to ``into`` (never raises:
        an item that cannot be expanded is counted as dropped)."""
        append = into.append
        try:
            self.expanders[item[0]](item[1], lambda kind, rec: append((kind, rec)))
        except Exception:
            self._internal_error("expand")
            self._delivery.count_drop("internal_error", 1)

    def _still_mine(self, items: list[Item]) -> bool:
        """Whether close() has not taken over these in-flight items (then it spools them itself)."""
        with self._handoff:
            return self._inflight is items

    def _drain(self, *, final: bool) -> None:
        reported = False
        while True:
            items = self._take()
            observe = self.observe
            if observe is not None and items:
                observe(items)
            if not reported:
                ev = self._report.event(self._drop_counts())
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
                        self._delivery.spool_items(items)
                    except Exception:
                        self._delivery.count_drop("internal_error", len(items))
            finally:
                with self._handoff:
                    if self._inflight is items:
                        self._inflight = None

    def _deliver_items(self, items: list[Item], *, final: bool, owner: list[Item]) -> None:
        batch, n, dropped = build_batch(items)
        for reason, k in dropped.items():
            self._delivery.count_drop(reason, k)
        self._report.learn(batch)
        if n:
            self._deliver({"batch": batch}, n, final=final, owner=owner)

    def _deliver(self, payload: Payload, n: int, *, final: bool, owner: list[Item]) -> None:
        self._delivery.deliver(payload, n, final=final, still_mine=lambda: self._still_mine(owner))

    def _spool_leftovers(self, deadline: float) -> None:
        """close() on the caller's thread: spool what the sender did not handle (in flight, then queued)."""
        items: list[Item] = []
        if self._handoff.acquire(timeout=max(0.0, min(0.2, deadline - time.monotonic()))):
            try:
                if self._inflight:
                    items.extend(self._inflight)
                self._inflight = None
            finally:
                self._handoff.release()
        pop = self._queue.popleft
        k = len(items)
        expanders = self.expanders
        try:
            while True:
                item = pop()
                if item[0] in expanders:
                    self._expand(item, items)
                else:
                    items.append(item)
        except IndexError:
            pass
        self._taken += sum(1 for kind, _ in items[k:] if kind != _FINISH)
        d = self._delivery
        chunk: list[Item] = []
        for item in items:
            if item[0] == _FINISH:
                d.spool_items(chunk)
                chunk = []
                d.to_spool({"finish": item[1]}, 0)
            else:
                chunk.append(item)
                if len(chunk) >= self._batch_max:
                    d.spool_items(chunk)
                    chunk = []
        d.spool_items(chunk)

    # -- drops and internal errors -------------------------------------------------------------------

    def _drop_counts(self) -> dict[str, int]:
        d = dict(self._delivery.drops)
        if self._queue_full:
            d["queue_full"] = self._queue_full
        if self._late:
            d["after_close"] = self._late
        return d

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


def _noop_submit(kind: str, record: object) -> None:
    return None


def _close_at_exit(ref: weakref.ReferenceType[Transport]) -> None:
    t = ref()
    if t is not None:
        t.close()
