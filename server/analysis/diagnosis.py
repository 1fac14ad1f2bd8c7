"""One diagnosis per run (docs/analysis.md, "Diagnosis"): a single ranked account of where the median
step goes, each second counted once, and the advice whose cause is a ranked cause and whose
preconditions hold. Pure: figures, collective rollups and the other reports in, dicts out.

**Parts** partition the median step ``step_s``. The run's shares (``figures.component_shares``: sums
over steps of the cross-rank medians, straggler wait carved out of exposed comm, adding up to 1) are
applied to the median step, and exposed communication (net of the wait) is split by the collectives
it was spent in (the run's collective rollup, ``run_collectives``):

* ``straggler_wait``: time a rank waits inside a collective for the last-arriving rank (max work −
  median work per step, at most the step's exposed comm);
* ``comm_sync``: exposed time of small synchronisation collectives — under ``SYNC_BYTES`` per call, or a
  barrier — whose time is latency and skew, not bandwidth;
* ``pipeline_bubble``: exposed point-to-point (send / recv) time — waiting for another pipeline stage;
* ``comm_bandwidth``: the rest of exposed communication: large collectives the step waits for;
* ``data``, ``compute``, ``other``.

The wait is measured per step, not per collective; it is taken first out of the small collectives'
exposed time (a tiny message's time beyond its latency is waiting), then out of point-to-point, then
out of the large collectives' — so no second is both "wait" and "bandwidth".

**One cause, counted once**: when the straggler the ranks wait for is late in data loading on a minority
of ranks, the wait it causes is that rank's data loading too — the part of the wait its data excess
explains moves to ``data`` (the median rank's data share and the others' wait are the same seconds of
the same cause), so "data" and "waiting for the slowest rank" do not both claim them.

**Advice** is given for a cause only when it is *ranked*: at least ``LIMITS["cause_min_share"]`` (10 %)
of the step and among the ``LIMITS["top_causes"]`` largest parts other than compute (compute is the
work itself; its advice needs its own finding) — and at most one item per cause and kind of change
(``advice_kind``), a second kind only when it can itself remove ``LIMITS["second_item_gain"]`` of the
step. Bucketing and FSDP advice (``overlap_advice``) need ``comm_bandwidth`` ranked and the job's
pattern: DDP advice a DDP job (large gradient all-reduces in a data-parallel group and no FSDP pattern),
FSDP advice an FSDP job (large all-gathers and reduce-scatters in one data-parallel group), and the
preconditions ``overlap_advice`` checks against the job's recorded facts (``withheld`` items go to the
notes). Nothing about buckets is said for waiting or for small synchronisation collectives. In a
pipeline job the ranks are compared with their own stage (``stragglers``): a stage slower by design
gets stage-balancing advice, never "fix or replace" its rank.

**Ceilings** (``max_speedup``, Amdahl 1 / (1 − p)) are given only for a ranked cause other than compute
whose share p is between 10 % and 90 % (``bottlenecks.physical_ceiling``): compute is the work
itself (no step is faster without it), and a part of nearly the whole step has no one change that
removes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..store.rows import CollectiveRow
from .bottlenecks import base_finding, physical_ceiling
from .parallel import dim_label
from .tokens import CORRELATION_MIN

__all__ = ["SYNC_BYTES", "LIMITS", "CAUSES", "job_pattern", "comm_split", "diagnose", "consistent_overlap_advice",
           "consistent_bottlenecks", "consistent_parallel_findings", "actionable", "advice_kind", "ceiling"]

#: bytes per call below which a collective is a synchronisation (latency / skew bound), not a bandwidth one
SYNC_BYTES = 64 * 1024

LIMITS = {
    "cause_min_share": 0.10,  # a cause is worth advice from 10 % of the (steady) median step ...
    "top_causes": 2,  # ... when it is one of the two largest parts besides compute
    "second_item_gain": 0.05,  # a second advice item of another kind for one cause must remove ≥ 5 % of the step
}

#: cause -> plain words
CAUSES = {
    "straggler_wait": "waiting for the slowest rank",
    "comm_bandwidth": "exposed communication (bandwidth-bound)",
    "comm_sync": "small synchronisation collectives",
    "pipeline_bubble": "pipeline bubble (point-to-point waits)",
    "data": "data loading",
    "compute": "compute",
    "other": "other (host overhead, launch gaps, idle)",
}

_SYNC_OPS = ("barrier",)
_P2P_OPS = ("send", "recv")
#: dimensions whose collectives are not the data-parallel gradient / parameter traffic
_MODEL_DIMS = ("tp", "cp", "sp", "ep", "pp")
#: ``overlap_advice`` settings -> the job pattern they need
_DDP_SETTINGS = ("bucket_cap_mb",)
_FSDP_SETTINGS = ("fully_shard units", "reshard_after_forward", "set_modules_to_forward_prefetch",
                  "set_modules_to_backward_prefetch")
#: ``overlap_advice`` setting -> the kind of change it is (one item per cause and kind)
_SETTING_KINDS = {"bucket_cap_mb": "bucketing", "fully_shard units": "bucketing", "gradient bytes": "gradient bytes",
                  "reshard_after_forward": "resharding", "set_modules_to_forward_prefetch": "prefetch",
                  # the no-memory alternative to resharding for the same (backward) all-gathers
                  "set_modules_to_backward_prefetch": "resharding"}
#: bottleneck component -> the diagnosis causes it holds
_COMPONENT_CAUSES = {"data": ("data",), "other": ("other",), "compute": ("compute",),
                     "straggler_wait": ("straggler_wait",),
                     "comm_exposed": ("comm_bandwidth", "comm_sync", "pipeline_bubble")}


def advice_kind(item: Mapping[str, Any]) -> str:
    """The kind of change an advice or ``overlap_advice`` item is (its ``kind``, else by its setting)."""
    if item.get("kind"):
        return str(item["kind"])
    return _SETTING_KINDS.get(str(item.get("setting")), str(item.get("setting") or "finding"))


def ceiling(cause: str, share: float) -> float | None:
    """The Amdahl ceiling 1 / (1 − share) of removing a part, when it is physical
    (``bottlenecks.physical_ceiling``: not compute, the share within 10 – 90 %); else None."""
    return physical_ceiling(cause, share)


def _one_per_kind(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The first item of each kind (items come largest first); an item of a second kind only when its
    ``expected_gain_share`` (when it has one) is at least ``second_item_gain``."""
    out: list[dict[str, Any]] = []
    kinds: set[str] = set()
    for a in items:
        k = advice_kind(a)
        if k in kinds:
            continue
        g = a.get("expected_gain_share")
        if out and isinstance(g, (int, float)) and g < LIMITS["second_item_gain"]:
            continue
        kinds.add(k)
        out.append(dict(a))
    return out


