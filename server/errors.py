"""One error body for every 4xx/5xx answer of the API (docs/api.md, "Errors").

``{"error": {"status", "code", "message", "where"?, "loc"?, "errors"?}, "detail": ...}``:

* ``error`` is the same object everywhere — the HTTP status, a stable machine-readable ``code``, a
  human ``message``; a refused ingest batch adds ``where`` and ``loc`` ({section, index, field}) of the
  record at fault, a request that failed validation adds ``errors`` (one per bad parameter or field:
  ``loc``, ``msg``, ``type``, ``input`` excerpt);
* ``detail`` is what earlier versions answered, kept for the clients that read it: a string, the
  batch error object ``{error, where, loc}`` (agents rely on it), or the list of validation errors.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["error_body", "ErrorBody", "ErrorInfo", "CODES", "error_responses"]

#: the ``code`` of each status
CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         409: "conflict", 413: "too_large", 415: "unsupported_media_type", 422: "invalid", 429: "too_many_requests",
         500: "internal_error", 503: "unavailable"}


class FieldError(BaseModel):
    """One invalid parameter or body field."""

    model_config = ConfigDict(extra="allow")
    loc: list[str | int] = Field(description="where: (query|path|body, name, ...)")
    msg: str
    type: str | None = None
    input: str | None = Field(None, description="a short ASCII excerpt of the value given")


class RecordLocation(BaseModel):
    """The record of a refused ingest batch at fault."""

    model_config = ConfigDict(extra="allow")
    section: str | None = None
    index: int | None = None
    field: str | None = None


class ErrorInfo(BaseModel):
    """What went wrong, the same shape for every status."""

    model_config = ConfigDict(extra="allow")
    status: int = Field(description="the HTTP status")
    code: str = Field(description="stable: " + ", ".join(sorted(set(CODES.values()))))
    message: str = Field(description="for people")
    where: str | None = Field(None, description="ingest: the value at fault (rank_steps.step_s[7], records[3].kind)")
    loc: RecordLocation | None = Field(None, description="ingest: `where` taken apart")
    errors: list[FieldError] | None = Field(None, description="422 from validation: one per bad parameter or field")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer of the API."""

    error: ErrorInfo
    detail: str | dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="kept for older clients: the message, the ingest batch error {error, where, loc}, or the "
                          "list of validation errors")


def error_body(status: int, detail: Any) -> dict[str, Any]:
    """The body of an error answer with this status and (legacy) detail."""
    info: dict[str, Any] = {"status": status, "code": CODES.get(status, "client_error" if status < 500 else "server_error")}
    if isinstance(detail, dict):
        info["message"] = str(detail.get("error") or detail.get("message") or detail)[:2000]
        for k in ("where", "loc"):
            if k in detail:
                info[k] = detail[k]
    elif isinstance(detail, list):
        info["message"] = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
                                    for e in detail[:5] if isinstance(e, dict))[:2000] or "invalid request"
        info["errors"] = detail
    else:
        info["message"] = str(detail if detail is not None else "")[:2000]
    return {"error": info, "detail": detail}


_DESCRIPTIONS = {
    400: "Malformed request (bad Host header, Content-Length or body encoding)",
    401: "Missing or invalid bearer token (writes always; reads with --read-auth)",
    403: "The token's scope or owner does not allow this",
    404: "Not found",
    413: "Body too large",
    415: "Unsupported Content-Type or Content-Encoding",
    422: "Invalid parameter or body (`error.errors` / `error.where` name it)",
    429: "Too many failed authentications with this credential, or (ingest) a compaction backlog; retry after "
         "Retry-After seconds",
    503: "Starting, overloaded or the database is unavailable; retry after Retry-After seconds",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these statuses, each with the error body's schema."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS.get(s, "Error")} for s in statuses}
