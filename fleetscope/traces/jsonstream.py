"""Streaming JSON for trace files: open (gzip by magic bytes), scan the header, stream the event
list one object at a time (ijson's C backend, else a chunked stdlib decoder), and turn every failure
into a ``TraceError`` that names the file, what is wrong and where."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from .errors import TraceError

__all__ = ["stream_events", "ijson_backend"]

_CHUNK = 1 << 16
_TAIL_BYTES = 1 << 20
_DIST_RE = re.compile(rb'"distributedInfo"\s*:\s*')


def stream_events(path: str, source: str, consume: Callable[[Iterator[Any]], None]) -> dict[str, Any]:
    """Call ``consume(events)`` with the file's events, streamed; returns the ``distributedInfo.*``
    metadata (read before the events, or from the last ~1 MiB when written after them)."""
    try:
        if os.path.getsize(path) == 0:
            raise TraceError(source, "empty file")
    except FileNotFoundError:
        raise TraceError(source, "no such file") from None
    except OSError as e:
        raise TraceError(source, f"cannot read: {e.strerror or e}") from None
    prefix, meta = _header(path, source)
    stream, raw = _open(path, source)
    reader = _CountingReader(stream, source)
    ij = ijson_backend()
    try:
        with raw:
            if ij is not None:
                consume(ij.items(io.BufferedReader(reader, _CHUNK), prefix, use_float=True))
            else:
                consume(_events_stdlib(reader, source, meta, prefix))
    except TraceError:
        raise
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise _stream_error(e, source, raw, reader) from None
    except Exception as e:  # noqa: BLE001 - ijson / decoder errors
        if type(e).__module__.startswith("ijson") or isinstance(e, ValueError):
            raise _stream_error(e, source, raw, reader) from None
        raise
    if "distributedInfo.rank" not in meta and ij is not None:
        meta.update(_trailing_distributed_info(reader.tail_bytes()))
    return meta


#: deepest nesting a trace may have (real traces: ~6); the streaming parser's memory grows with the
#: square of the depth (20,000 levels in a 40 KB file cost ~1 GB), so deeper documents are refused
MAX_DEPTH = 1000
_BLOCK = 8192
_BRACKETS = re.compile(rb"[\[\]{}]")


class _DepthGuard:
    """Running bracket depth of the bytes fed so far, refused past ``MAX_DEPTH``.

    Counted in C per 8 KiB block (``bytes.count``); only a block whose upper bound passes the limit is
    scanned bracket by bracket. Brackets inside strings are counted too: a real trace would need a
    thousand unbalanced ones in its strings to be refused."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.depth = 0
        self.pos = 0

    def feed(self, b: bytes) -> None:
        for i in range(0, len(b), _BLOCK):
            block = b[i:i + _BLOCK]
            opens = block.count(b"[") + block.count(b"{")
            closes = block.count(b"]") + block.count(b"}")
            if self.depth + opens > MAX_DEPTH:
                d = self.depth
                for m in _BRACKETS.finditer(block):
                    d += 1 if m.group() in (b"[", b"{") else -1
                    if d > MAX_DEPTH:
                        raise TraceError(self.source, f"JSON nested deeper than {MAX_DEPTH} levels near byte "
                                                      f"{self.pos + i + m.start()}: not a trace")
            self.depth = max(0, self.depth + opens - closes)
        self.pos += len(b)


class _CountingReader(io.RawIOBase):
    """Counts the bytes handed to the JSON parser, keeps the last ~1 MiB (trailing metadata) and refuses
    nesting deeper than ``MAX_DEPTH``."""

    def __init__(self, inner: BinaryIO, source: str = "trace") -> None:
        self.inner = inner
        self.guard = _DepthGuard(source)
        self.pos = 0
        self.tail: deque[bytes] = deque()
        self._tail_len = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        b = self.inner.read(n if n and n > 0 else _CHUNK)
        self.guard.feed(b)
        self.pos += len(b)
        if b:
            self.tail.append(b)
            self._tail_len += len(b)
            while self._tail_len - len(self.tail[0]) >= _TAIL_BYTES:
                self._tail_len -= len(self.tail.popleft())
        return b

    def readinto(self, buf: Any) -> int:
        b = self.read(len(buf))
        buf[: len(b)] = b
        return len(b)

    def tail_bytes(self) -> bytes:
        return b"".join(self.tail)