def _fin(v: Any) -> float:
    """A share as a finite float (0 for a missing or non-finite one)."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def _per_call(c: CollectiveRow) -> float:
    return c.bytes / c.calls if c.calls > 0 else float(2 ** c.size_bucket)


def _kind(c: CollectiveRow) -> str:
    """``sync``, ``p2p`` or ``large`` for one collective row."""
    if c.op in _P2P_OPS:
        return "p2p"
    if c.op in _SYNC_OPS or _per_call(c) < SYNC_BYTES:
        return "sync"
    return "large"


def job_pattern(colls: Sequence[CollectiveRow], world_size: int | None = None) -> dict[str, Any]:
    """``{"ddp", "fsdp", "evidence"}``: FSDP when one data-parallel dimension has large all-gathers and
    large reduce-scatters (or a ``dp_shard`` dimension large all-gathers); DDP when a data-parallel
    dimension has large all-reduces (gradient buckets) and the job is not FSDP. Small collectives (an
    all-gather of 16 bytes during data loading) say nothing about the job's parallelism."""
    ops: dict[str, set[str]] = {}
    for c in colls:
        d = dim_label(c.dim, c.group_size, world_size)
        if d in _MODEL_DIMS or _kind(c) != "large":
            continue
        ops.setdefault(d, set()).add(c.op)
    fsdp_dims = sorted(d for d, o in ops.items() if {"all_gather", "reduce_scatter"} <= o
                       or (d == "dp_shard" and "all_gather" in o))
    ddp_dims = sorted(d for d, o in ops.items() if "all_reduce" in o)
    fsdp = bool(fsdp_dims)
    ddp = bool(ddp_dims) and not fsdp
    ev = []
    if fsdp:
        ev.append(f"FSDP: all-gathers and reduce-scatters of ≥ {SYNC_BYTES // 1024} KiB per call in {', '.join(fsdp_dims)}")
    if ddp:
        ev.append(f"DDP: gradient all-reduces of ≥ {SYNC_BYTES // 1024} KiB per call (buckets) in {', '.join(ddp_dims)}")
    return {"ddp": ddp, "fsdp": fsdp, "evidence": ev}


