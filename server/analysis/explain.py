"""Alerts that explain (docs/analysis.md "Cause and diff"): which part of the step moved, and what
changed between the last good and the first bad run. Pure: figures and rows in, dicts and text out.

* **cause** — the step-time component (data, compute, exposed comm, other) whose change explains
  most of the step-time change between the *baseline* (median over the last ≤ ``WINDOW`` good runs)
  and the *bad* side (median over the first ≤ ``WINDOW`` bad runs, the first bad run first):
  ``share_of_change = Δ component / Δ step time``. When exposed comm is the cause, the parallel
  dimension (``comm_by_dim``) and the collective op whose exposed seconds grew most are named too.
  When the runs' tokens per rank-step differ (a batch or scale change), every figure is taken per
  1,000 tokens of a GPU (``basis: "per_1k_tokens"``), so a bigger batch is not a "slower" step.
* **diff** — the last good run against the first bad run: flattened config keys (``a.b.c``) and run
  meta keys whose values differ, the commit, world size, device type, model-parallel size, node
  count and the nodes added and removed, at most ``MAX_DIFF_KEYS`` keys (``truncated`` counts the
  rest).
* **straggler cause and diff** (:func:`straggler_cause`, :func:`rank_diff`) — for a straggler alert:
  the component (data, compute, other) of the straggler's excess work over the median rank
  (``analysis.stragglers``), ``before`` = the median rank's seconds per step, ``after`` = before + the
  straggler's mean excess per step; and what differs for that rank versus its peers (node, host,
  local rank, device, how many of its node's ranks straggle, its token share when known).
* :func:`explanation` says both in one sentence (Slack, the Regressions page).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..store.rows import RunRow
from .figures import COMPONENTS, RunFigures

__all__ = [
    "WINDOW",
    "MAX_DIFF_KEYS",
    "format_bandwidth",
    "COMPONENT_KEYS",
    "RunComm",
    "flatten",
    "levels",
    "cause",
    "cause_of_runs",
    "cause_of_steps",
    "run_diff",
    "straggler_cause",
    "rank_diff",
    "explanation",
    "metric_label",
    "format_metric",
]

WINDOW = 5  # runs on each side of the change the cause is measured over (last good / first bad)
MAX_DIFF_KEYS = 30  # config + meta keys a diff lists; ``truncated`` says how many more differ
MAX_HOSTS = 8  # nodes added / removed listed in a diff
MIN_STEP_RISE = 0.01  # below a 1 % step-time rise there is nothing for a cause to explain
SENTENCE_ITEMS = 6  # changes named in the sentence (then "and N more")

COMPONENT_KEYS = tuple(k for k, _ in COMPONENTS)
_LABEL = dict(COMPONENTS)
#: config keys that differ between any two runs by construction (as in the config signature)
VOLATILE_CONFIG = frozenset({"seed", "run_name", "output_dir", "timestamp"})
#: meta keys of the process that sent the registration (rank 0's host, ids), not of the job's setup
VOLATILE_META = frozenset({"host", "node", "rank", "local_rank", "node_rank", "job_id", "seed", "pid", "hostname"})

#: per-run communication the cause refines exposed comm with: ({dim: exposed s per step},
#: {(dim, op): exposed s per rank-step}); either may be empty
RunComm = tuple[Mapping[str, float], Mapping[tuple[str, str], float]]

_METRIC_LABELS = {
    "tokens_per_s_per_gpu": "tokens/s per GPU", "step_s": "step time", "mfu": "MFU", "data_s": "data time",
    "compute_s": "compute time", "comm_exposed_s": "exposed comm", "other_s": "other time",
    "mem_peak_bytes": "peak memory", "step_s_p95": "p95 step time", "straggler_slowdown": "slowest rank's work vs the median rank",
}


def metric_label(metric: str) -> str:
    """A metric's name in words (``busbw:all_reduce`` → "all_reduce busbw")."""
    if metric.startswith("busbw:"):
        return f"{metric.removeprefix('busbw:')} busbw"
    return _METRIC_LABELS.get(metric, metric)


def _fmt_s(v: float) -> str:
    if abs(v) >= 1:
        return f"{v:.2f} s"
    if abs(v) >= 0.01:
        return f"{v * 1e3:.0f} ms"
    return f"{v * 1e3:.1f} ms"


