"""Pure-Python interval arithmetic on sorted, disjoint half-open intervals ``[start, end)``.

An interval list is a pair of parallel lists ``(starts, ends)``, sorted and disjoint (touching
intervals are merged). These helpers serve the per-step decomposition and the overlap sweeps; the
bulk merge of all GPU events (HTA's ``merge_kernel_intervals``) is in ``analysis._merge``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable

__all__ = [
    "IntervalList",
    "IntervalSet",
    "from_pairs",
    "measure",
    "clip",
    "intersect",
    "union",
    "difference",
    "label_sweep",
]

IntervalList = tuple[list[float], list[float]]

EMPTY: IntervalList = ([], [])


def from_pairs(pairs: Iterable[tuple[float, float]]) -> IntervalList:
    """Merge arbitrary ``(start, end)`` pairs (empty or negative ones dropped) into an interval list."""
    starts: list[float] = []
    ends: list[float] = []
    for s, e in sorted(p for p in pairs if p[1] > p[0]):
        if ends and s <= ends[-1]:
            if e > ends[-1]:
                ends[-1] = e
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def measure(iv: IntervalList) -> float:
    """Total length."""
    return sum(iv[1]) - sum(iv[0])


def clip(iv: IntervalList, lo: float, hi: float) -> IntervalList:
    """The part of ``iv`` inside ``[lo, hi)``."""
    starts, ends = iv
    if hi <= lo or not starts:
        return [], []
    i = bisect_right(ends, lo)  # first interval ending after lo
    j = bisect_left(starts, hi)  # first interval starting at/after hi
    if i >= j:
        return [], []
    s = list(starts[i:j])
    e = list(ends[i:j])
    if s[0] < lo:
        s[0] = lo
    if e[-1] > hi:
        e[-1] = hi
    return s, e


def intersect(a: IntervalList, b: IntervalList) -> IntervalList:
    """``a ∩ b``."""
    (as_, ae), (bs, be) = a, b
    out_s: list[float] = []
    out_e: list[float] = []
    i = j = 0
    while i < len(as_) and j < len(bs):
        lo = as_[i] if as_[i] > bs[j] else bs[j]
        hi = ae[i] if ae[i] < be[j] else be[j]
        if lo < hi:
            out_s.append(lo)
            out_e.append(hi)
        if ae[i] < be[j]:
            i += 1
        else:
            j += 1
    return out_s, out_e


def union(*lists: IntervalList) -> IntervalList:
    """``a ∪ b ∪ …``."""
    return from_pairs(p for iv in lists for p in zip(iv[0], iv[1], strict=True))


def difference(a: IntervalList, b: IntervalList) -> IntervalList:
    """``a \\ b``."""
    (as_, ae), (bs, be) = a, b
    out_s: list[float] = []
    out_e: list[float] = []
    j = 0
    for s, e in zip(as_, ae, strict=True):
        while j < len(bs) and be[j] <= s:
            j += 1
        cur = s
        k = j
        while k < len(bs) and bs[k] < e:
            if bs[k] > cur:
                out_s.append(cur)
                out_e.append(bs[k])
            if be[k] > cur:
                cur = be[k]
            k += 1
        if cur < e:
            out_s.append(cur)
            out_e.append(e)
    return out_s, out_e


def label_sweep(layers: dict[int, IntervalList]) -> dict[int, float]:
    """Time during which exactly the set of layers ``mask`` (bitwise OR of their keys) is active.

    Same result as HTA's +value/-value cumulative sweep: the state after all boundaries at one
    instant is what holds until the next instant, so the order of ties does not matter.
    """
    points: dict[float, int] = {}
    for bit, (starts, ends) in layers.items():
        for s in starts:
            points[s] = points.get(s, 0) + bit
        for e in ends:
            points[e] = points.get(e, 0) - bit
    out: dict[int, float] = {}
    running = 0
    prev: float | None = None
    for t in sorted(points):
        if prev is not None and running > 0:
            out[running] = out.get(running, 0) + (t - prev)
        running += points[t]
        prev = t
    return out


class IntervalSet:
    """An online union of intervals that arrive in any order (CPU-side sets: data loading, CPU ops).

    Arrivals are appended to a small buffer (a few array appends per event); every 64k arrivals the
    buffer is sorted and folded into the union, kept as two ``array('d')`` columns (16 bytes per
    disjoint interval). Memory: the union's size plus at most one buffer.
    """

    __slots__ = ("starts", "ends", "_ps", "_pe")

    _FOLD = 1 << 16

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")
        self._ps = array("d")
        self._pe = array("d")

    def __len__(self) -> int:
        self._fold()
        return len(self.starts)

    def add(self, s: float, e: float) -> None:
        if e <= s:
            return
        self._ps.append(s)
        self._pe.append(e)
        if len(self._ps) >= self._FOLD:
            self._fold()

    def _fold(self) -> None:
        ps, pe = self._ps, self._pe
        if not ps:
            return
        order = sorted(range(len(ps)), key=ps.__getitem__)
        old_s, old_e = self.starts, self.ends
        out_s = array("d")
        out_e = array("d")
        i = 0
        n_old = len(old_s)
        for k in order:
            s, e = ps[k], pe[k]
            while i < n_old and old_s[i] <= s:  # existing intervals that start first
                _push(out_s, out_e, old_s[i], old_e[i])
                i += 1
            _push(out_s, out_e, s, e)
        while i < n_old:
            _push(out_s, out_e, old_s[i], old_e[i])
            i += 1
        self.starts, self.ends = out_s, out_e
        self._ps = array("d")
        self._pe = array("d")

    def clipped(self, lo: float, hi: float) -> IntervalList:
        """The part inside ``[lo, hi)``, as an interval list."""
        self._fold()
        return clip((self.starts, self.ends), lo, hi)  # type: ignore[arg-type]


def _push(out_s: array, out_e: array, s: float, e: float) -> None:
    """Append ``[s, e)`` (starting at or after the last start) to a disjoint sorted union."""
    if out_s and s <= out_e[-1]:
        if e > out_e[-1]:
            out_e[-1] = e
    else:
        out_s.append(s)
        out_e.append(e)
