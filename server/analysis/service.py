"""Wiring of the analysis into the server: the compaction fold and the background alert worker."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["start_analysis"]

log = logging.getLogger(__name__)


def start_analysis(state: Any, *, start_background: bool = True) -> Callable[[], None]:
    """Register the straggler rollup fold and start regression detection; returns the stop function."""
    from ..alerts import AlertWorker
    from ..notifier import Notifier
    from .rollups import fold_rank_rollups

    settings = state.settings
    state.compactor.folds.append(fold_rank_rollups)
    notifier = Notifier(slack_webhook_url=settings.slack_webhook_url, webhook_url=settings.alert_webhook_url)
    public = settings.public_url or f"http://{settings.host}:{settings.port}"
    worker = AlertWorker(state.engine, notifier=notifier, public_url=public, interval_s=settings.alert_interval_s,
                         step_check_interval_s=settings.alert_step_check_interval_s)
    state.alerts = worker
    prev = state.compactor.on_pass

    def on_pass(res: Any) -> None:
        if prev is not None:
            prev(res)
        if res.steps and res.runs:
            worker.poke(runs=res.runs)

    state.compactor.on_pass = on_pass
    if start_background and settings.alerts_enabled:
        worker.start()

    def stop() -> None:
        worker.stop()
        notifier.close()

    return stop
