"""FastAPI dependencies, injected through Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from .app import AppState

__all__ = ["State", "get_state"]


def get_state(request: Request) -> AppState:
    st: AppState | None = getattr(request.app.state, "fs", None)
    if st is None or not st.ready:
        raise HTTPException(status_code=503, detail="starting up", headers={"Retry-After": "1"})
    return st


State = Annotated[AppState, Depends(get_state)]
