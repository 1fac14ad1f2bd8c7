"""Logging that stays readable during an outage: one line per cause per interval.

A database outage makes every request and every background pass fail the same way; logging each one
(with a traceback) buries the one line an operator needs. :func:`log_throttled` logs a cause at most
once per ``interval_s`` and says on the next line it lets through how many it held back::

    log_throttled(log, logging.WARNING, "db-down", "database unavailable: %s", type(e).__name__)

Causes are short strings chosen by the caller (``"health-pass"``, ``"db-down:/api/v1/runs"``); the table
of causes is bounded (oldest forgotten first), so a cause built from input cannot grow it without end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

__all__ = ["Throttle", "log_throttled", "DEFAULT_INTERVAL_S"]

#: the default: one line per cause per minute
DEFAULT_INTERVAL_S = 60.0
_MAX_CAUSES = 1_024


class Throttle:
    """Per-cause gate: :meth:`admit` is True at most once per interval for each cause."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # cause -> (last logged, held back since)

    def admit(self, cause: str) -> tuple[bool, int]:
        """(whether to log now, how many were held back since the last line of this cause)."""
        now = self._clock()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last[0] < self.interval_s:
                self._last[cause] = (last[0], last[1] + 1)
                return False, 0
            held = last[1] if last is not None else 0
            self._last[cause] = (now, 0)
            self._last.move_to_end(cause)
            while len(self._last) > _MAX_CAUSES:
                self._last.popitem(last=False)
            return True, held


_DEFAULT = Throttle()


def log_throttled(logger: logging.Logger, level: int, cause: str, msg: str, *args: object,
                  exc_info: bool = False, throttle: Throttle | None = None) -> bool:
    """Log ``msg % args`` unless ``cause`` was logged within the throttle's interval; True when logged.
    The traceback (``exc_info``) is attached only to the lines that are let through."""
    ok, held = (throttle or _DEFAULT).admit(cause)
    if not ok:
        return False
    if held:
        msg = f"{msg} (and {held} more like it in the last interval)"
    logger.log(level, msg, *args, exc_info=exc_info)
    return True
