"""What one running server holds: built by ``create_app``'s lifespan, reached through ``deps.State``."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from .alerts import AlertWorker
from .auth import TokenVerifier
from .compactor import Compactor
from .ingest import IngestService
from .metrics import ServiceMetrics
from .notifier import Notifier
from .settings import Settings

__all__ = ["AppState"]


@dataclass
class AppState:
    """The server's parts, wired once at start-up."""

    settings: Settings
    engine: Engine
    ingest: IngestService
    compactor: Compactor
    tokens: TokenVerifier
    metrics: ServiceMetrics
    notifier: Notifier
    alerts: AlertWorker
    ready: bool = False
