"""A tiny loopback stand-in for the fleetscope server's write API, with scripted misbehaviour.

``POST /api/v1/runs`` (idempotent by name), ``POST /api/v1/runs/{id}/finish`` and
``POST /api/v1/ingest`` (gzip + msgpack or JSON) are answered; every accepted batch is decoded and
kept in arrival order. ``plan`` scripts the next ingest answers: "ok", an int status (500, 401, 422,
...), ("status", code, retry_after), ("invalid_row", i) (a 422 naming record i as the server does),
("invalid_loc", section, i) (a 422 naming it in ``detail.loc`` only), "garbage" (not
HTTP), "close" (drop the connection), "hang" (answer nothing until released), "hold" (answer once
released). ``max_records`` makes larger batches get 413.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack

from fleetscope.wire import SECTIONS


class Receiver:
    def __init__(self, token: str = "s3cret-token", port: int = 0) -> None:
        self.token = token
        self.port = port
        self.plan: deque[Any] = deque()
        self.default: Any = "ok"
        self.max_records: int | None = None
        self.offer_encodings: list[str] | None = None  # listed in the registration answer (None: not at all)
        self.takes_zstd = True  # False: a zstd ingest body gets 415, as from a server that lacks it
        self.encodings: list[str] = []  # Content-Encoding of each ingest request, in arrival order
        self.batches: list[dict[str, Any]] = []
        self.runs: dict[str, int] = {}
        self.run_posts: list[dict[str, Any]] = []
        self.finishes: list[tuple[int, str]] = []
        self.log: list[tuple[str, int | str]] = []  # (path, status or behaviour)
        self.ingest_started = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        recv = self

        class Handler(_Handler):
            receiver = recv

        srv = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        srv.daemon_threads = True
        self.port = srv.server_address[1]
        self._server = srv
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and cut every open connection (so keep-alive clients see the outage)."""
        srv, self._server = self._server, None
        self.release.set()
        if srv is not None:
            srv.shutdown()
            srv.server_close()
        with self.lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.release = threading.Event()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- what arrived ----------------------------------------------------------------------------

    def rows(self, section: str = "rank_steps") -> list[dict[str, Any]]:
        """All records of a columnar section, in arrival order, as dicts."""
        out: list[dict[str, Any]] = []
        with self.lock:
            batches = list(self.batches)
        for b in batches:
            sec = b.get(section)
            if not sec:
                continue
            names = list(sec)
            for values in zip(*(sec[n] for n in names), strict=True):
                out.append(dict(zip(names, values, strict=True)))
        return out

    def events(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e for b in self.batches for e in b.get("events", [])]

    def ingest_requests(self) -> int:
        with self.lock:
            return sum(1 for p, _ in self.log if p == "/api/v1/ingest")


def _records(batch: dict[str, Any]) -> int:
    n = 0
    for key in (*SECTIONS, "ranks", "events"):
        v = batch.get(key)
        if isinstance(v, dict):
            n += len(next(iter(v.values()), []))
        elif v:
            n += len(v)
    return n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    receiver: Receiver

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle/delayed-ACK stalls
        with self.receiver.lock:
            self.receiver._conns.add(self.connection)

    def finish(self) -> None:
        with self.receiver.lock:
            self.receiver._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _answer(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        r = self.receiver
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        path = self.path
        if self.headers.get("Authorization") != f"Bearer {r.token}":
            with r.lock:
                r.log.append((path, 401))
            self._answer(401, {"detail": "missing or invalid bearer token"})
            return
        encoding = self.headers.get("Content-Encoding") or ""
        if path == "/api/v1/ingest":
            with r.lock:
                r.encodings.append(encoding)
            if encoding == "zstd" and not r.takes_zstd:
                with r.lock:
                    r.log.append((path, 415))
                self._answer(415, {"detail": "unsupported encoding 'zstd' (use gzip or none)"})
                return
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        if self.headers.get("Content-Type") == "application/msgpack":
            doc = msgpack.unpackb(raw, raw=False)
        else:
            doc = json.loads(raw or b"null")
        if path == "/api/v1/runs":
            with r.lock:
                r.run_posts.append(doc)
                created = doc["name"] not in r.runs
                rid = r.runs.setdefault(doc["name"], len(r.runs) + 1)
                r.log.append((path, 200))
            answer = {"id": rid, "name": doc["name"], "created": created}
            if r.offer_encodings is not None:
                answer["ingest_encodings"] = r.offer_encodings
            self._answer(200, answer)
            return
        if path.startswith("/api/v1/runs/") and path.endswith("/finish"):
            rid = int(path.split("/")[4])
            with r.lock:
                r.finishes.append((rid, doc["status"]))
                r.log.append((path, 200))
            self._answer(200, {"id": rid, "status": doc["status"]})
            return
        if path != "/api/v1/ingest":
            self._answer(404, {"detail": "not found"})
            return
        with r.lock:
            behaviour = r.plan.popleft() if r.plan else r.default
            r.log.append(
                (
                    path,
                    behaviour
                    if isinstance(behaviour, (int, str))
                    else 422
                    if behaviour[0] in ("invalid_row", "invalid_loc")
                    else behaviour[1],
                )
            )
        r.ingest_started.set()
        if behaviour == "hang":
            r.release.wait(30)
            self.close_connection = True
            return
        if behaviour == "close":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if behaviour == "garbage":
            self.wfile.write(b"\x00\x01 this is not HTTP at all\r\n\r\n")
            self.close_connection = True
            return
        if behaviour == "hold":  # answer normally, but only once released
            r.release.wait(30)
            behaviour = "ok"
        if isinstance(behaviour, tuple) and behaviour[0] == "invalid_row":  # 422 naming one record
            where = f"rank_steps.step_s[{behaviour[1]}]"  # as the server says it (server/validate.py)
            loc = {"section": "rank_steps", "index": behaviour[1], "field": "step_s"}
            self._answer(422, {"detail": {"error": f"{where}: must be >= 0", "where": where, "loc": loc, "got": -1.0}})
            return
        if isinstance(behaviour, tuple) and behaviour[0] == "invalid_loc":  # the structured location only
            loc = {"section": behaviour[1], "index": behaviour[2], "field": None}
            self._answer(422, {"detail": {"error": "a record is invalid", "loc": loc}})
            return
        if isinstance(behaviour, tuple):
            _, status, retry_after = behaviour
            self._answer(status, {"detail": "busy"}, {"Retry-After": str(retry_after)})
            return
        if isinstance(behaviour, int):
            loc = {"section": "rank_steps", "index": None, "field": "step_s"}  # no single record named
            detail: Any = {"error": "rank_steps.step_s[0]: must be >= 0", "where": "rank_steps.step_s", "loc": loc}
            self._answer(behaviour, {"detail": detail if behaviour == 422 else "no"})
            return
        if r.max_records is not None and _records(doc) > r.max_records:
            with r.lock:
                r.log[-1] = (path, 413)
            self._answer(413, {"detail": "batch too large"})
            return
        if doc.get("run_id") not in r.runs.values():
            loc = {"section": None, "index": None, "field": "run_id"}
            self._answer(422, {"detail": {"error": "run_id: unknown run", "where": "run_id", "loc": loc}})
            return
        with r.lock:
            r.batches.append(doc)
        self._answer(200, {"run_id": doc["run_id"], "accepted": {}})