def format_bandwidth(v: float) -> str:
    """Bytes/s in the unit that keeps three significant digits (B/s … TB/s): never "0.0 GB/s" for a
    real small value."""
    a = abs(v)
    if a == 0:
        return "0 B/s"
    for div, suf in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if a >= div:
            return f"{v / div:.3g} {suf}"
    return f"{v:.3g} B/s"


def format_metric(v: float | None, unit: str | None, metric: str = "") -> str:
    """A value with its unit, human-sized: ms/s for times, % for MFU, GiB for bytes, GB/s for B/s."""
    if v is None or not math.isfinite(v):
        return "n/a"
    unit = unit or ""
    if unit == "s":
        return _fmt_s(v)
    if metric == "mfu" or (unit == "" and metric in ("", "mfu")):
        return f"{100 * v:.1f} %"
    if unit == "B":
        return f"{v / 2**30:.1f} GiB"
    if unit == "B/s":
        return format_bandwidth(v)
    if unit == "x":
        return f"{v:.2f}x"
    if unit.startswith("s/"):
        return f"{_fmt_s(v)}/{unit[2:]}"
    if abs(v) >= 1e4:
        return f"{v:,.0f} {unit}".strip()
    return f"{v:.4g} {unit}".strip()


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %" if abs(x) >= 0.1 else f"{100 * x:+.1f} %"


