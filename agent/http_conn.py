"""One keep-alive HTTP(S) connection to the fleetscope server, standard library only (``http.client``).

It knows nothing of the API: ``request`` returns the status, headers and (bounded) body of one
answer, or raises ``ConnectionFailed`` when there is no valid HTTP answer. What an answer means, and
whether to retry, is the delivery policy's business (``api_client.py``, ``delivery.py``).
"""

from __future__ import annotations

import http.client
import socket
from dataclasses import dataclass

from .urls import split_server_url

__all__ = ["Connection", "ConnectionFailed", "Response", "MAX_BODY"]

MAX_BODY = 1 << 20  # read at most this much of an answer; the API's answers are small
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class ConnectionFailed(Exception):
    """No valid HTTP answer: refused, reset, timed out, or not HTTP at all."""


@dataclass
class Response:
    """One HTTP answer: status, lower-cased headers, at most ``MAX_BODY`` bytes of body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Connection:
    """One keep-alive HTTP(S) connection to the server, reopened after any failure."""

    def __init__(self, base_url: str) -> None:
        u = split_server_url(base_url)  # ValueError for anything but http(s)://host[:port][/prefix]
        self._https = u.https
        self._host = u.host
        self._port = u.port
        self._prefix = u.prefix
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], timeout: float) -> Response:
        """Send one request (``path`` under the URL's prefix) and read the answer within ``timeout``."""
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, self._port, timeout=timeout)
            conn = self._conn
            try:
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.request(method, self._prefix + path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read(MAX_BODY)
                if r.will_close or not r.isclosed():
                    self.close()  # the server closes it, or we did not read it all: do not reuse
                return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
            except (OSError, http.client.HTTPException, ValueError) as e:
                self.close()
                if attempt == 0 and reused and isinstance(e, _STALE):
                    continue  # the server dropped an idle keep-alive connection: one fresh try
                raise ConnectionFailed(f"{type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def abort(self) -> None:
        """Break an in-flight request from another thread (shutdown makes the blocked call return)."""
        conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass
