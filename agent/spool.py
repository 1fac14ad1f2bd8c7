"""The agent's disk spool: append-only segment files of checksummed frames, size-capped, shared safely.

A frame is ``header + payload``; the header is ``MAGIC, payload length, record count, crc32`` (little
endian, 16 bytes) and the crc covers length, count and payload, so a torn or flipped frame is found and
skipped, never trusted. The payload is zlib(msgpack) of ``{"v": 1, "run_info": {...}, "batch": {...}}``
(or ``"finish": status``): everything needed to register the run and send the batch on replay.

Files (one writer each, named after their owner so ranks on one host can share a directory)::

    <created_ns:020d>_<host>_<pid>_<instance>_<random>.part    being written (O_APPEND, unbuffered)
    <created_ns:020d>_<host>_<pid>_<instance>_<random>.spool   sealed: fsynced, then atomically renamed

Names sort by creation time, so reading them sorted replays in order. fsync policy: every frame goes
to the OS at once (a crash of the process loses nothing written); a segment is fsynced when it is
sealed (size reached, before a replay, at close/exit), and the directory after the rename. A power
loss can therefore lose the frames of the one open segment (at most ``segment_max_bytes``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MAGIC",
    "Frame",
    "Segment",
    "Spool",
    "default_spool_dir",
    "encode_frame",
    "read_segment",
    "parse_name",
    "pid_alive",
    "to_plain",
    "host_name",
    "SEALED_SUFFIX",
    "OPEN_SUFFIX",
    "CORRUPT_SUFFIX",
]

logger = logging.getLogger(__name__)

MAGIC = b"FSP\x01"
_HEADER = struct.Struct("<4sIII")  # magic, payload length, records, crc32(length, records, payload)
_LEN_REC = struct.Struct("<II")
SEALED_SUFFIX = ".spool"
OPEN_SUFFIX = ".part"
CORRUPT_SUFFIX = ".corrupt"
_NAME = re.compile(r"^(\d{20})_([A-Za-z0-9.-]+)_(\d+)_([0-9a-f]+)_([0-9a-f]+)$")


def default_spool_dir() -> Path:
    """The per-user cache dir (``$XDG_CACHE_HOME`` or ``~/.cache``) / fleetscope / spool."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fleetscope" / "spool"


