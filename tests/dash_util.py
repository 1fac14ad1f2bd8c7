"""Helpers of the dashboard tests: synthetic runs through the real ingest, and fixture rows."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text

from fleetscope.client import columnar
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS


def load(srv: Any, spec: RunSpec, *, modalities: bool = False, events: bool = False, batch_rank_steps: int = 20_000,
         step_lo: int = 0, step_hi: int | None = None, compact: bool = True, **info: Any) -> int:
    """Register ``spec`` and ingest steps [step_lo, step_hi) with hosts, collectives and optionally
    per-modality tokens and checkpoint events; returns the run id."""
    reg = spec.run_info()
    reg["started_at"] = spec.start_ts
    reg.update(info)
    hosts = [{"rank": r, "host": spec.host_of(r), "node": spec.host_of(r), "local_rank": r % spec.gpus_per_node}
             for r in range(spec.world_size)]
    mods = spec.fam.modalities
    with srv.client() as c:
        rid = c.register_run(reg)
        buf: list[tuple] = []
        cbuf: list[tuple] = []
        mbuf: dict[str, list] = {"rank": [], "step": [], "modality": [], "tokens": []}
        ev: list[dict[str, Any]] = []
        first = True

        def flush() -> None:
            nonlocal first, buf, cbuf, mbuf, ev
            batch: dict[str, Any] = {"v": 1, "run_id": rid, "rank_steps": columnar(buf, RANK_STEP_FIELDS),
                                     "collectives": columnar(cbuf, COLLECTIVE_FIELDS)}
            if mbuf["rank"]:
                batch["modality_tokens"] = mbuf
            if ev:
                batch["events"] = ev
            if first:
                batch["ranks"] = hosts
                first = False
            c.ingest(batch)
            buf, cbuf, ev = [], [], []
            mbuf = {"rank": [], "step": [], "modality": [], "tokens": []}

        last = (spec.steps if step_hi is None else min(step_hi, spec.steps)) - 1
        for step, rows in rank_step_rows(spec, step_lo, step_hi):
            buf.extend(rows)
            cbuf.extend(collective_rows(spec, step, rows))
            if modalities:
                for r in range(spec.world_size):
                    for i, m in enumerate(mods):
                        mbuf["rank"].append(r)
                        mbuf["step"].append(step)
                        mbuf["modality"].append(m)
                        mbuf["tokens"].append(1000 * (i + 1))
            if events and step % 10 == 0:
                ev.append({"rank": 0, "seq": step, "kind": "checkpoint", "ts": rows[0][3], "step": step,
                           "data": {"duration_s": 1.5}})
            if len(buf) >= batch_rank_steps or step == last:
                flush()
    if compact:
        srv.compact()
    return rid


def add_alert(engine: Any, **a: Any) -> int:
    """An alert row as the regression detector writes it (server/analysis/regressions.py → alerts.sync)."""
    row = {"dedup_key": f"test:{a.get('kind')}:{a.get('metric')}:{a.get('run_id')}", "kind": "run_series",
           "metric": "tokens_per_s_per_gpu", "state": "firing", "run_id": None, "before": None, "after": None,
           "change": None, "significance": 1e-4, "first_bad": {}, "details": {}, "url": None, **a}
    with engine.begin() as c:
        return int(c.execute(text(
            "INSERT INTO alerts (dedup_key, kind, metric, state, run_id, before, after, change, significance, first_bad, "
            "details, url) VALUES (:dedup_key, :kind, :metric, :state, :run_id, :before, :after, :change, :significance, "
            "CAST(:first_bad AS jsonb), CAST(:details AS jsonb), :url) RETURNING id"),
            {**row, "first_bad": json.dumps(row["first_bad"]), "details": json.dumps(row["details"])}).scalar_one())


def add_benchmarks(srv: Any) -> None:
    """Benchmark points through the API, as ``fleetscope bench`` sends them."""
    pts = []
    for day in range(6):
        ts = 1.7e9 + 86400 * day
        pts.append({"name": "matmul_tflops", "params": {"n": 4096, "dtype": "bf16"}, "unit": "TFLOP/s",
                    "value": 700.0 - (60 if day >= 4 else 0), "ts": ts, "git_commit": f"c{day}"})
        for b in (1 << 20, 1 << 24, 1 << 28):
            pts.append({"name": "all_reduce_busbw", "params": {"bytes": b, "world": 8}, "unit": "GB/s",
                        "value": 50.0 * (b.bit_length() / 29), "ts": ts, "git_commit": f"c{day}"})
    with srv.client() as c:
        r = c.http.post("/api/v1/benchmarks", json={"cluster": "h100-a", "points": pts})
        assert r.status_code == 200, r.text


def texts(node: Any, *, numbers: bool = False) -> list[str]:
    """Every string (and with ``numbers``, every number) in a serialised Dash component tree."""
    if isinstance(node, str):
        return [node]
    if numbers and isinstance(node, (int, float)) and not isinstance(node, bool):
        return [str(node)]
    if isinstance(node, list):
        return [t for n in node for t in texts(n, numbers=numbers)]
    if isinstance(node, dict):
        return [t for k, v in node.items() if k in ("props", "children") for t in texts(v, numbers=numbers)]
    return []


def find(node: Any, cid: str) -> Any:
    """The component with id ``cid`` in a serialised Dash component tree (None if absent)."""
    if isinstance(node, list):
        return next((f for n in node if (f := find(n, cid)) is not None), None)
    if isinstance(node, dict):
        props = node.get("props") or {}
        if props.get("id") == cid:
            return node
        return find(props.get("children"), cid)
    return None