def comm_split(colls: Sequence[CollectiveRow]) -> dict[str, float]:
    """Exposed seconds of the run's collectives summed over records, by kind (``sync``, ``p2p``, ``large``)."""
    out = {"sync": 0.0, "p2p": 0.0, "large": 0.0}
    for c in colls:
        out[_kind(c)] += max(_fin(c.exposed_s), 0.0)
    return out


def _ms(v: float) -> str:
    return f"{v * 1e3:.4g} ms" if abs(v) < 1 else f"{v:.4g} s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %" if abs(x) < 0.1 else f"{100 * x:.0f} %"


def _bytes(b: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


def _top_ops(colls: Sequence[CollectiveRow], kind: str, world_size: int | None, n: int = 3) -> list[str]:
    per: dict[tuple[str, str], list[float]] = {}
    for c in colls:
        if _kind(c) != kind or c.exposed_s <= 0:
            continue
        k = (c.op, dim_label(c.dim, c.group_size, world_size))
        a = per.setdefault(k, [0.0, 0.0, 0.0])
        a[0] += c.exposed_s
        a[1] += c.bytes
        a[2] += c.calls
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{op.replace('_', '-')} in {dim} ({_bytes(b / max(calls, 1))} per call)" for (op, dim), (_e, b, calls) in top]


def actionable(diag: Mapping[str, Any] | None, cause: str) -> bool:
    """Whether ``cause`` is a ranked cause of the diagnosis (advice about it may be given)."""
    if not diag:
        return False
    return cause in diag.get("ranked_causes", ())


def _data_late_wait(st: Mapping[str, Any], w: float, data_findings: Sequence[str]) -> tuple[float, str | None]:
    """(the part of the wait ``w`` that is the named straggler's data loading, the rank's words): when
    the first straggler is late in data (its data excess over the step median is most of its excess),
    data stalls are not on most ranks, and no node is named. The share moved is the data part of its
    positive excess over the step median (data, compute, other)."""
    if w <= 0 or st.get("nodes") or not st.get("stragglers"):
        return 0.0, None
    if any("on most ranks" in f for f in data_findings):
        return 0.0, None
    top = st["stragglers"][0]
    if top.get("component") != "data":
        return 0.0, None
    ex = {k: float(v) for k, v in (top.get("component_excess_s") or {}).items()
          if isinstance(v, (int, float)) and v > 0}
    tot = sum(ex.values())
    frac = ex.get("data", 0.0) / tot if tot > 0 else 1.0
    host = f" ({top['host']})" if top.get("host") else ""
    return w * frac, f"rank {top['rank']}{host}"


def _stage_words(pipeline: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(evidence, advice) for a pipeline whose stages do unequal work, or None (no pipeline, one stage,
    no per-stage figures)."""
    if not pipeline or int(pipeline.get("stages") or 0) < 2:
        return None
    per = [p for p in pipeline.get("per_stage") or [] if isinstance(p.get("busy_s"), (int, float))]
    if len(per) < 2:
        return None
    hi = max(per, key=lambda p: p["busy_s"])
    lo = min(per, key=lambda p: p["busy_s"])
    if not hi["busy_s"] > 0:
        return None
    last = " (the last stage also computes the head and the loss)" if hi["stage"] == int(pipeline["stages"]) - 1 else ""
    ev = (f"a pipeline of {pipeline['stages']} stages: ranks are compared with their own stage; stage {hi['stage']} "
          f"works {_ms(hi['busy_s'])} per step, stage {lo['stage']} {_ms(lo['busy_s'])}{last}")
    adv = (f"balance the pipeline stages: stage {hi['stage']} works {_ms(hi['busy_s'])} per step against "
           f"{_ms(lo['busy_s'])} for stage {lo['stage']}{last}; move layers from it to the lighter stages")
    return ev, adv


def diagnose(*, step_s: float | None, shares: Mapping[str, float] | None, colls: Sequence[CollectiveRow],
             world_size: int | None = None, stragglers: Mapping[str, Any] | None = None,
             token_balance: Mapping[str, Any] | None = None, bottlenecks: Sequence[Mapping[str, Any]] = (),
             overlap_items: Sequence[Mapping[str, Any]] = (), network: Mapping[str, Any] | None = None,
             efficiency_large_messages: float | None = None, facts: Mapping[str, Any] | None = None,
             pipeline: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The summary's ``diagnosis`` (module docstring); None for a run without a decomposition.

    ``shares``: ``RunFigures.shares``; ``colls``: the run's collective rollup; ``stragglers``: the
    straggler report; ``bottlenecks``: the bottleneck components (their findings give the data, compute
    and other evidence); ``overlap_items``: ``overlap.overlap_advice``'s items before filtering;
    ``facts``: the job's recorded ``{"ddp", "fsdp"}`` facts (shown; None: unknown); ``pipeline``: the
    summary's ``pipeline`` (stages and their work)."""
    if not shares or step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return None
    sh = {k: _fin(shares.get(k)) for k in ("data", "compute", "other", "comm_exposed", "straggler_wait")}
    e = max(sh["comm_exposed"], 0.0) + max(sh["straggler_wait"], 0.0)  # exposed, wait included
    w = max(sh["straggler_wait"], 0.0)
    split = comm_split(colls)
    tot = sum(split.values())
    if tot > 0:
        f_sync, f_p2p = split["sync"] / tot, split["p2p"] / tot
    else:
        f_sync = f_p2p = 0.0  # no collective records: sizes unknown, counted as bandwidth-bound
    left = w  # the wait, carved out of sync first, then point-to-point, then large collectives
    sync = max(e * f_sync - left, 0.0)
    left = max(left - e * f_sync, 0.0)
    p2p = max(e * f_p2p - left, 0.0)
    left = max(left - e * f_p2p, 0.0)
    bandwidth = max(e - w - sync - p2p, 0.0)
    findings = {str(b.get("component")): list(b.get("findings") or []) for b in bottlenecks}
    st = stragglers or {}
    moved, late_data_rank = _data_late_wait(st, w, findings.get("data", []))
    share = {"straggler_wait": w - moved, "comm_bandwidth": bandwidth, "comm_sync": sync, "pipeline_bubble": p2p,
             "data": sh["data"] + moved, "compute": sh["compute"], "other": sh["other"]}
    pattern = job_pattern(colls, world_size)
    stages = _stage_words(pipeline)

    evidence: dict[str, list[str]] = {k: [] for k in share}
    if st.get("nodes"):
        nd = st["nodes"][0]
        evidence["straggler_wait"].append(f"node {nd['node']}: its {len(nd['ranks'])} ranks are {nd['slowdown']:.2f}× "
                                          "slower than the median rank")
    elif st.get("stragglers"):
        top = st["stragglers"][0]
        where = f" on {top['host']}" if top.get("host") else ""
        comp = f", late in {top['component']}" if top.get("component") else ""
        peers = " of its pipeline stage" if st.get("compared_within") == "pipeline stage" else ""
        evidence["straggler_wait"].append(f"rank {top['rank']}{where} does {top['slowdown']:.2f}× the median rank{peers}'s "
                                          f"work{comp}")
        dev = (top.get("cause") or {}).get("device")  # its GPU's telemetry (analysis/devices.py)
        if dev:
            evidence["straggler_wait"].append(str(dev["text"]))
    if share["straggler_wait"] > 0:
        evidence["straggler_wait"].append("per step: the slowest rank's work − the median rank's, waited for inside "
                                          "the collectives")
    if stages:
        evidence["straggler_wait"].append(stages[0])
    if moved > 0 and late_data_rank:
        evidence["data"].append(f"{late_data_rank} loads data late: the other ranks wait for it in the collectives "
                                f"({_pct(moved)} of the step, counted here once, not as waiting for the slowest rank)")
    tb = token_balance or {}
    if tb.get("finding"):
        evidence["straggler_wait"].append(str(tb["finding"]))
    if split["large"] > 0:
        evidence["comm_bandwidth"].append("exposed in " + "; ".join(_top_ops(colls, "large", world_size)))
    elif tot <= 0 and e > 0:
        evidence["comm_bandwidth"].append("no collective records: message sizes unknown")
    if efficiency_large_messages is not None:
        evidence["comm_bandwidth"].append(f"large collectives reach {_pct(efficiency_large_messages)} of the link peak")
    evidence["comm_bandwidth"] += pattern["evidence"]
    if split["sync"] > 0:
        evidence["comm_sync"].append(f"under {SYNC_BYTES // 1024} KiB per call: "
                                     + "; ".join(_top_ops(colls, "sync", world_size)))
    if split["p2p"] > 0:
        evidence["pipeline_bubble"].append("; ".join(_top_ops(colls, "p2p", world_size)))
    for k, src in (("data", "data"), ("compute", "compute"), ("other", "other")):
        evidence[k] += findings.get(src, [])

    labels = {**CAUSES, **({"straggler_wait": "waiting for the busiest pipeline stage"}
                           if stages and not st.get("stragglers") else {})}
    parts: list[dict[str, Any]] = [{"cause": k, "label": labels[k], "seconds": v * step_s, "share": v,
                                    "evidence": evidence[k]}
                                   for k, v in share.items() if v != 0 or k in ("data", "compute", "other")]
    parts.sort(key=lambda p: -p["share"])
    lim = LIMITS
    others = [p for p in parts if p["cause"] != "compute" and p["share"] >= lim["cause_min_share"]]
    ranked = [p["cause"] for p in others[: int(lim["top_causes"])]]
    comp_share = share["compute"]
    if findings.get("compute") and comp_share >= lim["cause_min_share"]:
        ranked.append("compute")  # low MFU while compute-bound: its own finding
    for p in parts:  # a ceiling only where it is physical and the cause is one advice is given for
        p["max_speedup"] = ceiling(p["cause"], p["share"]) if p["cause"] in ranked else None

    advice: list[dict[str, Any]] = []
    notes: list[str] = []

    def why(cause: str, extra: str = "") -> str:
        i = next(i for i, p in enumerate(parts) if p["cause"] == cause)
        return f"{CAUSES[cause]} is {_pct(share[cause])} of the median step (#{i + 1} of the ranking){extra}"

    if "straggler_wait" in ranked:
        token_rank = None
        if tb.get("finding") and (tb.get("work_correlation") or 0) >= CORRELATION_MIN:
            token_rank = (tb.get("heaviest_rank") or {}).get("rank")
            advice.append({"cause": "straggler_wait", "kind": "work balance",
                           "text": f"balance tokens across ranks: {tb['finding']}",
                           "why": why("straggler_wait", "; work time follows the tokens a rank gets")})
        # a straggler that is slow because it gets more tokens is the token advice's, not its device's
        if st.get("nodes") or (st.get("stragglers") and st["stragglers"][0].get("rank") != token_rank):
            who = (f"node {st['nodes'][0]['node']}" if st.get("nodes") else f"rank {st['stragglers'][0]['rank']}")
            comp = "" if st.get("nodes") else (st["stragglers"][0].get("component") or "")
            fix = {"data": "its input pipeline (loader workers, disk, network)", "compute": "its device (clocks, "
                   "thermals, a degraded GPU) or the work it gets", "other": "its host (CPU contention, launch overhead)"}
            dev = None if st.get("nodes") else (st["stragglers"][0].get("cause") or {}).get("device")
            if dev and dev.get("reason") is None and dev.get("throttle_reason") and comp == "data":
                dev = None  # late in data loading: its GPU's throttle is a bystander, the input pipeline is the fix
            look = f"its GPU ({dev['text']})" if dev else fix.get(comp, "it")  # the device's own telemetry
            advice.append({"cause": "straggler_wait", "kind": "slow rank",
                           "text": f"fix or replace {who}: look at {look}; every "
                           "other rank waits for it in the collectives",
                           "why": why("straggler_wait", "; this is waiting, not bandwidth: no communication "
                                      "setting shortens it")})
        if not advice and stages:
            advice.append({"cause": "straggler_wait", "kind": "stage balance", "text": stages[1],
                           "why": why("straggler_wait", "; in a pipeline the stages wait for the busiest one: no "
                                      "rank is slow against its own stage")})
        if not advice:
            advice.append({"cause": "straggler_wait", "kind": "variability",
                           "text": "find what makes ranks' work differ step to step (data "
                           "loading, uneven tokens, host jitter): the ranks wait for the last one in every collective",
                           "why": why("straggler_wait", "; no persistent straggler is named: the slowest rank changes")})
    if "comm_sync" in ranked:
        ddp = (facts or {}).get("ddp") or {}
        gb = ddp.get("grad_bytes")
        small_grads = ""
        if isinstance(gb, (int, float)) and 0 < gb / max(float(ddp.get("buckets_estimated") or 1), 1.0) < SYNC_BYTES:
            small_grads = (f"; DDP's own gradient buckets are among them (the model's gradients are {_bytes(gb)} in "
                           "all): accumulate gradients over micro-batches (no_sync) to all-reduce them less often")
        advice.append({"cause": "comm_sync", "kind": "sync", "text": "synchronise less often: small per-step collectives ("
                       + "; ".join(_top_ops(colls, "sync", world_size)) + ") — a loss or metric all-reduce, .item(), "
                       "a barrier — make every rank wait for the slowest; log every N steps or issue them async"
                       + small_grads,
                       "why": why("comm_sync", f"; under {SYNC_BYTES // 1024} KiB per call: latency and skew, not "
                                  "bandwidth")})
    if "pipeline_bubble" in ranked:
        advice.append({"cause": "pipeline_bubble", "kind": "schedule",
                       "text": "more micro-batches or an interleaved pipeline schedule", "why": why("pipeline_bubble")})
    diag_view = {"ranked_causes": ranked, "pattern": pattern}
    kept = consistent_overlap_advice(overlap_items, diag_view)
    for item in overlap_items:
        if item.get("withheld"):
            notes.append(f"not advised: {item.get('setting')} — {item['withheld']}")
        elif not any(k.get("setting") == item.get("setting") for k in kept):
            reason = _refusal(item, ranked, pattern, share)
            if not reason:
                g = item.get("expected_gain_share")
                reason = ("another change of the same kind removes more" if advice_kind(item) in {advice_kind(k) for k in kept}
                          else f"it removes at most {_pct(float(g or 0.0))} of the step: a second kind of change for one "
                          f"cause needs {_pct(lim['second_item_gain'])}")
            notes.append(f"not advised: {item.get('setting')} — " + reason)
    if "comm_bandwidth" in ranked:
        for item in kept:
            advice.append({"cause": "comm_bandwidth", "kind": advice_kind(item), "setting": item.get("setting"),
                           "text": item.get("suggestion"), "expected_gain_share": item.get("expected_gain_share"),
                           "why": why("comm_bandwidth", "; " + "; ".join(pattern["evidence"])) + ". "
                           + str(item.get("why") or "")})
        if not kept and efficiency_large_messages is not None and efficiency_large_messages < 0.5:
            advice.append({"cause": "comm_bandwidth", "kind": "network",
                           "text": "check NCCL settings, topology and the network: large "
                           f"collectives reach {_pct(efficiency_large_messages)} of the link peak",
                           "why": why("comm_bandwidth")})
    for k in ("data", "other", "compute"):
        if k not in ranked:
            continue
        fs = [f for f in findings.get(k, []) if "negative residual" not in f]
        if k == "data" and late_data_rank and moved > 0 and not fs:
            fs = [f"fix {late_data_rank}'s input pipeline (loader workers, disk, network): the other ranks wait for it"]
        for f in fs[:1]:  # one finding's advice per cause: the first (the most specific)
            advice.append({"cause": k, "kind": "finding", "text": f, "why": why(k)})
    advice = [a for c in dict.fromkeys(a["cause"] for a in advice)
              for a in _one_per_kind([x for x in advice if x["cause"] == c])]

    total = sum(p["seconds"] for p in parts)
    notes.insert(0, f"the parts sum to {_ms(total)} of a {_ms(step_s)} median step: each part's share of the summed "
                    "step time applied to the median step, each second counted once")
    notes.insert(1, f"synchronisation collectives: under {SYNC_BYTES // 1024} KiB per call, or barriers; the "
                    "straggler wait is taken out of them first, then out of point-to-point, then out of large collectives")
    notes.insert(2, f"advice only for a ranked cause: ≥ {_pct(lim['cause_min_share'])} of the median step and one of "
                    f"the {int(lim['top_causes'])} largest parts besides compute; at most one item per cause and kind")
    if network and (network.get("slow_nodes") or network.get("slow_ranks")):
        bad = network.get("slow_nodes") or network.get("slow_ranks") or []
        name = bad[0].get("node") or bad[0].get("host") or f"rank {bad[0].get('rank')}"
        notes.append(f"network: {len(bad)} slow {'node' if network.get('slow_nodes') else 'rank'}(s), worst {name} "
                     "(their collectives are slower than their peers'): a link, not the job's settings")
    fx = facts or {}
    return {"step_s": step_s, "sum_s": total, "parts": parts, "advice": advice, "notes": notes,
            "ranked_causes": ranked, "pattern": {"ddp": pattern["ddp"], "fsdp": pattern["fsdp"]},
            "sync_bytes": SYNC_BYTES, "facts": {"ddp": fx.get("ddp"), "fsdp": fx.get("fsdp")},
            "wait_as_data": moved}


def _refusal(item: Mapping[str, Any], ranked: Sequence[str], pattern: Mapping[str, Any],
             share: Mapping[str, float]) -> str:
    """Why an ``overlap_advice`` item is withheld (every reason that applies)."""
    s = item.get("setting")
    why = []
    if "comm_bandwidth" not in ranked:
        lead = next((c for c in ranked if c != "compute"), None)
        why.append(f"bandwidth-bound exposed comm is {_pct(share['comm_bandwidth'])} of the step, not a ranked cause"
                   + (f" (the exposed time is mostly {CAUSES[lead]})" if lead else ""))
    if s in _DDP_SETTINGS and not pattern.get("ddp"):
        why.append("no DDP gradient buckets seen")
    elif s in _FSDP_SETTINGS and not pattern.get("fsdp"):
        why.append("no FSDP all-gather / reduce-scatter pattern seen")
    elif s not in _DDP_SETTINGS + _FSDP_SETTINGS and not (pattern.get("ddp") or pattern.get("fsdp")):
        why.append("neither a DDP nor an FSDP gradient pattern seen")
    return "; ".join(why)


def consistent_overlap_advice(items: Sequence[Mapping[str, Any]], diag: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """``overlap_advice`` items the diagnosis agrees with: bandwidth-bound exposed comm ranked, DDP
    settings for DDP jobs, FSDP settings for FSDP jobs, gradient-bytes advice for either; none withheld
    (a failed precondition); one per kind of change (the largest gain), a second kind only when it can
    remove ``LIMITS["second_item_gain"]`` of the step."""
    if not diag or "comm_bandwidth" not in diag.get("ranked_causes", ()):
        return []
    pat = diag.get("pattern") or {}
    out = []
    for a in items:
        if a.get("withheld"):
            continue  # its precondition fails on this job (the diagnosis's notes say why)
        s = a.get("setting")
        ok = bool(pat.get("ddp")) if s in _DDP_SETTINGS else bool(pat.get("fsdp")) if s in _FSDP_SETTINGS else bool(
            pat.get("ddp") or pat.get("fsdp"))
        if ok:
            out.append(dict(a))
    return _one_per_kind(out)


_COMM_ADVICE = ("low overlap", "low bus bandwidth")


def consistent_bottlenecks(components: Sequence[Mapping[str, Any]], diag: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The ``bottlenecks`` components with the exposed-comm findings (overlap, bus bandwidth) kept only
    when the diagnosis ranks bandwidth-bound exposed comm, and a ceiling (``max_speedup``) only for a
    component holding a ranked cause (never next to "no advice"); the rest unchanged."""
    keep_comm = actionable(diag, "comm_bandwidth")
    ranked = set((diag or {}).get("ranked_causes", ()))
    out = []
    for c in components:
        c = dict(c)
        name = str(c.get("component"))
        if diag is not None and c.get("max_speedup") is not None and not ranked & set(_COMPONENT_CAUSES.get(name, ())):
            share = float(c.get("share") or 0.0)
            was = base_finding(name, share, c["max_speedup"])
            c["max_speedup"] = None
            if c.get("finding") == was:
                c["finding"] = (f"{base_finding(name, share, None).split(';')[0]}; no ceiling shown: not a ranked cause "
                                "of this run (see the diagnosis)")
        if c.get("component") == "comm_exposed" and not keep_comm:
            fs = [f for f in c.get("findings") or [] if not f.startswith(_COMM_ADVICE)]
            if fs != list(c.get("findings") or []):
                c["findings"] = fs
                c["finding"] = fs[0] if fs else (
                    f"exposed communication: {_pct(float(c.get('share') or 0))} of step time, mostly small "
                    "synchronisation collectives or waiting, not bandwidth (see the diagnosis)")
        out.append(c)
    return out


def consistent_parallel_findings(findings: Sequence[Mapping[str, Any]], colls: Sequence[CollectiveRow],
                                 diag: Mapping[str, Any] | None, *, min_share: float = 0.05) -> list[dict[str, Any]]:
    """``parallel_findings`` restated through the diagnosis. A dimension's exposed share splits into its
    bandwidth-bound part (its large collectives' exposed time less the straggler wait, pro rata:
    ``bandwidth_share``) and the rest (waiting, small synchronisation collectives, pipeline waits). A
    finding whose bandwidth-bound part is at least ``min_share`` of the step keeps its words, its advice
    suffix made the job's (bucket size for DDP, prefetch for FSDP) and only when the diagnosis ranks
    bandwidth-bound comm; otherwise the finding says what the time is instead, with no bandwidth advice.
    ``share`` stays the dimension's exposed share; ``bandwidth_share`` and ``cause`` are added. The
    pipeline-bubble finding passes unchanged."""
    if not diag:
        return [dict(f) for f in findings]
    parts = {p["cause"]: p["share"] for p in diag.get("parts", [])}
    moved = float(diag.get("wait_as_data") or 0.0)  # waiting for a rank's late data: counted under data
    exposed = sum(parts.get(k, 0.0) for k in ("straggler_wait", "comm_bandwidth", "comm_sync", "pipeline_bubble")) + moved
    split = comm_split(colls)
    n = sum(split.values())
    # of the large collectives' exposed time, the part that is bandwidth-bound (not the wait)
    large_share = exposed * split["large"] / n if n > 0 else exposed
    k_bw = min(parts.get("comm_bandwidth", 0.0) / large_share, 1.0) if large_share > 0 else 0.0
    per_dim: dict[str, dict[str, float]] = {}
    for c in colls:
        # keyed as comm_by_dim keys its rows (a sender that named no dimension: "unknown")
        a = per_dim.setdefault(c.dim if c.dim is not None else "unknown", {"sync": 0.0, "p2p": 0.0, "large": 0.0})
        a[_kind(c)] += max(_fin(c.exposed_s), 0.0)
    pat = diag.get("pattern") or {}
    ranked_bw = actionable(diag, "comm_bandwidth")
    suffix = ": overlap it with backward"
    out = []
    for f in findings:
        f = dict(f)
        text = str(f.get("finding") or "")
        if text.startswith("pipeline bubble"):
            out.append(f)
            continue
        kinds = per_dim.get(str(f.get("dim")), {"sync": 0.0, "p2p": 0.0, "large": 1.0})
        tot = sum(kinds.values())
        bw = float(f.get("share") or 0.0) * (kinds["large"] / tot if tot > 0 else 1.0) * k_bw
        f["bandwidth_share"] = bw
        if bw >= min_share:
            f["cause"] = "comm_bandwidth"
            if suffix in text:
                head = text.split(suffix)[0]
                if ranked_bw:
                    how = ("DDP's gradient bucket size" if pat.get("ddp") else "FSDP prefetch / resharding"
                           if pat.get("fsdp") else "overlapping it with backward")
                    text = f"{head}, {_pct(bw)} of the step bandwidth-bound: see {how} in the diagnosis"
                else:
                    text = f"{head}, {_pct(bw)} of the step bandwidth-bound, not a ranked cause of this run"
            f["finding"] = text
        else:
            head = text.split(":")[0].split(";")[0]
            if kinds["p2p"] >= max(kinds["sync"], kinds["large"]) and kinds["p2p"] > 0:
                cause = "pipeline_bubble"
            elif moved > 0 and moved >= parts.get("straggler_wait", 0.0) and moved >= parts.get("comm_sync", 0.0):
                cause = "data"  # the others wait for one rank's late data loading (the diagnosis's data part)
            elif parts.get("straggler_wait", 0.0) >= parts.get("comm_sync", 0.0) and parts.get("straggler_wait", 0.0) > 0:
                cause = "straggler_wait"
            elif kinds["sync"] > 0:
                cause = "comm_sync"
            else:
                cause = "comm_bandwidth"
            f["cause"] = cause
            f["finding"] = (f"{head}, but only {_pct(bw)} of the step is bandwidth-bound: the rest is {CAUSES[cause]}, "
                            "which no communication setting shortens (see the diagnosis)" if cause != "comm_bandwidth"
                            else f"{head}; {_pct(bw)} of the step is bandwidth-bound, not a ranked cause (see the diagnosis)")
        out.append(f)
    return out
