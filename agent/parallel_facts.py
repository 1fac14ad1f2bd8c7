"""What the server's advice needs to know about the job's data parallelism, recorded once per run.

DDP cannot split one parameter across buckets, buckets its gradients in reverse registration order
with a smaller first bucket (``first_bucket_bytes``, 1 MiB while ``bucket_cap_mb`` is left at its
default), and copies gradients into the buckets unless ``gradient_as_bucket_view``. Whether "smaller
buckets" can help therefore depends on the largest gradient tensor — a fact the collectives alone do
not show. :func:`ddp_facts` reads it from the wrapped model (parameter metadata only: no device work,
no synchronisation); :func:`fsdp_facts` the FSDP2 units (``fully_shard`` modules) and their sizes.

The agent sends them as one run event per model (kind ``ddp`` / ``fsdp``, :func:`report`); the server
reads the lowest rank's (``server/store/job_facts.py``). Nothing here raises into the training loop.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

__all__ = ["ddp_facts", "fsdp_facts", "report", "DDP_KIND", "FSDP_KIND"]

log = logging.getLogger(__name__)

DDP_KIND = "ddp"
FSDP_KIND = "fsdp"
_NAME_CHARS = 128
#: model -> ids of the runs its facts were sent to (the run objects have slots: no attribute of ours)
_sent: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


def _nbytes(p: Any) -> int:
    return int(p.numel()) * int(p.element_size())


def _estimated_buckets(sizes: list[int], first: int, cap: int) -> int:
    """Buckets DDP forms from gradients of these sizes (registration order), filled from the last
    parameter (its gradient is ready first) with a first bucket of ``first`` bytes, then ``cap``:
    a bucket closes once it holds at least its limit (a parameter is never split)."""
    n, held, limit = 0, 0, first
    for b in reversed(sizes):
        held += b
        if held >= limit:
            n += 1
            held, limit = 0, cap
    return n + (1 if held > 0 else 0)


def ddp_facts(model: Any) -> dict[str, Any] | None:
    """``{"bucket_cap_bytes", "first_bucket_bytes", "gradient_as_bucket_view", "params", "grad_bytes",
    "largest_grad_bytes", "largest_grad_param", "buckets_estimated", "find_unused_parameters",
    "static_graph"}`` of a ``DistributedDataParallel`` model; None for any other model."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001 - torch without distributed
        return None
    if not isinstance(model, DistributedDataParallel):
        return None
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad and n not in ignored]
    sizes = [_nbytes(p) for _, p in named]
    cap = int(getattr(model, "bucket_bytes_cap", 25 << 20))
    bucket_config = getattr(model, "_bucket_config", None)
    first = getattr(bucket_config, "first_bucket_bytes_cap", None)
    if first is None:  # older torch: a 1 MiB first bucket while the cap is the default
        import torch.distributed as dist

        default = bool(getattr(model, "bucket_bytes_cap_default", True))
        first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20) if default else cap
    first = int(min(int(first), cap))
    j = max(range(len(sizes)), key=lambda i: sizes[i]) if sizes else None
    return {
        "bucket_cap_bytes": cap,
        "first_bucket_bytes": first,
        "gradient_as_bucket_view": bool(getattr(model, "gradient_as_bucket_view", False)),
        "params": len(sizes),
        "grad_bytes": int(sum(sizes)),
        "largest_grad_bytes": int(sizes[j]) if j is not None else 0,
        "largest_grad_param": named[j][0][:_NAME_CHARS] if j is not None else None,
        "buckets_estimated": _estimated_buckets(sizes, first, cap),
        "find_unused_parameters": bool(getattr(model, "find_unused_parameters", False)),
        "static_graph": bool(getattr(model, "static_graph", False)),
    }


def fsdp_facts(model: Any) -> dict[str, Any] | None:
    """``{"units", "params", "largest_unit_bytes", "smallest_unit_bytes", "root_bytes"}`` of a model with
    FSDP2 units (``fully_shard``): each unit's parameters at their full (unsharded) size, a parameter
    counted in the innermost unit holding it (``root_bytes``: the top-level unit's own). None when the
    model has no FSDP2 unit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001 - torch without FSDP2
        return None
    units: list[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    owner: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for i, u in enumerate(units):  # modules() is pre-order: an inner unit comes after its parent
        for p in u.parameters():
            owner[id(p)] = i
            sizes[id(p)] = _nbytes(p)
    per = [0] * len(units)
    for pid, i in owner.items():
        per[i] += sizes[pid]
    own = [b for b in per if b > 0] or [0]
    return {"units": len(units), "params": len(owner), "largest_unit_bytes": max(own), "smallest_unit_bytes": min(own),
            "root_bytes": per[0] if units[0] is model else None}


def report(run: Any, model: Any) -> None:
    """Send the model's DDP or FSDP facts as one run event (once per model and run); never raises."""
    try:
        seen = _sent.get(model)
        if seen is None:
            seen = _sent[model] = set()
        if id(run) in seen:
            return
        seen.add(id(run))
        facts = ddp_facts(model)
        kind = DDP_KIND
        if facts is None:
            facts = fsdp_facts(model)
            kind = FSDP_KIND
        if facts is not None:
            run._event(kind, None, facts)
    except Exception as e:  # noqa: BLE001 - facts are advice's inputs, never the job's business
        log.debug("fleetscope: DDP/FSDP facts not recorded (%r)", e)
