"""Process groups (``comm_group`` events) in the form ``run_groups`` stores them: once per group, not per rank.

Every rank of a group describes the same group, so a 16,384-rank job whose ranks each report their
data-parallel group would repeat one 16,384-rank list 16,384 times. Here a description becomes one
canonical :class:`Group` keyed by a 16-byte digest of its membership; ingest upserts it once per
(run, dimension, key). Membership is stored compactly:

* an arithmetic progression (the groups of a DeviceMesh: ``start``, ``stride``, ``size``) as those
  three numbers, whatever the size;
* a group of one rank as one row per dimension (every single-rank group spans one node);
* any other set as its sorted ranks, delta-encoded as little-endian int32 and zlib-compressed
  (``encode_ranks`` / ``decode_ranks``); ``listed`` < ``size`` when the sender listed only part of
  it (agents before this change sent the first 256 ranks).

Pure: numbers in, numbers out (validation and its errors are ``server/validate.py``'s).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Group", "from_progression", "from_ranks", "encode_ranks", "decode_ranks", "members"]


@dataclass(frozen=True)
class Group:
    """One group as stored: ``start``/``stride`` for a progression (``ranks`` None), else ``ranks`` (the
    encoded sorted ranks, ``listed`` of them)."""

    dim: str
    key: bytes
    size: int
    start: int | None
    stride: int | None
    ranks: bytes | None
    listed: int
    name: str | None


def _digest(tag: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(tag, digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


def from_progression(dim: str, start: int, stride: int, size: int, name: str | None) -> Group:
    """The group ``start, start + stride, …`` of ``size`` ranks."""
    if size == 1:  # all single-rank groups of a dimension are one row: each spans one node
        return Group(dim, _digest(b"one"), 1, start, 1, None, 1, name)
    return Group(dim, _digest(b"ap", struct.pack("<qqq", start, stride, size)), size, start, stride, None, size, name)


def from_ranks(dim: str, ranks: np.ndarray, size: int, name: str | None) -> Group | None:
    """The group of these global ranks (sorted, unique, int64); ``size`` is the group's size (more than
    ``len(ranks)`` when only part of it was listed). None without any rank."""
    n = len(ranks)
    if n == 0:
        return None
    if n == size:
        if n == 1:
            return from_progression(dim, int(ranks[0]), 1, 1, name)
        d = np.diff(ranks)
        if (d == d[0]).all():
            return from_progression(dim, int(ranks[0]), int(d[0]), n, name)
    body = ranks.astype("<i4").tobytes()
    tag = b"list" if n == size else b"part"
    return Group(dim, _digest(tag, struct.pack("<q", size), body), size, None, None, encode_ranks(ranks), n, name)


def encode_ranks(ranks: np.ndarray) -> bytes:
    """Sorted ranks → zlib(delta-encoded little-endian int32): a few bytes per rank at most."""
    d = np.diff(ranks.astype(np.int64), prepend=0).astype("<i4")
    return zlib.compress(d.tobytes(), 6)


def decode_ranks(blob: bytes, max_ranks: int) -> np.ndarray:
    """The ranks ``encode_ranks`` stored (at most ``max_ranks`` decoded: a stored blob is not trusted)."""
    d = zlib.decompressobj()
    raw = d.decompress(blob, 4 * max_ranks)
    raw = raw[: len(raw) // 4 * 4]
    return np.cumsum(np.frombuffer(raw, dtype="<i4").astype(np.int64))


def members(start: int | None, stride: int | None, size: int, blob: bytes | None, max_ranks: int) -> np.ndarray:
    """A stored group's known ranks (at most ``max_ranks``)."""
    if blob is not None:
        return decode_ranks(blob, max_ranks)
    if start is None:
        return np.empty(0, dtype=np.int64)
    n = min(size, max_ranks)
    return start + (stride or 1) * np.arange(n, dtype=np.int64)