def _open(path: str, source: str) -> tuple[BinaryIO, BinaryIO]:
    """(decompressed stream, raw file) — gzip is detected by its magic bytes, not the suffix."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except FileNotFoundError:
        raise TraceError(source, "no such file") from None
    except OSError as e:
        raise TraceError(source, f"cannot open: {e.strerror or e}") from None
    head = raw.read(2)
    raw.seek(0)
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw  # type: ignore[return-value]
    return raw, raw


def _stream_error(e: BaseException, source: str, raw: BinaryIO, reader: _CountingReader) -> TraceError:
    if isinstance(e, EOFError):
        return TraceError(source, f"truncated gzip stream at byte {_tell(raw)} (of the compressed file)")
    if isinstance(e, (zlib.error, gzip.BadGzipFile)):
        return TraceError(source, f"corrupt gzip stream at byte {_tell(raw)}: {e}")
    if isinstance(e, UnicodeDecodeError):
        return TraceError(source, f"not UTF-8 text near byte {reader.pos}")
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "premature EOF" in msg or ("Incomplete" in type(e).__name__ and "EOF" in msg):
        return TraceError(
            source, f"truncated JSON: the document ends at byte {reader.pos} before it is complete"
        )
    return TraceError(source, f"invalid JSON near byte {reader.pos}: {msg}")


def _tell(raw: BinaryIO) -> int:
    try:
        return raw.tell()
    except (OSError, ValueError):
        return -1


def ijson_backend() -> Any:
    try:
        import ijson  # noqa: PLC0415 - optional, C backend preferred
    except ImportError:
        return None
    try:
        return ijson.get_backend("yajl2_c")
    except Exception:  # noqa: BLE001 - any backend works, the C one is just faster
        return ijson


def _header(path: str, source: str) -> tuple[str, dict[str, Any]]:
    """Scan the keys before the event list: returns (prefix of the events, metadata seen so far)."""
    stream, raw = _open(path, source)
    reader = _CountingReader(stream, source)
    meta: dict[str, Any] = {}
    ij = ijson_backend()
    try:
        with raw:
            if ij is None:
                return "traceEvents.item", meta  # the stdlib path reads metadata while streaming
            first = True
            for prefix, event, value in ij.parse(io.BufferedReader(reader, _CHUNK)):
                if first:
                    first = False
                    if event == "start_array":
                        return "item", meta  # Chrome's "JSON Array Format": a bare list of events
                    if event != "start_map":
                        raise TraceError(
                            source, f"not a trace: the document is a JSON {event}, not an object"
                        )
                if prefix == "" and event == "map_key" and value == "traceEvents":
                    return "traceEvents.item", meta
                if prefix.startswith("distributedInfo.") and event in ("number", "string"):
                    meta[prefix] = value
            if first:
                raise TraceError(source, "empty document")
            raise TraceError(source, "no 'traceEvents' array: not a Kineto/Chrome trace")
    except TraceError:
        raise
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise _stream_error(e, source, raw, reader) from None
    except Exception as e:  # noqa: BLE001 - ijson raises its own JSONError types
        if type(e).__module__.startswith("ijson") or isinstance(e, ValueError):
            raise _stream_error(e, source, raw, reader) from None
        raise


def _events_stdlib(reader: _CountingReader, source: str, meta: dict[str, Any], prefix: str) -> Iterator[Any]:
    """Fallback without ijson: a chunked decoder over the event list (still one event at a time)."""
    dec = json.JSONDecoder()
    text = io.TextIOWrapper(io.BufferedReader(reader, _CHUNK), encoding="utf-8")
    buf = ""
    pos = 0
    eof = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        more = text.read(_CHUNK)
        if not more:
            eof = True
            return False
        buf = buf[pos:] + more
        pos = 0
        return True

    def skip_ws() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not fill():
                return

    def value() -> Any:
        nonlocal pos
        skip_ws()
        while True:
            try:
                v, end = dec.raw_decode(buf, pos)
                if end == len(buf) and not eof and fill():
                    continue  # a number may continue in the next chunk
                pos = end
                return v
            except json.JSONDecodeError as e:
                if not eof and fill():
                    continue
                if e.pos >= len(buf.rstrip()) or e.msg.startswith("Unterminated"):
                    raise ValueError("premature EOF") from None  # the document just stops
                raise ValueError(f"{e.msg}") from None

    def expect(ch: str) -> None:
        nonlocal pos
        skip_ws()
        if pos >= len(buf):
            raise ValueError("premature EOF")
        if buf[pos] != ch:
            raise ValueError(f"expected {ch!r}, got {buf[pos]!r}")
        pos += 1

    fill()
    skip_ws()
    if prefix == "item":
        expect("[")
    else:
        expect("{")
        found = False
        while not found:
            skip_ws()
            if pos < len(buf) and buf[pos] == "}":
                raise ValueError("no 'traceEvents' array")
            key = value()
            expect(":")
            if key == "traceEvents":
                found = True
                expect("[")
            else:
                v = value()
                if key == "distributedInfo" and isinstance(v, dict):
                    meta.update({f"distributedInfo.{k}": x for k, x in v.items()})
                skip_ws()
                if pos < len(buf) and buf[pos] == ",":
                    pos += 1
    skip_ws()
    if pos < len(buf) and buf[pos] == "]":
        pos += 1
    else:
        while True:
            yield value()
            skip_ws()
            if pos >= len(buf):
                raise ValueError("premature EOF")
            if buf[pos] == ",":
                pos += 1
                continue
            if buf[pos] == "]":
                pos += 1
                break
            raise ValueError(f"expected ',' or ']' in traceEvents, got {buf[pos]!r}")
    # the rest of the document: validated, and read for a trailing distributedInfo
    rest = (buf[pos:] + text.read()).strip()
    if prefix == "item":
        if rest:
            raise ValueError(f"unexpected data after the event list: {rest[:20]!r}")
        return
    body = rest.lstrip(",").strip()
    try:
        tail = json.loads("{" + body) if body != "}" else {}
    except json.JSONDecodeError as e:
        raise ValueError("premature EOF" if not rest.endswith("}") else e.msg) from None
    di = tail.get("distributedInfo") if isinstance(tail, dict) else None
    if isinstance(di, dict):
        meta.update({f"distributedInfo.{k}": x for k, x in di.items()})


def _trailing_distributed_info(tail: bytes) -> dict[str, Any]:
    """``distributedInfo`` written after the events (ijson path): look for it in the last ~1 MiB."""
    matches = list(_DIST_RE.finditer(tail))
    if not matches:
        return {}
    m = matches[-1]
    try:
        v, _ = json.JSONDecoder().raw_decode(tail[m.end() :].decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return {}
    return {f"distributedInfo.{k}": x for k, x in v.items()} if isinstance(v, dict) else {}
