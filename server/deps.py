"""FastAPI dependencies, injected through Annotated aliases: the server's state and token checks."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request

from .state import AppState

__all__ = ["State", "get_state", "Scope", "require_token", "IngestAuth", "AdminAuth"]

Scope = Literal["ingest", "read", "admin"]


def get_state(request: Request) -> AppState:
    """The running server's state; 503 while it starts."""
    st: AppState | None = getattr(request.app.state, "fs", None)
    if st is None or not st.ready:
        raise HTTPException(status_code=503, detail="starting up", headers={"Retry-After": "1"})
    return st


State = Annotated[AppState, Depends(get_state)]


def require_token(scope: Scope) -> object:
    """A dependency that answers 401 unless the request carries a valid bearer token for ``scope``.

    It runs before the route reads its body. Every write route declares it (``dependencies=[...]``);
    with ``--insecure-no-auth`` it lets everything through."""

    def check(request: Request, st: State) -> None:
        if st.settings.insecure_no_auth:
            return
        if not st.tokens.verify(request.headers.get("authorization"), scope=scope):
            st.metrics.rejections.labels("auth").inc()
            raise HTTPException(status_code=401, detail="missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    check.__name__ = f"require_{scope}_token"
    return Depends(check)


#: writes of data for runs (ingest, register, finish, traces, benchmarks)
IngestAuth = require_token("ingest")
#: administration (alert transitions)
AdminAuth = require_token("admin")
