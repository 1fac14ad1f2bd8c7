"""``fleetscope.client.Client`` against a misbehaving server (a real HTTP server on 127.0.0.1 in a
thread): every failure is an ``ApiError`` with ``.status``, ``.body`` and the URL path in its message —
HTML, list and string answers, a server that ignores paging, an answer larger than ``max_bytes``
(read streamed: the rest is never downloaded), a body or headers trickled a byte a second (the
``timeout`` is the whole call), 429/503 retried honouring ``Retry-After`` and other 4xx never, an
unreachable server; filter values that look like operators are sent as literals."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pandas as pd
import pytest
from fleetscope.server.store.run_query import Filter, parse_query

from fleetscope.client import ApiError, Client

TRICKLE_BYTES = 40  # the trickled answers take 40 s at a byte a second


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins every handler thread (they end on `stop`)
    block_on_close = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.hits: Counter[str] = Counter()  # requests per scenario
        self.queries: list[list[tuple[str, str]]] = []  # the query strings "record" received
        self.sent: Counter[str] = Counter()  # body bytes written per scenario

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes | str | Any, ctype: str = "application/json", **headers: str) -> None:
        raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(raw)

    def _drip(self, data: bytes, scenario: str) -> None:
        """``data`` a byte a second, until done, the client leaves or the test ends."""
        try:
            for b in data:
                if self.server.stop.wait(1.0):
                    return
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                with self.server.lock:
                    self.server.sent[scenario] += 1
        except OSError:
            return

    def do_GET(self) -> None:  # one branch per misbehaviour
        url = urlsplit(self.path)
        scenario, _, rest = url.path.lstrip("/").partition("/")
        query = parse_qsl(url.query, keep_blank_values=True)
        q = dict(query)
        with self.server.lock:
            self.server.hits[scenario] += 1
            hit = self.server.hits[scenario]
        if scenario == "html":
            self._send(200, "<!doctype html><html><body><h1>Sign in</h1> to continue</body></html>", "text/html")
        elif scenario == "list":
            self._send(200, [1, 2, 3])
        elif scenario == "string":
            self._send(200, json.dumps("hello"))
        elif scenario == "runs-not-list":
            self._send(200, {"runs": "nope", "total": 1})
        elif scenario == "ignores-paging":  # the same first page whatever offset / after says
            if rest.endswith("/steps"):
                self._send(200, {"steps": [{"step": 0}, {"step": 1}], "total": 10**6, "fields": ["step"]})
            elif rest.endswith("nodes"):
                self._send(200, {"nodes": [{"node": "a"}, {"node": "b"}], "total": 10**6})
            else:
                self._send(200, {"runs": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}], "total": 10**6})
        elif scenario == "pages-forever":  # honours offset, but its total never ends
            off, n = int(q["offset"]), int(q["limit"])
            self._send(200, {"runs": [{"id": off + i, "name": f"r{off + i}"} for i in range(n)], "total": 10**9})
        elif scenario == "paged":  # a well-behaved server with 5 runs
            off, n = int(q["offset"]), int(q["limit"])
            runs = [{"id": i, "name": f"r{i}", "config": {"tp": i}} for i in range(5)]
            self._send(200, {"runs": runs[off:off + n], "total": 5})
        elif scenario == "big":  # 1 MiB, declared
            self._send(200, {"pad": "x" * (1 << 20)})
        elif scenario == "endless-body":  # no Content-Length: JSON until the client hangs up (cap 1 GiB)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                self.wfile.write(b'{"pad": "')
                while not self.server.stop.is_set() and self.server.sent[scenario] < (1 << 30):
                    self.wfile.write(chunk)
                    with self.server.lock:
                        self.server.sent[scenario] += len(chunk)
            except OSError:
                return
        elif scenario == "trickle":  # headers at once, then the body a byte a second
            body = json.dumps({"runs": [], "total": 0}).ljust(TRICKLE_BYTES).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            self._drip(body, scenario)
        elif scenario == "trickle-headers":  # the status line, then a header a byte a second
            try:
                self.wfile.write(b"HTTP/1.0 200 OK\r\n")
                self.wfile.flush()
            except OSError:
                return
            self._drip(b"X-Slow: " + b"z" * TRICKLE_BYTES, scenario)
        elif scenario == "busy-once":  # 503 with Retry-After: 0, then the answer
            if hit == 1:
                self._send(503, {"detail": "overloaded"}, Retry_After="0")
            else:
                self._send(200, {"runs": [{"id": 7, "name": "after-retry"}], "total": 1})
        elif scenario == "throttled-once":  # 429 (no Retry-After), then the answer
            if hit == 1:
                self._send(429, {"detail": "slow down"})
            else:
                self._send(200, {"run_id": 3, "mfu": 0.5})
        elif scenario == "busy":
            self._send(503, "upstream busy", "text/plain", Retry_After="0")
        elif scenario == "busy-an-hour":
            self._send(503, {"detail": "maintenance"}, Retry_After="3600")
        elif scenario == "bad-request":
            self._send(400, {"detail": "bad filter config.x"})
        elif scenario == "not-found":
            self._send(404, {"detail": "run 9 not found"})
        elif scenario == "huge-error":
            self._send(500, "<html>" + "E" * 20_000 + "</html>", "text/html")
        elif scenario == "record":
            with self.server.lock:
                self.server.queries.append(query)
            self._send(200, {"runs": [], "total": 0})
        else:
            self._send(404, {"detail": f"no scenario {scenario!r}"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()


@pytest.fixture
def bad_server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stop.set()  # trickles and endless bodies end
        srv.shutdown()
        srv.server_close()  # joins the handler threads
        thread.join(10)
        assert not thread.is_alive()


@pytest.fixture
def client(bad_server: _Server) -> Iterator[Any]:
    made: list[Client] = []

    def make(scenario: str, **kw: Any) -> Client:
        c = Client(f"{bad_server.url}/{scenario}", **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


def _fails(call: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    assert len(e.value.body) <= 500
    return e.value


# ------------------------------------------------------------------ answers that are not the JSON asked for


def test_html_answer_is_an_api_error_naming_the_path(client: Any) -> None:
    c = client("html")
    e = _fails(c.run_list)
    assert e.status == 200 and "/api/v1/runs" in str(e) and "not JSON" in str(e) and "text/html" in str(e)
    assert "<h1>Sign in</h1>" in e.body
    for call in (lambda: c.summary(1), lambda: c.runs(), lambda: c.steps(1), lambda: c.get("/api/v1/runs/1")):
        assert _fails(call).status == 200


def test_list_and_string_answers_are_api_errors(client: Any) -> None:
    lst = client("list")
    e = _fails(lambda: lst.summary(4))
    assert e.status == 200 and "/api/v1/runs/4/summary" in str(e) and "a list" in str(e)
    for call in (lst.runs, lst.run_list, lambda: lst.steps(1), lambda: lst.scalars(1), lst.nodes,
                 lambda: lst.collectives(1), lambda: lst.run_groups("config.tp"), lambda: lst.register_run({"name": "x"})):
        assert isinstance(_fails(call), ApiError)
    assert lst.get("/anything") == [1, 2, 3]  # get() hands back any JSON
    s = client("string")
    e = _fails(s.run_list)
    assert "a string" in str(e) and "'hello'" in e.body
    for call in (s.runs, lambda: s.steps(1), s.alerts, lambda: s.summary(1)):
        assert isinstance(_fails(call), ApiError)
    e = _fails(client("runs-not-list").runs)
    assert "'runs'" in str(e) and "list of objects" in str(e)


# ------------------------------------------------------------------ paging


def test_a_server_ignoring_paging_fails_after_one_repeated_page(client: Any, bad_server: _Server) -> None:
    c = client("ignores-paging")
    e = _fails(lambda: c.runs(page_size=2))
    assert e.status == 200 and "again" in str(e) and "/api/v1/runs" in str(e)
    assert bad_server.hits["ignores-paging"] == 2
    e = _fails(lambda: c.steps(1, page_size=2))
    assert "/api/v1/runs/1/steps" in str(e) and bad_server.hits["ignores-paging"] == 4
    _fails(c.nodes)
    assert bad_server.hits["ignores-paging"] == 6


def test_paging_is_bounded_by_total_and_by_max_pages(client: Any, bad_server: _Server) -> None:
    df = client("paged").runs(page_size=2)
    assert list(df["name"]) == [f"r{i}" for i in range(5)] and list(df["config.tp"]) == list(range(5))
    assert bad_server.hits["paged"] == 3  # 2 + 2 + 1, then total says done
    assert len(client("paged").runs(page_size=2, limit=3)) == 3
    c = client("pages-forever", max_pages=5)
    e = _fails(lambda: c.runs(page_size=10))
    assert "max_pages=5" in str(e) and bad_server.hits["pages-forever"] == 5


# ------------------------------------------------------------------ size


def test_an_answer_over_max_bytes_fails_without_being_read(client: Any, bad_server: _Server) -> None:
    e = _fails(lambda: client("big", max_bytes=64 * 1024).summary(1))
    assert e.status == 200 and "max_bytes=65,536" in str(e) and "/api/v1/runs/1/summary" in str(e)
    assert client("big").summary(1)["pad"] == "x" * (1 << 20)  # the default limit lets it through

    # no Content-Length: the body is read streamed and dropped at the limit, the rest never downloaded
    e = _fails(lambda: client("endless-body", max_bytes=256 * 1024, timeout=60).summary(1))
    assert e.status == 200 and "larger than max_bytes=262,144" in str(e) and e.body.startswith('{"pad": "xxx')
    time.sleep(0.5)
    assert bad_server.sent["endless-body"] < 64 << 20  # of the 1 GiB it would send (socket buffers aside)


# ------------------------------------------------------------------ the deadline


def test_timeout_is_the_whole_call_even_for_a_trickled_body(client: Any) -> None:
    c = client("trickle", timeout=2.0)
    t0 = time.monotonic()
    e = _fails(c.run_list)
    took = time.monotonic() - t0
    assert took < TRICKLE_BYTES / 2, f"the call lasted {took:.1f}s of the {TRICKLE_BYTES}s trickle"
    assert e.status is None and "timeout=2s" in str(e) and "/api/v1/runs" in str(e)


def test_timeout_also_bounds_trickled_headers(client: Any) -> None:
    c = client("trickle-headers", timeout=2.0)
    t0 = time.monotonic()
    e = _fails(lambda: c.summary(1))
    assert time.monotonic() - t0 < TRICKLE_BYTES / 2
    assert e.status is None and "timeout=2s" in str(e)


def test_an_unreachable_server_is_an_api_error_without_status() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it
    with Client(f"http://127.0.0.1:{port}", timeout=5) as c:
        e = _fails(c.run_list)
    assert e.status is None and "/api/v1/runs" in str(e) and "cannot talk to" in str(e)


# ------------------------------------------------------------------ retries


def test_503_with_retry_after_is_retried_and_429_too(client: Any, bad_server: _Server) -> None:
    assert client("busy-once").run_list() == [{"id": 7, "name": "after-retry"}]
    assert bad_server.hits["busy-once"] == 2
    assert client("throttled-once").summary(3)["mfu"] == 0.5
    assert bad_server.hits["throttled-once"] == 2


def test_retries_are_bounded_in_count_and_in_time(client: Any, bad_server: _Server) -> None:
    e = _fails(client("busy", retries=2).run_list)
    assert e.status == 503 and "after 2 retries" in str(e) and "upstream busy" in e.body
    assert bad_server.hits["busy"] == 3
    t0 = time.monotonic()
    e = _fails(client("busy-an-hour", timeout=3).run_list)  # Retry-After: 3600, past the deadline
    assert time.monotonic() - t0 < 60 and e.status == 503 and e.detail.startswith("maintenance")
    assert "not retried" in str(e) and bad_server.hits["busy-an-hour"] == 1
    e = _fails(client("busy-an-hour", timeout=7200).run_list)  # within the deadline, past max_retry_wait
    assert time.monotonic() - t0 < 60 and "max_retry_wait=10s" in str(e) and bad_server.hits["busy-an-hour"] == 2


def test_other_4xx_are_never_retried(client: Any, bad_server: _Server) -> None:
    e = _fails(client("bad-request").run_list)
    assert e.status == 400 and e.detail == "bad filter config.x" and "GET /api/v1/runs" in str(e)
    assert bad_server.hits["bad-request"] == 1
    e = _fails(lambda: client("not-found").summary(9))
    assert e.status == 404 and bad_server.hits["not-found"] == 1
    e = _fails(lambda: client("huge-error").summary(1))  # a 20 KB error page: an excerpt is kept
    assert e.status == 500 and e.body.startswith("<html>EEE") and len(e.body) == 500 and len(str(e)) < 1000


# ------------------------------------------------------------------ filter values are values


def _filters(query: list[tuple[str, str]]) -> list[Filter]:
    return parse_query(query).filters  # the server's own reading of the query string


def test_filter_values_that_look_like_operators_are_sent_as_literals(client: Any, bad_server: _Server) -> None:
    c = client("record")
    assert c.runs(name="gt:x").empty
    got = bad_server.queries[-1]
    assert ("name", "eq:gt:x") in got and _filters(got) == [Filter("name", "=", "gt:x")]
    c.runs(name="plain", family="in:a,b", tag=["ne:t", "ok"], status="finished")
    assert _filters(bad_server.queries[-1]) == [Filter("name", "=", "plain"), Filter("family", "=", "in:a,b"),
                                                Filter("tag", "=", "ne:t"), Filter("tag", "=", "ok"),
                                                Filter("status", "=", "finished")]
    c.runs({"config.opt": "lt:sgd", "config.lr>": 0.1, "config.tp": ("in", [2, 4])})
    assert _filters(bad_server.queries[-1]) == [Filter("config.opt", "=", "lt:sgd"), Filter("config.lr", ">", "0.1"),
                                                Filter("config.tp", "in", ["2", "4"])]
    c.run_list(name="ge:1", sort="-mfu", limit=5)
    got = bad_server.queries[-1]
    assert _filters(got) == [Filter("name", "=", "ge:1")] and ("sort", "-mfu") in got and ("limit", "5") in got
    with pytest.raises(ValueError, match="comma"):
        c.runs({"config.opt": ("in", ["a,b"])})


def test_dataframe_reads_still_work_on_a_good_page(client: Any) -> None:
    df = client("paged").runs()
    assert isinstance(df, pd.DataFrame) and list(df.columns[:2]) == ["id", "name"]


def test_the_real_server_reads_an_operator_looking_name_as_the_name(live_server: Any) -> None:
    with live_server.client() as c:
        for name in ("gt:x", "x", "y", "in:a,b"):
            c.register_run({"name": name, "world_size": 1})
        assert list(c.runs(name="gt:x")["name"]) == ["gt:x"]  # not "names after x" ("y")
        assert [r["name"] for r in c.run_list(name="in:a,b")] == ["in:a,b"]
        assert sorted(c.runs({"name>": "x"})["name"]) == ["y"]  # an operator still is one, from the key
