"""The delivery policy above one request, run on the transport's sender thread: send a payload or hand
it to the disk spool, the circuit breaker that decides which, and the replay of the spool.

* **Send or spool.** With a client and a server not marked down, a payload goes to
  ``Client.deliver`` (retries, backoff, ``Retry-After``, 413 halves, 422 salvage: ``api_client.py``)
  within ``retry_deadline_s``; what it could not deliver is spooled. Without a client (offline, no
  server) everything is spooled.
* **Circuit breaker.** A payload left unsent marks the server down: later payloads go straight to the
  spool, and one attempt per payload probes the server at most every ``backoff_*`` interval (capped
  at ``backoff_max_s``). The first success marks it up, which triggers a replay (and a scan for
  segments that dead processes left, adopted once per recovery).
* **Replay.** Spooled frames are resent oldest first; a segment is deleted once all its frames were
  accepted. Live data goes first (``live_waiting``); at exit the replay runs until a deadline.

It counts what it sent, spooled, replayed and dropped (``drops``, by reason). See docs/agent-transport.md.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .api_client import Client, LogOnce, Payload, Result
from .batching import Item, build_batch
from .config import AgentConfig
from .spool import Spool, read_segment

__all__ = ["Delivery"]


class Delivery:
    """Where each payload of one process goes (a forked child gets a new one)."""

    def __init__(
        self,
        config: AgentConfig,
        run_info: dict[str, Any],
        client: Client | None,
        spool: Spool,
        log: LogOnce,
        *,
        stop: threading.Event,
        live_waiting: Callable[[], bool],
    ) -> None:
        self.config = config
        self.run_info = run_info
        self.client = client
        self.spool = spool
        self._log = log
        self._stop = stop
        self._live_waiting = live_waiting
        """Whether live data waits (a full batch queued): replay yields to it."""
        self.sent = 0
        self.replayed = 0
        self.spooled = 0
        self.batches = 0
        self.finished = 0
        self.drops: dict[str, int] = {}
        self.down = False
        """The circuit breaker: the server is considered down, payloads go to the spool."""
        self.auth_refused = False
        """A 401/403 was seen: sending again with this token is pointless."""
        self._probe_at = 0.0
        self._probe_failures = 0
        self._final_probe = False
        self._adopt = True
        self._replay_pos: dict[Path, int] = {}  # segment -> index of the next frame to replay

    def count_drop(self, reason: str, n: int) -> None:
        if n:
            self.drops[reason] = self.drops.get(reason, 0) + n

    # -- send or spool ---------------------------------------------------------------------------------

    def deliver(self, payload: Payload, n: int, *, final: bool, still_mine: Callable[[], bool]) -> None:
        """Send ``payload`` (``n`` records) or spool it; ``still_mine()`` False means that ``close()``
        took the payload over (it spools it itself)."""
        client = self.client
        now = time.monotonic()
        if self.down and final and not self._final_probe:
            self._final_probe = True  # at exit, one try in case the server came back since the last probe
            self._probe_at = now
        if client is None or (self.down and now < self._probe_at):
            if still_mine():
                self.to_spool(payload, n)
            return
        res = client.deliver(
            self.run_info,
            payload,
            n,
            deadline=now + self.config.retry_deadline_s,
            max_attempts=1 if (self.down or final) else None,
        )
        self._account(res, replay=False)
        if res.reason == "unauthorized":
            self.auth_refused = True
        if res.unsent:
            self._mark_down()
            if still_mine():
                for p, k in res.unsent:
                    self.to_spool(p, k)
        elif res.sent or res.finished:
            self._mark_up()

    def _account(self, res: Result, *, replay: bool) -> None:
        if replay:
            self.replayed += res.sent
        else:
            self.sent += res.sent
        self.batches += res.batches
        self.finished += res.finished
        for reason, k in res.dropped.items():
            self.count_drop(reason, k)

    def _mark_down(self) -> None:
        self._probe_failures += 1
        if not self.down:
            self.down = True
            self._probe_failures = 1
        cfg = self.config
        d = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (self._probe_failures - 1))
        self._probe_at = time.monotonic() + d * random.uniform(0.5, 1.0)

    def _mark_up(self) -> None:
        if self.down:
            self._adopt = True
        self.down = False
        self._probe_failures = 0

    # -- the spool -------------------------------------------------------------------------------------

    def to_spool(self, payload: Payload, n: int) -> None:
        """Write one payload as a spool frame (with everything needed to register the run on replay)."""
        frame = {"v": 1, "run_info": self.run_info, **payload}
        if "batch" in frame:
            frame["batch"] = {**frame["batch"], "run_id": None}  # resolved again on replay
        spool = self.spool
        try:
            written, evicted = spool.append(frame, n)
        except OSError as e:
            self._log(
                "spool-error",
                logging.ERROR,
                "fleetscope: cannot write the spool in %s (%s); dropping data",
                spool.directory,
                e,
            )
            self.count_drop("spool_error", n)
            return
        self.count_drop("spool_full", evicted)
        if written:
            self.spooled += n
        else:
            self.count_drop("spool_full", n)
        if evicted or not written:
            self._log(
                "spool-full",
                logging.WARNING,
                "fleetscope: spool in %s reached spool_max_bytes=%d; dropping the oldest data",
                spool.directory,
                spool.max_bytes,
            )

    def spool_items(self, items: list[Item]) -> None:
        """Spool queued items as they are (one batch), counting the malformed ones."""
        if not items:
            return
        batch, n, dropped = build_batch(items)
        for reason, k in dropped.items():
            self.count_drop(reason, k)
        if n:
            self.to_spool({"batch": batch}, n)

    # -- replay ----------------------------------------------------------------------------------------

    def after_drain(self, *, final: bool, hard_deadline: float | None) -> None:
        """The replay a sender cycle ends with: while the server is healthy, or when a probe is due
        (while it is down, the first frame doubles as the probe); at exit, while the exit budget lasts
        (a job that outlived an outage leaves nothing behind), unless the token was refused."""
        if self.client is None:
            return
        if not final:
            if not self.down or time.monotonic() >= self._probe_at:
                self.replay()
        elif hard_deadline is not None and not self.auth_refused:
            self.replay(deadline=hard_deadline)

    def replay(self, deadline: float | None = None) -> None:
        """Resend spooled frames, oldest first; a segment is deleted once all its frames were accepted.
        With ``deadline`` (the final flush at exit) it runs after shutdown began, until the deadline."""
        client = self.client
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
                self.count_drop("spool_corrupt", len(seg.corrupt))
                self._log(
                    "spool-corrupt",
                    logging.WARNING,
                    "fleetscope: skipped %d corrupt frame(s) in %s",
                    len(seg.corrupt),
                    path,
                )
            for i in range(start, len(seg.frames)):
                if deadline is None:
                    if self._stop.is_set() or self._live_waiting():
                        return  # live data first; resume at this frame next time
                elif time.monotonic() >= deadline:
                    return  # out of exit budget: the rest stays spooled for `fleetscope upload`
                self._replay_pos[path] = i
                frame = seg.frames[i]
                try:
                    payload = frame.payload()
                except ValueError:
                    self.count_drop("spool_corrupt", 1)
                    self._replay_pos[path] = i + 1
                    continue
                res = client.deliver(
                    payload["run_info"],
                    payload,
                    frame.records,
                    deadline=time.monotonic() + self.config.retry_deadline_s if deadline is None else deadline,
                    max_attempts=1 if (self.down or deadline is not None) else None,
                )
                self._account(res, replay=True)
                if res.unsent:
                    self._mark_down()
                    return  # the file keeps every frame until all were accepted; resume here later
                self._mark_up()
            self.spool.remove(path)
            self._replay_pos.pop(path, None)