def flatten(d: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """Nested objects flattened to dotted keys (``{"fsdp": {"prefetch": true}}`` → ``{"fsdp.prefetch": true}``);
    lists and scalars are leaves; an empty object is a leaf ``{}``."""
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ----------------------------------------------------------------------------------------------- cause


def _median(vals: Sequence[float | None]) -> float | None:
    v = [float(x) for x in vals if x is not None and math.isfinite(float(x))]
    return float(np.median(v)) if v else None


def levels(figs: Sequence[RunFigures], *, per_1k_tokens: bool = False) -> dict[str, float | None]:
    """Median over runs of step time and each component (per 1,000 tokens of a GPU when asked:
    × ``step_s_per_1k_tokens / step_s`` of each run)."""
    out: dict[str, float | None] = {}
    for key in ("step_s", *COMPONENT_KEYS):
        vals: list[float | None] = []
        for f in figs:
            v = f.get(key)
            if per_1k_tokens:
                scale = (f.step_s_per_1k_tokens / f.step_s) if f.step_s and f.step_s_per_1k_tokens else None
                v = v * scale if v is not None and scale is not None else None
            vals.append(v)
        out[key] = _median(vals)
    return out


def _largest_rise(before: Mapping[Any, float], after: Mapping[Any, float]) -> tuple[Any, float, float] | None:
    best = None
    for k in sorted(set(before) | set(after), key=str):
        b, a = float(before.get(k, 0.0)), float(after.get(k, 0.0))
        if a - b > 0 and (best is None or a - b > best[2] - best[1]):
            best = (k, b, a)
    return best


def cause(before: Mapping[str, float | None], after: Mapping[str, float | None], *,
          dims: tuple[Mapping[str, float], Mapping[str, float]] | None = None,
          ops: tuple[Mapping[tuple[str, str], float], Mapping[tuple[str, str], float]] | None = None,
          basis: str = "step") -> dict[str, Any] | None:
    """The component that explains most of the step-time rise from ``before`` to ``after`` (levels with
    ``step_s`` and the ``COMPONENT_KEYS``), or None when step time did not rise by ``MIN_STEP_RISE``.

    ``dims`` = ({dim: exposed s} before, after) and ``ops`` = ({(dim, op): exposed s} before, after)
    refine an exposed-comm cause: the dimension whose exposed seconds rose most, and within it (or
    overall without dims) the op."""
    sb, sa = before.get("step_s"), after.get("step_s")
    if sb is None or sa is None or sb <= 0 or sa - sb < MIN_STEP_RISE * sb:
        return None
    d_step = sa - sb
    comps: dict[str, dict[str, float]] = {}
    for k in COMPONENT_KEYS:
        b, a = before.get(k), after.get(k)
        if b is not None and a is not None:
            comps[k] = {"before": b, "after": a, "share_of_change": (a - b) / d_step}
    if not comps:
        return None
    top = max(comps, key=lambda k: (comps[k]["after"] - comps[k]["before"], k))
    if comps[top]["after"] - comps[top]["before"] <= 0:
        return None
    out: dict[str, Any] = {"component": top, "label": _LABEL[top], **comps[top], "step_before": sb, "step_after": sa,
                           "step_change": d_step / sb, "basis": basis, "components": comps, "dim": None, "op": None}
    if top == "comm_exposed_s":
        dim_name = None
        if dims is not None and (hit := _largest_rise(dims[0], dims[1])) is not None:
            dim_name, b, a = hit
            out["dim"] = {"name": dim_name, "before": b, "after": a, "share_of_change": (a - b) / d_step}
        if ops is not None:
            ob, oa = ops
            if dim_name is not None:
                ob = {k: v for k, v in ob.items() if k[0] == dim_name}
                oa = {k: v for k, v in oa.items() if k[0] == dim_name}
            if (hit := _largest_rise(ob, oa)) is not None:
                (d, op), b, a = hit
                out["op"] = {"name": op, "dim": d, "before": b, "after": a, "share_of_change": (a - b) / d_step}
    return out


def _mean_maps(maps: Sequence[Mapping[Any, float]]) -> dict[Any, float]:
    """Median over runs of each key (a run without the key counts 0)."""
    keys = set().union(*maps) if maps else set()
    return {k: float(np.median([m.get(k, 0.0) for m in maps])) for k in keys}


def cause_of_runs(good: Sequence[RunFigures], bad: Sequence[RunFigures], *,
                  comm_good: Sequence[RunComm] | None = None, comm_bad: Sequence[RunComm] | None = None,
                  ) -> dict[str, Any] | None:
    """:func:`cause` between the median of the ``good`` runs and of the ``bad`` runs (each ≤ ``WINDOW``,
    chosen by the caller), per 1,000 tokens when their tokens per rank-step differ by more than 1 %."""
    if not good or not bad:
        return None
    tg = _median([f.tokens_per_rank_step for f in good])
    tb = _median([f.tokens_per_rank_step for f in bad])
    per_tok = bool(tg and tb and abs(tb - tg) > 0.01 * tg)
    lb, la = levels(good, per_1k_tokens=per_tok), levels(bad, per_1k_tokens=per_tok)
    if per_tok and (lb["step_s"] is None or la["step_s"] is None):
        per_tok = False
        lb, la = levels(good), levels(bad)
    dims = ops = None
    if comm_good and comm_bad and not per_tok:
        dims = (_mean_maps([c[0] for c in comm_good]), _mean_maps([c[0] for c in comm_bad]))
        ops = (_mean_maps([c[1] for c in comm_good]), _mean_maps([c[1] for c in comm_bad]))
        if not any(dims):
            dims = None
        if not any(ops):
            ops = None
    return cause(lb, la, dims=dims, ops=ops, basis="per_1k_tokens" if per_tok else "step")


def cause_of_steps(columns: Mapping[str, np.ndarray], index: int) -> dict[str, Any] | None:
    """:func:`cause` within one run: median over the steps before ``index`` against the steps from it
    (``columns`` holds ``step_s`` and the components per step, NaN = not measured)."""
    n = len(columns.get("step_s", ()))
    if not 0 < index < n:
        return None

    def side(lo: int, hi: int) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for k in ("step_s", *COMPONENT_KEYS):
            col = columns.get(k)
            if col is None:
                out[k] = None
                continue
            seg = np.asarray(col[lo:hi], dtype=np.float64)
            seg = seg[np.isfinite(seg)]
            out[k] = float(np.median(seg)) if seg.size else None
        return out

    return cause(side(0, index), side(index, n))


#: a straggler's excess work by component (``analysis.stragglers``): name -> the decomposition key of the
#: median rank's level. No comm: a straggler is found by its work (step − exposed comm); a slow network
#: is the ``slow_node`` alert's
STRAGGLER_COMPONENTS = (("data", "data_s"), ("compute", "compute_s"), ("other", "other_s"))


def straggler_cause(item: Mapping[str, Any], median: Mapping[str, float | None]) -> dict[str, Any] | None:
    """The component that makes a straggler slow, from its straggler-report ``item`` (``component_excess_s``:
    Σ over its steps of its component − the step's median rank's, and ``steps``) and the run's median-rank
    levels per step (``median``: ``data_s``, ``compute_s``, ``other_s``, from the run figures):
    ``before`` = the median rank's seconds per step, ``after`` = before + the straggler's mean excess per
    step, ``share_of_change`` = that excess / the straggler's total excess (data + compute + other).
    None when the rank has no positive excess."""
    ex = item.get("component_excess_s") or {}
    steps = int(item.get("steps") or 0)
    if steps <= 0:
        return None
    per = {c: float(ex.get(c) or 0.0) / steps for c, _ in STRAGGLER_COMPONENTS}
    total = sum(per.values())
    top = max(per, key=lambda c: (per[c], c))
    if total <= 0 or per[top] <= 0:
        return None
    comps: dict[str, dict[str, float | None]] = {}
    for c, key in STRAGGLER_COMPONENTS:
        b = median.get(key)
        b = float(b) if b is not None and math.isfinite(float(b)) else None
        comps[c] = {"before": b, "after": b + per[c] if b is not None else None, "excess_s": per[c],
                    "share_of_change": per[c] / total}
    return {"component": top, "label": top, **comps[top], "basis": "rank_vs_median", "rank": item.get("rank"),
            "slowdown": item.get("slowdown"), "excess_s": total, "steps": steps, "components": comps}


def rank_diff(item: Mapping[str, Any], placement: Mapping[int, tuple[Any, Any, Any, Any]],
              straggler_ranks: Sequence[int], *, tokens: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What differs for a straggler's rank versus its peers, only from what the server has:
    ``placement`` = {rank: (host, node, local_rank, device)} (the ``ranks`` table), the run's
    ``straggler_ranks`` and its token balance (``analysis.tokens``, when the run reported tokens).
    ``device``: ``[the peers' most common device, this rank's]``; ``node_ranks`` / ``node_straggler_ranks``:
    the ranks on its node and how many of them straggle; ``tokens_ratio``: its tokens over the median
    rank's (when it is the heaviest or the slowest rank of the balance) and ``modalities``: the modalities
    it gets the most of (ratio to the median rank)."""
    rank = int(item["rank"])
    host, node, local_rank, device = placement.get(rank, (item.get("host"), item.get("node"), None, None))
    node = node or host
    peers = [p for r, p in placement.items() if r != rank]
    devs: dict[str, int] = {}
    for p in peers:
        if p[3]:
            devs[str(p[3])] = devs.get(str(p[3]), 0) + 1
    peer_dev = max(devs, key=lambda d: (devs[d], d)) if devs else None
    on_node = sorted(r for r, p in placement.items() if node and (p[1] or p[0]) == node)
    strag = set(int(r) for r in straggler_ranks)
    out: dict[str, Any] = {
        "kind": "rank_vs_peers", "rank": rank, "host": host, "node": node, "local_rank": local_rank,
        "device": [peer_dev, device] if device is not None or peer_dev is not None else None,
        "nodes": len({p[1] or p[0] for p in placement.values() if p[1] or p[0]}), "ranks": len(placement),
        "node_ranks": len(on_node), "node_straggler_ranks": sum(1 for r in on_node if r in strag),
        "node_flagged": bool(item.get("node_flagged")), "tokens_ratio": None, "modalities": {},
    }
    if tokens:
        for k in ("heaviest_rank", "slowest_rank"):
            t = tokens.get(k) or {}
            if t.get("rank") == rank and t.get("tokens_ratio") is not None:
                out["tokens_ratio"] = float(t["tokens_ratio"])
        mods = {str(m): float(v["ratio"]) for m, v in (tokens.get("modalities") or {}).items()
                if v.get("max_rank") == rank and v.get("ratio") is not None}
        out["modalities"] = dict(sorted(mods.items())[:MAX_HOSTS])
    return out


# ------------------------------------------------------------------------------------------------ diff


def _short(v: Any) -> Any:
    """A diff value as JSON keeps it; a long one as its first 120 characters of JSON."""
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 120 else s[:119] + "…"


def _changed(a: Mapping[str, Any], b: Mapping[str, Any], skip: frozenset[str]) -> dict[str, list[Any]]:
    out = {}
    for k in sorted(set(a) | set(b)):
        if k.split(".")[0] in skip:
            continue
        va, vb = a.get(k), b.get(k)
        if json.dumps(va, sort_keys=True, default=str) != json.dumps(vb, sort_keys=True, default=str):
            out[k] = [_short(va), _short(vb)]
    return out


def run_diff(good: RunRow, bad: RunRow, *, good_nodes: Sequence[str] | None = None,
             bad_nodes: Sequence[str] | None = None, max_keys: int = MAX_DIFF_KEYS) -> dict[str, Any]:
    """What differs between the last good and the first bad run. ``config`` and ``meta``: only the
    flattened keys that differ, ``[good, bad]`` (null = absent), config first, at most ``max_keys`` in all
    (``truncated``: how many more); ``commit``, ``world_size``, ``device_type``, ``mp_size``, ``nodes``:
    always ``[good, bad]`` (equal = unchanged); ``hosts``: nodes only one run used (≤ 8 each)."""
    cfg = _changed(flatten(good.config), flatten(bad.config), VOLATILE_CONFIG)
    meta = _changed(flatten(good.meta), flatten(bad.meta), VOLATILE_META)
    keys = [("config", k) for k in cfg] + [("meta", k) for k in meta]
    kept = keys[:max_keys]
    gn, bn = set(good_nodes or ()), set(bad_nodes or ())
    return {
        "good_run": {"id": good.id, "name": good.name},
        "bad_run": {"id": bad.id, "name": bad.name},
        "config": {k: cfg[k] for s, k in kept if s == "config"},
        "meta": {k: meta[k] for s, k in kept if s == "meta"},
        "commit": [good.git_commit, bad.git_commit],
        "world_size": [good.world_size, bad.world_size],
        "device_type": [good.device_type, bad.device_type],
        "mp_size": [good.mp_size, bad.mp_size],
        "nodes": [len(gn) if good_nodes is not None else None, len(bn) if bad_nodes is not None else None],
        "hosts": {"added": sorted(bn - gn)[:MAX_HOSTS] if good_nodes is not None else [],
                  "removed": sorted(gn - bn)[:MAX_HOSTS] if bad_nodes is not None else []},
        "truncated": len(keys) - len(kept),
    }


# -------------------------------------------------------------------------------------------- sentence


def _val(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "(none)"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _changes(diff: Mapping[str, Any], esc: Callable[[str], str]) -> tuple[list[str], int]:
    items: list[str] = []

    def pair(name: str, p: Any, fmt: Callable[[Any], str] = _val) -> None:
        if isinstance(p, list) and len(p) == 2 and p[0] != p[1]:
            items.append(f"{esc(name)} {esc(fmt(p[0]))} → {esc(fmt(p[1]))}")

    pair("world_size", diff.get("world_size"))
    pair("nodes", diff.get("nodes"))
    pair("device", diff.get("device_type"))
    pair("mp_size", diff.get("mp_size"))
    for k, p in (diff.get("config") or {}).items():
        pair(f"config.{k}", p)
    pair("commit", diff.get("commit"), lambda c: _val(c)[:12])
    for k, p in (diff.get("meta") or {}).items():
        pair(f"meta.{k}", p)
    hosts = diff.get("hosts") or {}
    if hosts.get("added") or hosts.get("removed"):
        parts = [f"+{h}" for h in hosts.get("added") or []] + [f"−{h}" for h in hosts.get("removed") or []]
        items.append("nodes " + esc(" ".join(parts[:4])) + (" …" if len(parts) > 4 else ""))
    more = int(diff.get("truncated") or 0)
    if len(items) > SENTENCE_ITEMS:
        more += len(items) - SENTENCE_ITEMS
        items = items[:SENTENCE_ITEMS]
    return items, more


def explanation(metric: str, change: float | None, before: float | None, after: float | None, unit: str | None,
                cause: Mapping[str, Any] | None, diff: Mapping[str, Any] | None, *,
                esc: Callable[[str], str] = str) -> str | None:
    """One sentence: what moved, which component explains it, and what changed, e.g. "step time +18 %
    (1.02 s → 1.20 s): exposed comm explains 83 % of it (100 ms → 250 ms); changed: world_size 64 → 128,
    config.fsdp.prefetch true → false". ``esc`` is applied to every user-supplied string (Slack).
    None when the alert has neither a cause nor a diff."""
    if not cause and not diff:
        return None
    if (cause or {}).get("basis") == "rank_vs_median" or (diff or {}).get("kind") == "rank_vs_peers":
        return _straggler_sentence(cause, diff, esc)
    head = ""
    if metric != "step_s" and change is not None:
        head = f"{esc(metric_label(metric))} {_pct(change)} ({format_metric(before, unit, metric)} → " \
               f"{format_metric(after, unit, metric)})"
    parts = []
    if cause:
        per = cause.get("basis") == "per_1k_tokens"
        fmt = (lambda v: f"{_fmt_s(v)}/1k tokens") if per else _fmt_s
        step = f"step time{' per 1k tokens' if per else ''} {_pct(cause['step_change'])} " \
               f"({fmt(cause['step_before'])} → {fmt(cause['step_after'])})"
        why = f"{cause.get('label') or cause['component']} explains {100 * cause['share_of_change']:.0f} % of it " \
              f"({fmt(cause['before'])} → {fmt(cause['after'])}"
        where = []
        if cause.get("dim"):
            where.append(f"dim {esc(str(cause['dim']['name']))}")
        if cause.get("op"):
            where.append(esc(str(cause["op"]["name"])))
        why += (", mostly " + " ".join(where) if where else "") + ")"
        parts.append(f"{step}: {why}" if not head else f"{head}; {step}: {why}")
    elif head:
        parts.append(head)
    if diff:
        items, more = _changes(diff, esc)
        if items:
            parts.append("changed: " + ", ".join(items) + (f" and {more} more" if more else ""))
        else:
            parts.append("no config, commit, scale, node or version change recorded")
    return "; ".join(p for p in parts if p)


def _straggler_sentence(cause: Mapping[str, Any] | None, diff: Mapping[str, Any] | None,
                        esc: Callable[[str], str]) -> str:
    """e.g. "rank 9's work is 1.28x the median rank's: compute explains 97 % of its excess (120 ms → 151 ms
    per step); rank 9 is on node0001 (local_rank 1), 1 of its node's 8 ranks straggles"."""
    parts = []
    if cause:
        sd = cause.get("slowdown")
        who = f"rank {cause.get('rank')}'s work" + (f" is {float(sd):.2f}x the median rank's" if sd else "")
        b, a = cause.get("before"), cause.get("after")
        lvl = f"{_fmt_s(b)} → {_fmt_s(a)} per step" if b is not None and a is not None \
            else f"+{_fmt_s(cause.get('excess_s') or 0.0)} per step"
        if cause.get("component") is not None:
            parts.append(f"{who}: {esc(str(cause.get('label') or cause['component']))} explains "
                         f"{100 * cause['share_of_change']:.0f} % of its excess ({lvl})")
        dev = cause.get("device")
        if isinstance(dev, Mapping) and dev.get("text"):  # its GPU's telemetry (analysis/devices.py)
            text = str(dev["text"])
            parts.append(text.split("; ", 1)[1] if "; " in text and parts else text)
    if diff:
        where = f"rank {diff.get('rank')} is on {esc(str(diff.get('node') or diff.get('host') or 'an unknown node'))}"
        extra = []
        if diff.get("local_rank") is not None:
            extra.append(f"local_rank {esc(str(diff['local_rank']))}")
        dev = diff.get("device")
        if isinstance(dev, list) and len(dev) == 2 and dev[1] is not None and dev[0] is not None and dev[0] != dev[1]:
            extra.append(f"device {esc(str(dev[1]))} while its peers have {esc(str(dev[0]))}")
        if extra:
            where += f" ({', '.join(extra)})"
        n, k = diff.get("node_ranks") or 0, diff.get("node_straggler_ranks") or 0
        if n:
            where += f", {k} of its node's {n} ranks straggle" + (" (the node is the cause)" if diff.get("node_flagged") else "")
        if diff.get("tokens_ratio") is not None:
            where += f", it gets {float(diff['tokens_ratio']):.2f}x the median rank's tokens"
        for m, r in (diff.get("modalities") or {}).items():
            where += f", {float(r):.2f}x the median rank's {esc(str(m))} tokens"
        parts.append(where)
    return "; ".join(parts)
