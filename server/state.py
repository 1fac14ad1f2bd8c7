"""What one running server holds: built by ``create_app``'s lifespan, reached through ``deps.State``."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from .alerts import AlertWorker
from .auth import TokenVerifier
from .compactor import Compactor
from .health_pass import HealthWorker
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
    health: HealthWorker | None = None  # the health pass (run states, hang/failure alerts)
    #: the read API's and the dashboard's own pool, with a statement budget (server/reads.py); None: ``engine``
    read_engine: Engine | None = None
