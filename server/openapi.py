"""The OpenAPI document: FastAPI's, completed with what every route shares (docs/api.md).

* the bearer security scheme (``HTTPBearer``): required on every write, optional on reads (required
  when the server runs with ``--read-auth``), none on ``/healthz``;
* the one error body (``server/errors.py``) on every error status a route can answer: 503 everywhere
  (starting, database unavailable), 401/403/429 where a token is or may be checked, 404 where the path
  names something, 422 where there are parameters or a body, 400/413/415 on writes with a body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .errors import ErrorBody, error_responses

__all__ = ["api_schema", "SECURITY_SCHEME"]

SECURITY_SCHEME = "HTTPBearer"
_WRITES = {"post", "put", "patch", "delete"}
_PUBLIC = {"/healthz"}


def _error_ref() -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


def api_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (built once, then cached on the app like FastAPI's own)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = doc.setdefault("components", {})
    schemas = comps.setdefault("schemas", {})
    err = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in err.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas["ErrorBody"] = err
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body: replaced by ErrorBody
        schemas.pop(name, None)
    comps.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
        "type": "http", "scheme": "bearer",
        "description": "An API token (`fleetscope token create`): `Authorization: Bearer fs_...`. Every write "
                       "needs one (scope ingest or admin); reads need a read or admin token when the server runs "
                       "with --read-auth.",
    }
    descriptions = {s: v["description"] for s, v in error_responses(400, 401, 403, 404, 413, 415, 422, 429, 503).items()}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            if method not in _WRITES | {"get", "head"}:
                continue
            write = method in _WRITES and path.startswith("/api/")
            api = path.startswith("/api/")
            statuses = {503}
            if path not in _PUBLIC:
                if write:
                    op["security"] = [{SECURITY_SCHEME: []}]
                    statuses |= {401, 403, 429}
                else:
                    op["security"] = [{}, {SECURITY_SCHEME: []}]  # optional; required with --read-auth
                    statuses |= {401, 403, 429}
            else:
                op["security"] = []
            if "{" in path:
                statuses.add(404)
            if op.get("parameters") or op.get("requestBody") or (api and write):
                statuses.add(422)
            if write and op.get("requestBody"):
                statuses |= {400, 413, 415}
            if write and not op.get("requestBody"):
                statuses.add(413)  # a body sent anyway is capped
            responses = op.setdefault("responses", {})
            for status in sorted(statuses | {int(s) for s in responses if str(s).isdigit() and int(s) >= 400}):
                r = responses.setdefault(str(status), {"description": descriptions.get(status, "Error")})
                r["content"] = _error_ref()
    app.openapi_schema = doc
    return doc