def host_name() -> str:
    """This host's name as used in segment file names."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname() or "host")[:64] or "host"


def pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this host (conservative: unknown counts as alive)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def parse_name(name: str) -> dict[str, Any] | None:
    """Split a segment file name into created_ns, host, pid, instance, rand, suffix (None if foreign)."""
    for suffix in (SEALED_SUFFIX, OPEN_SUFFIX):
        if name.endswith(suffix):
            m = _NAME.match(name[: -len(suffix)])
            if m is None:
                return None
            created, host, pid, inst, rand = m.groups()
            return {
                "created_ns": int(created),
                "host": host,
                "pid": int(pid),
                "instance": inst,
                "rand": rand,
                "suffix": suffix,
            }
    return None


def to_plain(obj: Any) -> Any:
    """msgpack ``default=``: numpy/torch scalars become Python numbers, anything else its str()."""
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:
            pass
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    return str(obj)


def encode_frame(payload: dict[str, Any], records: int) -> bytes:
    """One frame: header + zlib(msgpack(payload))."""
    import msgpack

    blob = zlib.compress(msgpack.packb(payload, use_bin_type=True, default=to_plain), 1)
    lr = _LEN_REC.pack(len(blob), records)
    crc = zlib.crc32(blob, zlib.crc32(lr))
    return _HEADER.pack(MAGIC, len(blob), records, crc) + blob


#: a frame holds one batch (a few MiB decoded); a frame that decodes past this is not the agent's
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
#: segments are capped by ``spool_segment_max_bytes`` (8 MiB by default); reading refuses files past this
MAX_SEGMENT_FILE_BYTES = 1024 * 1024 * 1024


@dataclass
class Frame:
    """One intact frame of a segment; ``payload()`` decodes it."""

    offset: int
    records: int
    blob: bytes

    def payload(self) -> dict[str, Any]:
        """Decode the frame; ValueError if the (checksummed) bytes still do not decode."""
        import msgpack

        try:
            d = zlib.decompressobj()
            raw = d.decompress(self.blob, MAX_PAYLOAD_BYTES + 1)
            if len(raw) > MAX_PAYLOAD_BYTES or d.unconsumed_tail:
                raise ValueError(f"decompresses past {MAX_PAYLOAD_BYTES} bytes (not a frame this agent wrote)")
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as e:  # zlib.error, msgpack's exceptions: all mean "not a frame of ours"
            raise ValueError(f"undecodable payload: {type(e).__name__}: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("run_info"), dict):
            raise ValueError("payload is not a spool frame (no run_info)")
        return obj


@dataclass
class Segment:
    """What a segment file holds: its intact frames, in order, and what was skipped."""

    path: Path
    frames: list[Frame] = field(default_factory=list)
    corrupt: list[tuple[int, str]] = field(default_factory=list)  # (offset, why)

    @property
    def records(self) -> int:
        return sum(f.records for f in self.frames)


def _iter_frames(data: bytes) -> Iterator[Frame | tuple[int, str]]:
    pos, n = 0, len(data)
    hs = _HEADER.size
    while pos < n:
        if n - pos < hs:
            yield (pos, f"torn frame header ({n - pos} bytes at the end)")
            return
        magic, length, records, crc = _HEADER.unpack_from(data, pos)
        why = None
        if magic != MAGIC:
            why = "bad magic"
        elif pos + hs + length > n:
            why = f"torn frame (needs {length} payload bytes, {n - pos - hs} left)"
        else:
            blob = data[pos + hs : pos + hs + length]
            if zlib.crc32(blob, zlib.crc32(_LEN_REC.pack(length, records))) == crc:
                yield Frame(pos, records, blob)
                pos += hs + length
                continue
            why = "checksum mismatch"
        # resynchronise on the next magic; a false match fails its checksum in turn
        nxt = data.find(MAGIC, pos + 1)
        yield (pos, why)
        if nxt < 0:
            return
        pos = nxt


def read_segment(path: str | os.PathLike[str]) -> Segment:
    """Read every intact frame of a segment file in order; corrupt or torn frames are listed, never raised."""
    p = Path(path)
    seg = Segment(p)
    size = p.stat().st_size
    if size > MAX_SEGMENT_FILE_BYTES:  # the agent's own segments are capped far below this
        seg.corrupt.append((0, f"segment file of {size} bytes is larger than any the agent writes; not read"))
        return seg
    data = p.read_bytes()
    for item in _iter_frames(data):
        if isinstance(item, Frame):
            seg.frames.append(item)
        else:
            seg.corrupt.append(item)
    return seg


class Spool:
    """The segments one process writes (and adopts), capped at ``max_bytes``; thread-safe, fork-aware."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.segment_max_bytes = max(1, min(int(segment_max_bytes), self.max_bytes or 1))
        self._lock = threading.Lock()
        self._new_owner()

    def _new_owner(self) -> None:
        self.host = host_name()
        self.pid = os.getpid()
        self.instance = secrets.token_hex(4)
        self._fd: int | None = None
        self._open_path: Path | None = None
        self._open_size = 0
        self._open_records = 0
        self._sealed: list[tuple[Path, int, int]] = []  # (path, bytes, records), oldest first
        self.evicted_segments = 0

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's segments and descriptors; write under the child's pid."""
        fd = self._fd
        self._lock = threading.Lock()
        self._new_owner()
        if fd is not None:
            try:
                os.close(fd)  # the child's copy only; the parent's descriptor is untouched
            except OSError:
                pass

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        """Bytes this spool holds on disk (its sealed segments and the open one)."""
        return sum(s for _, s, _ in self._sealed) + self._open_size

    @property
    def records(self) -> int:
        """Records this spool holds on disk."""
        return sum(r for _, _, r in self._sealed) + self._open_records

    def has_pending(self) -> bool:
        """Whether anything awaits replay (cheap: no disk access)."""
        return bool(self._sealed) or self._open_size > 0

    # -- writing ----------------------------------------------------------------------------------

    def _name(self, created_ns: int, rand: str, suffix: str) -> Path:
        return self.directory / f"{created_ns:020d}_{self.host}_{self.pid}_{self.instance}_{rand}{suffix}"

    def append(self, payload: dict[str, Any], records: int) -> tuple[bool, int]:
        """Write one frame; returns (written, records evicted from the oldest segments to make room).

        ``written`` is False when the frame alone exceeds the cap. OSError (disk full, permissions)
        propagates after the segment was truncated back to its last whole frame.
        """
        frame = encode_frame(payload, records)
        with self._lock:
            if len(frame) > self.max_bytes:
                return False, 0
            if self._fd is not None and self._open_size + len(frame) > self.segment_max_bytes:
                self._seal_locked()
            evicted = 0
            while self.bytes + len(frame) > self.max_bytes:
                if self._sealed:
                    evicted += self._evict_oldest_locked()
                elif self._fd is not None:
                    self._seal_locked()
                else:  # pragma: no cover - bytes is 0 here and the frame fits
                    break
            if self._fd is None:
                self._open_locked()
            assert self._fd is not None
            try:
                view = memoryview(frame)
                while view:
                    k = os.write(self._fd, view)
                    view = view[k:]
            except OSError:
                try:
                    os.ftruncate(self._fd, self._open_size)
                except OSError:
                    pass
                raise
            self._open_size += len(frame)
            self._open_records += records
            return True, evicted

    def _open_locked(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._name(time.time_ns(), secrets.token_hex(4), OPEN_SUFFIX)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self._open_path = path
        self._open_size = 0
        self._open_records = 0

    def _seal_locked(self) -> None:
        fd, path = self._fd, self._open_path
        if fd is None or path is None:
            return
        self._fd = None
        self._open_path = None
        size, records = self._open_size, self._open_records
        self._open_size = self._open_records = 0
        try:
            if size:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not size:
            _unlink(path)
            return
        sealed = path.with_name(path.name[: -len(OPEN_SUFFIX)] + SEALED_SUFFIX)
        os.rename(path, sealed)
        _fsync_dir(self.directory)
        self._sealed.append((sealed, size, records))

    def _evict_oldest_locked(self) -> int:
        path, _, records = self._sealed.pop(0)
        _unlink(path)
        self.evicted_segments += 1
        return records

    def seal(self) -> None:
        """Close the open segment: fsync, atomic rename to ``.spool``, fsync the directory."""
        with self._lock:
            self._seal_locked()

    def close(self, timeout: float | None = None) -> bool:
        """Seal (fsync) the open segment; False if the lock was not free within ``timeout``."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            self._seal_locked()
            return True
        finally:
            self._lock.release()

    # -- replay -----------------------------------------------------------------------------------

    def pending(self) -> list[Path]:
        """Own segments awaiting replay, oldest first (the open one is sealed first)."""
        with self._lock:
            self._seal_locked()
            self._sealed.sort(key=lambda s: s[0].name)
            return [p for p, _, _ in self._sealed]

    def remove(self, path: Path) -> None:
        """Delete a segment whose frames were all accepted (or skipped as corrupt)."""
        with self._lock:
            self._sealed = [s for s in self._sealed if s[0] != path]
        _unlink(path)

    def forget(self, path: Path) -> None:
        """Stop tracking a segment that vanished (taken by ``fleetscope upload`` or another process)."""
        with self._lock:
            self._sealed = [s for s in self._sealed if s[0] != path]

    def adopt_orphans(self) -> int:
        """Take over segments left by dead processes of this host (atomic rename); returns how many."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return 0
        adopted = 0
        for name in names:
            info = parse_name(name)
            if info is None or info["host"] != self.host:
                continue
            if info["pid"] == self.pid or pid_alive(info["pid"]):
                continue
            src = self.directory / name
            dst = self._name(info["created_ns"], info["rand"], SEALED_SUFFIX)
            try:
                os.rename(src, dst)  # whoever renames first owns it
            except OSError:
                continue
            try:
                seg = read_segment(dst)
                size = dst.stat().st_size
            except OSError:
                continue
            with self._lock:
                self._sealed.append((dst, size, seg.records))
                self._sealed.sort(key=lambda s: s[0].name)
            adopted += 1
        if adopted:
            _fsync_dir(self.directory)
        return adopted


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
