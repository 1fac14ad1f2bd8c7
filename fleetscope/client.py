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

    def run_list(self, **params: Any) -> list[dict[str, Any]]:
        """Runs as the API lists them (dicts; no pandas needed): ``GET /api/v1/runs`` with these parameters."""
        return self._check(self.http.get("/api/v1/runs", params={k: v for k, v in params.items() if v is not None}))["runs"]

    # ------------------------------------------------------------------ notebook reads (pandas)

    def runs(self, filters: dict[str, Any] | None = None, *, columns: list[str] | None = None,
             limit: int | None = None, page_size: int = 1_000, **kw: Any) -> Any:
        """Runs as a pandas DataFrame: one row per run, one ``config.KEY`` column per config key (nested
        keys dotted), ``meta.tags``, and the figures (``mfu``, ``step_s``, ``tokens_per_s`` …).

        Filters as keyword arguments — ``runs(family="llama", status="finished", tag="ablation",
        commit="ab12", since="2026-01-01", sort="-mfu")`` — and ``config.KEY`` / operators through
        ``filters`` (a key with a dot or an operator is no Python identifier): ``runs({"config.tp": 4,
        "config.lr>": 1e-3, "config.seq_len": ("in", [2048, 4096]), "mfu<": 0.5})``. A value may be
        ``(op, value)`` with op in ``= != < > <= >= in``. ``columns``: extra columns
        (``scalar.loss.last``, ``scalar.loss.min``, ``meta.KEY``). Every page of the answer is read
        (``page_size`` runs a request) up to ``limit`` runs."""
        pd = _pandas()
        params = _filter_params({**(filters or {}), **kw})
        if columns:
            params.append(("columns", ",".join(columns)))
        params.append(("figures", "true"))
        rows: list[dict[str, Any]] = []
        offset = 0
        while True:
            n = page_size if limit is None else min(page_size, limit - len(rows))
            if n <= 0:
                break
            page = self._check(self.http.get("/api/v1/runs", params=[*params, ("offset", str(offset)), ("limit", str(n))]))
            got = page.get("runs") or []
            rows.extend(got)
            offset += len(got)
            if not got or offset >= int(page.get("total") or 0):
                break
        return pd.DataFrame([_flat_run(r) for r in rows], columns=_run_columns(rows))

    def run_groups(self, group_by: str | list[str], filters: dict[str, Any] | None = None, **kw: Any) -> Any:
        """Runs grouped by one or two keys (``"config.tp"``, ``["config.tp", "config.seq_len"]``) as a
        DataFrame: the keys, ``count``, ``median_mfu``, ``median_tokens_per_s_per_gpu``, ``median_step_s``."""
        pd = _pandas()
        keys = [group_by] if isinstance(group_by, str) else list(group_by)
        params: list[tuple[str, Any]] = [*_filter_params({**(filters or {}), **kw}), ("group_by", ",".join(keys))]
        return pd.DataFrame(self._check(self.http.get("/api/v1/runs", params=params)).get("groups") or [])

    def steps(self, run_id: int, *, page_size: int = 1_000) -> Any:
        """One row per step of the run (``step``, ``step_s``, ``step_s_max``, the decomposition ``data_s``
        ``compute_s`` ``comm_exposed_s`` ``other_s`` ``straggler_wait_s``, phases, ``tokens``, ``mfu``,
        ``tokens_per_s`` …), every page of ``GET /api/v1/runs/{id}/steps``."""
        pd = _pandas()
        rows: list[dict[str, Any]] = []
        fields: list[str] = []
        after: int | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if after is not None:
                params["after"] = after
            page = self._check(self.http.get(f"/api/v1/runs/{int(run_id)}/steps", params=params))
            fields = page.get("fields") or fields
            got = page.get("steps") or []
            rows.extend(got)
            if len(got) < page_size:
                break
            after = int(got[-1]["step"])
        return pd.DataFrame(rows, columns=fields or None)

    def scalars(self, run_id: int, names: list[str] | None = None, *, max_points: int = 20_000) -> Any:
        """Training scalars in long form: ``name``, ``step``, ``value`` (per step the lowest logging rank;
        a series longer than ``max_points`` is min/max-downsampled by the server)."""
        pd = _pandas()
        params: dict[str, Any] = {"max_points": max_points}
        if names:
            params["names"] = ",".join(names)
        body = self._check(self.http.get(f"/api/v1/runs/{int(run_id)}/scalars", params=params))
        out = [{"name": n, "step": s, "value": v} for n, d in (body.get("scalars") or {}).items()
               for s, v in zip(d["step"], d["value"], strict=True)]
        return pd.DataFrame(out, columns=["name", "step", "value"])

    def alerts(self, **params: Any) -> Any:
        """Alerts (``GET /api/v1/alerts``) as a DataFrame, one row per alert."""
        pd = _pandas()
        body = self._check(self.http.get("/api/v1/alerts", params={k: v for k, v in params.items() if v is not None}))
        return pd.DataFrame(body.get("alerts") if isinstance(body, dict) else body)

    def nodes(self, **params: Any) -> Any:
        """Nodes (``GET /api/v1/nodes``, every page) as a DataFrame, one row per node."""
        pd = _pandas()
        rows: list[dict[str, Any]] = []
        offset = 0
        while True:
            body = self._check(self.http.get("/api/v1/nodes", params={**params, "offset": offset, "limit": 1000}))
            got = body.get("nodes") or []
            rows.extend(got)
            offset += len(got)
            if not got or offset >= int(body.get("total") or 0):
                break
        return pd.DataFrame(rows)

    def collectives(self, run_id: int) -> Any:
        """A run's collectives by op × group × message size (count, time, bus bandwidth) as a DataFrame."""
        pd = _pandas()
        body = self._check(self.http.get(f"/api/v1/runs/{int(run_id)}/collectives"))
        return pd.DataFrame(body.get("collectives") or [])

    def summary(self, run_id: int) -> dict[str, Any]:
        return self._check(self.http.get(f"/api/v1/runs/{run_id}/summary"))

    def get(self, path: str, **params: Any) -> Any:
        return self._check(self.http.get(path, params=params))


