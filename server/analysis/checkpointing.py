"""Memory explained per module and activation-checkpointing advice with its price (docs/metrics.md,
"Memory per module", "Checkpointing advice"). Pure: from one rank's ``memory_modules`` event (the
agent's measurement, agent/memory_modules.py), the rank's peak and the run's achieved FLOP/s.

* ``modules``: per listed module its own saved bytes (``activation_bytes``: storages it saved first
  during one forward; a checkpointed module: the inputs the checkpoint keeps), parameters, gradients,
  optimizer state (this rank's shards), ``flops`` (forward FLOPs of one micro-batch, its children
  included), ``checkpointed``.
* ``breakdown``: the step's peak split into parameters + gradients + optimizer state + activations
  (one micro-batch's saved tensors) + temporaries = peak − the rest (estimated: everything not held
  across the step, plus, on a CPU run, the process's non-tensor memory).
* advice: checkpointing module *m* (wrapping it in ``torch.utils.checkpoint`` or
  ``checkpoint_wrapper``) frees the saved bytes of its subtree except the inputs the checkpoint keeps
  (``saves(m) = subtree activations − input_bytes``) and re-runs its forward in backward
  (``recompute_flops = flops(m) × forwards per step``); ``step_s_cost = recompute_flops / achieved
  FLOP/s`` (hardware FLOPs per step / compute seconds per step, measured). The advised set is the
  cheapest antichain (no module with its ancestor) whose savings reach ``peak − target``: exact search
  over up to ``EXACT_MAX`` candidates, else greedy by bytes saved per recompute FLOP then pruned.
* reverse: when the target leaves room and modules are checkpointed, the checkpointed blocks whose
  dropped activations (``ckpt_saved_bytes``, measured under the checkpoint) fit the room, most
  recompute first ("un-checkpoint blocks.0–11: +9.0 GiB, −6 % step time").
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ModuleRow", "decode_modules", "subtree_sums", "candidates", "cheapest_set", "breakdown",
           "default_target", "checkpoint_advice", "label_modules", "EXACT_MAX", "ROOT"]

ROOT = "(model)"
EXACT_MAX = 20
"""Candidates up to which the advised set is searched exactly (branch and bound); beyond, greedy."""

_COLS = ("activation_bytes", "param_bytes", "grad_bytes", "optim_bytes", "param_saved_bytes", "ckpt_saved_bytes")


@dataclass(frozen=True, slots=True)
class ModuleRow:
    name: str
    type: str
    activation_bytes: float
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    param_saved_bytes: float
    ckpt_saved_bytes: float
    input_bytes: float | None
    flops: float | None
    checkpointed: bool

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "activation_bytes": self.activation_bytes,
                "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "optim_bytes": self.optim_bytes,
                "param_saved_bytes": self.param_saved_bytes, "ckpt_saved_bytes": self.ckpt_saved_bytes,
                "input_bytes": self.input_bytes, "flops": self.flops, "checkpointed": self.checkpointed}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and 0 <= f <= 1e21 else None


def decode_modules(data: Mapping[str, Any] | None, limit: int = 4096) -> list[ModuleRow]:
    """The event's columns (``modules``: {"name": [...], "activation_bytes": [...], ...}) as rows; values
    that are not numbers in range read as 0 / None (whatever a client stored). Names are unique."""
    cols = data.get("modules") if isinstance(data, Mapping) else None
    if not isinstance(cols, Mapping) or not isinstance(cols.get("name"), list):
        return []
    names = cols["name"][:limit]

    def col(k: str, i: int) -> Any:
        c = cols.get(k)
        return c[i] if isinstance(c, list) and i < len(c) else None

    out: list[ModuleRow] = []
    seen: set[str] = set()
    for i, n in enumerate(names):
        if not isinstance(n, str) or n in seen:
            continue
        seen.add(n)
        t = col("type", i)
        act, par, grad, opt, psaved, dropped = (_num(col(k, i)) or 0.0 for k in _COLS)
        out.append(ModuleRow(n[:200], t[:64] if isinstance(t, str) else "", act, par, grad, opt, psaved, dropped,
                             _num(col("input_bytes", i)), _num(col("flops", i)), col("checkpointed", i) is True))
    return out


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ROOT


def _ancestors(name: str) -> list[str]:
    if name == ROOT:
        return []
    parts = name.split(".")
    return [ROOT] + [".".join(parts[:i]) for i in range(1, len(parts))]


def subtree_sums(rows: Sequence[ModuleRow], col: str) -> dict[str, float]:
    """Per module, ``col`` summed over the module and every listed module under it."""
    names = {r.name for r in rows}
    out = {r.name: 0.0 for r in rows}
    for r in rows:
        v = float(getattr(r, col))
        out[r.name] += v
        for a in _ancestors(r.name):
            if a in names and a != r.name:
                out[a] += v
    return out


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    saves: float  # bytes freed per micro-batch
    flops: float  # forward FLOPs of one micro-batch (recomputed in backward)


def _ckpt_roots(rows: Sequence[ModuleRow]) -> list[ModuleRow]:
    ck = {r.name for r in rows if r.checkpointed}
    return [r for r in rows if r.checkpointed and r.name != ROOT and not any(a in ck for a in _ancestors(r.name))]


def candidates(rows: Sequence[ModuleRow]) -> list[Candidate]:
    """Modules that checkpointing would help: not the root, not checkpointed nor under a checkpointed
    module, forward FLOPs known, saving more than nothing."""
    act = subtree_sums(rows, "activation_bytes")
    ck = {r.name for r in rows if r.checkpointed}
    out = []
    for r in rows:
        if r.name == ROOT or r.checkpointed or any(a in ck for a in _ancestors(r.name)) or r.flops is None:
            continue
        saves = act[r.name] - (r.input_bytes or 0.0)
        if saves > 0:
            out.append(Candidate(r.name, saves, float(r.flops)))
    return out


def _overlaps(a: str, b: str) -> bool:
    return a == b or b.startswith(a + ".") or a.startswith(b + ".") or a == ROOT or b == ROOT


def cheapest_set(cands: Sequence[Candidate], need: float) -> tuple[list[Candidate], str] | None:
    """The antichain of candidates saving ≥ ``need`` bytes at the least FLOPs (ties: fewer bytes
    saved... then fewer modules); None when even all of them cannot. Exact (branch and bound) over up
    to EXACT_MAX candidates (method ``"exact"``), else ``"greedy"``."""
    if need <= 0:
        return [], "exact"
    cs = sorted(cands, key=lambda c: (-c.saves, c.flops, c.name))
    if _max_saving(cs) < need:
        return None
    if len(cs) <= EXACT_MAX:
        return _exact(cs, need), "exact"
    return _greedy(cs, need), "greedy"


def _max_saving(cs: Sequence[Candidate]) -> float:
    """The most an antichain can save: per candidate, itself or the best of the candidates nearest
    under it, bottom-up."""
    by = {c.name: c for c in cs}
    kids: dict[str | None, list[str]] = {}
    for n in by:
        kids.setdefault(_nearest(n, by), []).append(n)
    best: dict[str, float] = {}
    for n in sorted(by, key=lambda n: -n.count(".")):
        best[n] = max(by[n].saves, sum(best[k] for k in kids.get(n, [])))
    return sum(best[k] for k in kids.get(None, []))


def _nearest(name: str, by: Mapping[str, Any]) -> str | None:
    """The nearest ancestor of ``name`` among the candidates, None at the top."""
    for a in reversed(_ancestors(name)):
        if a in by:
            return a
    return None


def _exact(cs: Sequence[Candidate], need: float) -> list[Candidate]:
    best: list[Candidate] | None = None
    best_cost = math.inf
    suffix = [0.0] * (len(cs) + 1)
    for i in range(len(cs) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + cs[i].saves  # an upper bound of what the rest can add

    def go(i: int, chosen: list[Candidate], saved: float, cost: float) -> None:
        nonlocal best, best_cost
        if saved >= need:
            if cost < best_cost or (cost == best_cost and best is not None and len(chosen) < len(best)):
                best, best_cost = list(chosen), cost
            return
        if i == len(cs) or cost >= best_cost or saved + suffix[i] < need:
            return
        c = cs[i]
        if not any(_overlaps(c.name, o.name) for o in chosen):
            chosen.append(c)
            go(i + 1, chosen, saved + c.saves, cost + c.flops)
            chosen.pop()
        go(i + 1, chosen, saved, cost)

    go(0, [], 0.0, 0.0)
    return best or []


def _greedy(cs: Sequence[Candidate], need: float) -> list[Candidate]:
    order = sorted(cs, key=lambda c: (-(c.saves / c.flops) if c.flops > 0 else -math.inf, c.name))
    chosen: list[Candidate] = []
    saved = 0.0
    for c in order:
        if saved >= need:
            break
        if any(_overlaps(c.name, o.name) for o in chosen):
            continue
        chosen.append(c)
        saved += c.saves
    # drop what is not needed, most expensive first
    for c in sorted(chosen, key=lambda c: -c.flops):
        if saved - c.saves >= need:
            chosen.remove(c)
            saved -= c.saves
    # one module alone may be cheaper than the set
    single = min((c for c in cs if c.saves >= need), key=lambda c: c.flops, default=None)
    if single is not None and single.flops < sum(c.flops for c in chosen):
        return [single]
    return chosen


def breakdown(peak: float | None, rows: Sequence[ModuleRow], source: str | None) -> dict[str, Any] | None:
    """The peak split into its parts (module docstring); None without a peak or modules."""
    if peak is None or not rows:
        return None
    parts = {k: float(sum(getattr(r, c) for r in rows)) for k, c in (
        ("params_bytes", "param_bytes"), ("grads_bytes", "grad_bytes"), ("optimizer_bytes", "optim_bytes"),
        ("activations_bytes", "activation_bytes"))}
    rest = sum(parts.values())
    return {"peak_bytes": float(peak), **parts, "temporaries_bytes": max(0.0, float(peak) - rest),
            "temporaries_estimated": True, "over_peak": rest > float(peak),
            "note": ("peak is the process's resident set: temporaries include its non-tensor memory"
                     if source == "rss" else "temporaries = peak − the parts held across the step (estimated)")}


def default_target(peak: float, activations: float, *, device_total: float | None, micro_batch: int | None) -> tuple[float, str]:
    """(target bytes, its basis): 10 % headroom under the device's memory when known; else room for one
    more sample per micro-batch (peak − activations / micro-batch size); else 10 % under the peak."""
    if device_total:
        return 0.9 * device_total, "10 % headroom under the device memory"
    if micro_batch and micro_batch > 0 and activations > 0:
        return peak - activations / micro_batch, "room for one more sample per micro-batch"
    return 0.9 * peak, "10 % under the measured peak"


_NUM_TAIL = re.compile(r"^(.*?)(\d+)$")


def label_modules(names: Sequence[str]) -> str:
    """Names with consecutive numbered siblings folded: ``blocks.0``…``blocks.11`` → ``blocks.0–11``."""
    groups: dict[str, list[int]] = {}
    other: list[str] = []
    for n in names:
        m = _NUM_TAIL.match(n)
        if m and m.group(1).endswith("."):
            groups.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            other.append(n)
    parts: list[str] = []
    for prefix, nums in groups.items():
        nums = sorted(set(nums))
        runs: list[tuple[int, int]] = []
        for k in nums:
            if runs and k == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], k)
            else:
                runs.append((k, k))
        parts.extend(f"{prefix}{a}" if a == b else f"{prefix}{a}–{b}" for a, b in runs)
    return ", ".join(parts + other)


def _gib(b: float) -> str:
    if abs(b) >= 2**30:
        return f"{b / 2**30:.1f} GiB"
    if abs(b) >= 2**20:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / 2**10:.1f} KiB"


FRAMING = ("wrap each listed module: torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False) in "
           "its parent's forward, or per block with checkpoint_wrapper / apply_activation_checkpointing "
           "(FSDP/torchtitan-style per-block wrapping)")


def checkpoint_advice(rows: Sequence[ModuleRow], *, peak: float | None, target: float | None, target_basis: str,
                      forwards: int, flops_per_s: float | None, step_s: float | None) -> tuple[list[dict[str, Any]], str]:
    """The advice list (at most one checkpoint set and one un-checkpoint set) and a sentence on it."""
    if peak is None or target is None:
        return [], "no peak measured: no target to reach"
    fw = max(1, int(forwards or 1))

    def price(flops: float) -> tuple[float, float | None, float | None]:
        total = flops * fw
        cost = total / flops_per_s if flops_per_s else None
        return total, cost, (cost / step_s if cost is not None and step_s else None)

    need = peak - target
    out: list[dict[str, Any]] = []
    if need > 0:
        got = cheapest_set(candidates(rows), need)
        if got is None:
            return [], (f"no set of modules saves {_gib(need)} by checkpointing (target {_gib(target)}, "
                        f"{target_basis}): reduce the micro-batch or shard further")
        chosen, method = got
        saves = sum(c.saves for c in chosen)
        flops, cost, frac = price(sum(c.flops for c in chosen))
        names = [c.name for c in sorted(chosen, key=lambda c: _order_key(c.name))]
        lab = f"checkpoint {label_modules(names)}: −{_gib(saves)}" + (f", +{frac:.0%} step time" if frac is not None else "")
        out.append({"action": "checkpoint", "modules": names, "saves_bytes": saves, "recompute_flops": flops,
                    "step_s_cost": cost, "step_fraction": frac, "target_bytes": target, "target_basis": target_basis,
                    "need_bytes": need, "method": method, "fits": True, "label": lab, "framing": FRAMING,
                    # the whole forward re-run: torch's default early stop ends the recompute at the last
                    # saved tensor (a block's final matmul is not re-run), so the real price is at most this
                    "recompute_upper_bound": True})
        return out, lab
    roots = _ckpt_roots(rows)
    if not roots:
        return [], f"the peak is {_gib(-need)} under the target ({target_basis}): nothing to checkpoint"
    room = -need
    # un-checkpoint: most recompute FLOPs given back per byte added, while it fits the room
    dropped = subtree_sums(rows, "ckpt_saved_bytes")
    # what a checkpoint drops is seen under non-reentrant checkpointing only (reentrant: not measured)
    unknown = [r.name for r in roots if dropped[r.name] <= 0]
    cand = [(r, dropped[r.name], float(r.flops or 0.0)) for r in roots if dropped[r.name] > 0]
    cand.sort(key=lambda t: (-(t[2] / t[1]) if t[1] > 0 else -math.inf, _order_key(t[0].name)))
    chosen_r: list[tuple[ModuleRow, float, float]] = []
    used = 0.0
    for r, add, f in cand:
        if f > 0 and used + add <= room:
            chosen_r.append((r, add, f))
            used += add
    why = (f"; not measured for {label_modules(sorted(unknown, key=_order_key))} (reentrant checkpointing)"
           if unknown else "")
    if not chosen_r:
        return [], f"the room under the target ({_gib(room)}) does not fit un-checkpointing any block{why}"
    flops, cost, frac = price(sum(f for _, _, f in chosen_r))
    names = sorted((r.name for r, _, _ in chosen_r), key=_order_key)
    lab = f"un-checkpoint {label_modules(names)}: +{_gib(used)}" + (f", −{frac:.0%} step time" if frac is not None else "")
    out.append({"action": "uncheckpoint", "modules": names, "saves_bytes": -used, "recompute_flops": -flops,
                "step_s_cost": -cost if cost is not None else None, "step_fraction": -frac if frac is not None else None,
                "target_bytes": target, "target_basis": target_basis, "room_bytes": room, "method": "greedy",
                "fits": True, "label": lab, "framing": "remove the checkpoint wrapping of the listed modules"})
    return out, lab + why


def _order_key(name: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
