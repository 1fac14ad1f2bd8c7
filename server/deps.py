"""FastAPI dependencies, injected through Annotated aliases: the server's state and token checks."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request, params

from .auth import ANONYMOUS_ADMIN, Principal
from .state import AppState

__all__ = ["State", "get_state", "Scope", "require_token", "IngestAuth", "AdminAuth", "IngestCaller", "AdminCaller"]

Scope = Literal["ingest", "read", "admin"]


def get_state(request: Request) -> AppState:
    """The running server's state; 503 while it starts."""
    st: AppState | None = getattr(request.app.state, "fs", None)
    if st is None or not st.ready:
        raise HTTPException(status_code=503, detail="starting up", headers={"Retry-After": "1"})
    return st


State = Annotated[AppState, Depends(get_state)]


def require_token(scope: Scope) -> params.Depends:
    """A dependency that lets a request through only when its token holds ``scope``.

    The edge (``server/edge.py``) authenticates every write before its body is read and puts the
    principal in the request's state; this checks the scope: 401 without a principal, 403 when the
    token's scope is not enough. Every write route declares it (``dependencies=[...]``)."""

    def check(request: Request, st: State) -> Principal:
        p: Principal | None = getattr(request.state, "principal", None)
        if p is None and st.settings.insecure_no_auth:
            p = ANONYMOUS_ADMIN
        if p is None:
            st.metrics.reject("auth")
            raise HTTPException(status_code=401, detail="missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
        if not p.allows(scope):
            st.metrics.reject("forbidden")
            raise HTTPException(status_code=403, detail=f"token {p.name!r} has scope {p.scope!r}; this needs {scope!r}")
        return p

    check.__name__ = f"require_{scope}_token"
    return Depends(check)


#: writes of data for runs (ingest, register, finish, traces, benchmarks)
IngestAuth = require_token("ingest")
#: administration (alert transitions)
AdminAuth = require_token("admin")
#: the principal of a write route, as a parameter (``who: IngestCaller``)
IngestCaller = Annotated[Principal, IngestAuth]
AdminCaller = Annotated[Principal, AdminAuth]
