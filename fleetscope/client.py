"""A small synchronous HTTP client of the fleetscope API (CLI, demo, scripts, notebooks)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from .wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS, columns_from_rows, encode_batch

__all__ = ["Client", "ApiError", "columnar"]


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def columnar(rows: list[tuple], fields: Any, *, binary: bool = False) -> dict[str, Any]:
    """Rows (tuples in field order) → columnar section (lists, or packed bytes when ``binary``)."""
    return columns_from_rows(rows, fields, binary=binary)


class Client:
    """``Client("http://127.0.0.1:8000", token)``: register runs, ingest, read."""

    def __init__(self, server: str, token: str | None = None, *, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:200]
            raise ApiError(r.status_code, detail)
        return r.json()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.server} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def register_run(self, info: dict[str, Any]) -> int:
        return int(self._check(self.http.post("/api/v1/runs", json=info))["id"])

    def finish_run(self, run_id: int, status: str = "finished", finished_at: float | None = None) -> None:
        body: dict[str, Any] = {"status": status}
        if finished_at is not None:
            body["finished_at"] = finished_at
        self._check(self.http.post(f"/api/v1/runs/{run_id}/finish", json=body))

    def ingest(self, batch: dict[str, Any], *, fmt: str = "msgpack", retries: int = 20) -> dict[str, Any]:
        body, headers = encode_batch(batch, fmt=fmt)
        for attempt in range(retries + 1):
            r = self.http.post("/api/v1/ingest", content=body, headers=headers)
            if r.status_code in (429, 503) and attempt < retries:
                time.sleep(min(float(r.headers.get("Retry-After", "1")), 5.0))
                continue
            return self._check(r)
        raise AssertionError("unreachable")

    def ingest_rows(self, run_id: int, step_rows: list[tuple], coll_rows: list[tuple] | None = None, **extra: Any) -> dict[str, Any]:
        batch: dict[str, Any] = {"v": 1, "run_id": run_id, "rank_steps": columnar(step_rows, RANK_STEP_FIELDS, binary=True)}
        if coll_rows:
            batch["collectives"] = columnar(coll_rows, COLLECTIVE_FIELDS, binary=True)
        batch.update(extra)
        return self.ingest(batch)

    def runs(self, **params: Any) -> list[dict[str, Any]]:
        return self._check(self.http.get("/api/v1/runs", params={k: v for k, v in params.items() if v is not None}))["runs"]

    def summary(self, run_id: int) -> dict[str, Any]:
        return self._check(self.http.get(f"/api/v1/runs/{run_id}/summary"))

    def get(self, path: str, **params: Any) -> Any:
        return self._check(self.http.get(path, params=params))
