"""The run summary's ``memory`` section: per-rank peaks, their imbalance, fragmentation, allocator
retries and OOMs (docs/metrics.md, "Memory"). Pure: from the ranks' latest ``memory`` events
(``store.memory``) and, for a run without them (an older agent), the step rollups' figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["memory_summary"]


def _finite(vals: Sequence[float | None]) -> np.ndarray:
    a = np.array([np.nan if v is None else float(v) for v in vals], dtype=np.float64)
    return a[np.isfinite(a) & (a >= 0)]


def memory_summary(ranks: Sequence[Any], *, device_type: str | None, mem_peak_bytes: float | None,
                   alloc_retries: float | None) -> dict[str, Any] | None:
    """``ranks``: rows with ``rank``, ``source``, ``peak_exact`` and the numbers of ``store.memory``.

    ``peak_allocated_max`` / ``_median``: over ranks of each rank's peak (on ``source == "rss"``: the
    process's resident set, not a device allocator); ``imbalance`` = max / median (1 = balanced);
    ``fragmentation_bytes``: the largest over ranks of peak reserved − peak allocated;
    ``alloc_retries`` / ``ooms``: sums over ranks since each rank's first step. None when nothing was
    measured."""
    src_votes = [r.source for r in ranks if r.source in ("cuda", "rss")]
    source = max(set(src_votes), key=src_votes.count) if src_votes else None
    if source is None and (mem_peak_bytes is not None or device_type):
        source = "rss" if device_type == "cpu" else ("cuda" if mem_peak_bytes is not None else None)
    peaks = [(int(r.rank), float(r.peak_allocated_bytes)) for r in ranks if r.peak_allocated_bytes is not None]
    peaks = [(k, p) for k, p in peaks if np.isfinite(p) and p >= 0]
    pk = np.array([p for _, p in peaks], dtype=np.float64)
    if pk.size == 0:
        if mem_peak_bytes is None:
            return None if source is None else {"source": source, "ranks": 0, "peak_allocated_max": None}
        # no per-rank figures (an agent without memory events): the step rollups' max over ranks
        return {"source": source, "ranks": 0, "peak_allocated_max": float(mem_peak_bytes),
                "peak_allocated_median": None, "imbalance": None, "alloc_retries": alloc_retries, "ooms": None,
                "fragmentation_bytes": None, "peak_exact": None}
    top = max(peaks, key=lambda kp: kp[1])
    med = float(np.median(pk))
    frag = _finite([r.fragmentation_bytes for r in ranks])
    res = _finite([r.peak_reserved_bytes for r in ranks])
    retries = _finite([r.alloc_retries for r in ranks])
    ooms = _finite([r.ooms for r in ranks])
    exact = [r.peak_exact for r in ranks if r.peak_exact is not None]
    return {
        "source": source,
        "ranks": int(pk.size),
        "peak_allocated_max": float(pk.max()),
        "peak_allocated_max_rank": int(top[0]),
        "peak_allocated_median": med,
        "imbalance": float(pk.max() / med) if med > 0 else None,
        "peak_reserved_max": float(res.max()) if res.size else None,
        "fragmentation_bytes": float(frag.max()) if frag.size else None,
        "fragmentation_ratio": float(frag.max() / res.max()) if frag.size and res.size and res.max() > 0 else None,
        "alloc_retries": float(retries.sum()) if retries.size else alloc_retries,
        "ooms": float(ooms.sum()) if ooms.size else None,
        "ooms_ranks": int((ooms > 0).sum()) if ooms.size else None,
        "peak_exact": all(exact) if exact else None,
    }