# ------------------------------------------------------------------ helpers of the pandas reads


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("fleetscope.client's DataFrame reads need pandas: pip install 'fleetscope[client]' "
                          "(or pip install pandas)") from None
    return pd


_OPS = {"=": "eq", "!=": "ne", "<": "lt", ">": "gt", "<=": "le", ">=": "ge", "in": "in"}


def _filter_params(filters: dict[str, Any]) -> list[tuple[str, str]]:
    """Query parameters of the API's run filters: ``{"config.tp": 4}``, ``{"config.lr>": 1e-3}``,
    ``{"config.tp": ("in", [2, 4])}``, ``{"tag": ["a", "b"]}`` (all of them)."""
    out: list[tuple[str, str]] = []
    for key, v in filters.items():
        if v is None:
            continue
        op = "="
        for suffix in ("!=", "<=", ">=", "<", ">"):
            if key.endswith(suffix):
                key, op = key[: -len(suffix)], suffix
                break
        if isinstance(v, tuple) and len(v) == 2 and v[0] in _OPS:
            op, v = v
        if op not in _OPS:
            raise ValueError(f"unknown operator {op!r} for {key} (use one of {', '.join(_OPS)})")
        if key == "tag" and isinstance(v, (list, tuple)) and op == "=":
            out.extend(("tag", str(t)) for t in v)
            continue
        if op == "in":
            vals = v if isinstance(v, (list, tuple, set)) else [v]
            out.append((key, "in:" + ",".join(_text(x) for x in vals)))
        elif key in ("sort", "since", "until", "commit", "name", "family", "status", "tag", "group_by") and op == "=":
            out.append((key, _text(v)))
        else:
            out.append((key, f"{_OPS[op]}:{_text(v)}"))
    return out


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if hasattr(v, "isoformat"):
        return str(v.isoformat())
    return str(v)


_RUN_FIELDS = ("id", "name", "model_family", "status", "world_size", "mp_size", "device_type", "git_commit",
               "started_at", "finished_at", "steps", "job_id", "attempt")


def _flatten(prefix: str, d: Any, out: dict[str, Any]) -> None:
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = d


def _flat_run(r: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {k: r.get(k) for k in _RUN_FIELDS}
    cfg = r.get("config")
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            _flatten(f"config.{k}", v, row)
    meta = r.get("meta")
    row["tags"] = list(meta.get("tags") or []) if isinstance(meta, dict) and isinstance(meta.get("tags"), list) else []
    for k, v in (r.get("figures") or {}).items():
        if k != "steps":
            row[k] = v
    for k, v in (r.get("columns") or {}).items():
        row[k] = v
    return row


def _run_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Run fields, then every config key seen (sorted), tags, figures, extra columns."""
    flat = [_flat_run(r) for r in rows]
    cfg = sorted({k for f in flat for k in f if k.startswith("config.")})
    rest: list[str] = []
    for f in flat:
        for k in f:
            if k not in _RUN_FIELDS and not k.startswith("config.") and k not in rest:
                rest.append(k)
    return [*_RUN_FIELDS, *cfg, *rest]
