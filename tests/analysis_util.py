"""Helpers of the analysis tests: load synthetic runs with known answers through the real ingest."""

from __future__ import annotations

from typing import Any

from fleetscope.client import columnar
from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS


def load(srv: Any, spec: RunSpec, *, batch_rank_steps: int = 50_000, collectives: bool = True,
         transform: Any = None, coll_transform: Any = None, events: list[dict[str, Any]] | None = None,
         compact: bool = True, **info: Any) -> int:
    """Register ``spec`` (plus ``info`` overrides) and ingest all its steps (with hosts); returns the run id."""
    reg = spec.run_info()
    reg["started_at"] = spec.start_ts
    reg.update(info)
    hosts = [{"rank": r, "host": spec.host_of(r), "node": spec.host_of(r), "local_rank": r % spec.gpus_per_node}
             for r in range(spec.world_size)]
    with srv.client() as c:
        rid = c.register_run(reg)
        buf: list[tuple] = []
        cbuf: list[tuple] = []
        first = True

        def flush() -> None:
            nonlocal first, buf, cbuf
            batch: dict[str, Any] = {"v": 1, "run_id": rid, "rank_steps": columnar(buf, RANK_STEP_FIELDS)}
            if cbuf:
                batch["collectives"] = columnar(cbuf, COLLECTIVE_FIELDS)
            if first:
                batch["ranks"] = hosts
                if events:
                    batch["events"] = events
                first = False
            c.ingest(batch)
            buf, cbuf = [], []

        for step, rows in rank_step_rows(spec):
            if transform is not None:
                rows = transform(step, rows)
            buf.extend(rows)
            if collectives:
                crow = collective_rows(spec, step, rows)
                cbuf.extend(coll_transform(step, crow) if coll_transform is not None else crow)
            if len(buf) >= batch_rank_steps:
                flush()
        if buf:
            flush()
    if compact:
        srv.compact()
    return rid


def field_index(name: str) -> int:
    return [f.name for f in RANK_STEP_FIELDS].index(name)


def with_fields(row: tuple, **changes: float) -> tuple:
    r = list(row)
    for k, v in changes.items():
        r[field_index(k)] = v
    return tuple(r)


class Receiver:
    """A local HTTP endpoint on 127.0.0.1 that records POSTed JSON bodies (Slack / webhook stand-in)."""

    def __init__(self, status: int = 200) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.status = status
        self.bodies: list[Any] = []
        self.paths: list[str] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                rec.paths.append(self.path)
                rec.bodies.append(json.loads(raw or b"null"))
                self.send_response(rec.status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok" if rec.status == 200 else b"error")

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self._t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._t.start()

    def wait(self, n: int, timeout: float = 20.0) -> list[Any]:
        import time

        deadline = time.monotonic() + timeout
        while len(self.bodies) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.bodies

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def scale_rows(factor: float, from_step: int, fields: tuple[str, ...] = ("step_s", "compute_s", "forward_s",
                                                                            "backward_s", "optimizer_s")) -> Any:
    """A ``load(transform=...)`` that makes every rank slower by ``factor`` from ``from_step`` on."""
    names = [f.name for f in RANK_STEP_FIELDS]
    idx = [names.index(f) for f in fields]

    def tf(step: int, rows: list[tuple]) -> list[tuple]:
        if step < from_step:
            return rows
        out = []
        for r in rows:
            r = list(r)
            for i in idx:
                r[i] = r[i] * factor
            out.append(tuple(r))
        return out

    return tf
