"""Memory explained per module, measured once per run with the FLOP count (docs/agent.md, "Memory per module").

:class:`ModuleMemoryMeter` rides on the step whose FLOPs are measured (``mfu.FlopMeter``: from the first
step's forward to its optimizer update, the step flagged ``FLAG_FLOPS_MEASURED``). For that step only:

* global module forward pre/post hooks (``register_module_forward_pre_hook``) keep the stack of the
  modules being run, on the training thread;
* a *delegating observer* is pushed on autograd's saved-tensors hook stack
  (``torch.autograd.graph.saved_tensors_hooks``) for the first top-level forward: its pack hook notes the
  saved tensor (its storage: a view keeps its whole storage alive; each storage counted once, by the
  innermost module that saved it first) and hands the tensor to whatever hook was on top before it
  (none: the tensor itself), so what autograd keeps is unchanged. Where a module's forward runs under
  another hook (``torch.utils.checkpoint``'s, ``save_on_cpu``'s) a new observer is pushed over it at
  that module's pre-hook and popped at its post-hook: under non-reentrant checkpointing the tensors it
  sees are the ones checkpointing drops (``ckpt_saved_bytes``: what un-checkpointing would add);
* storages that are parameters' (the saved weights of a matmul) are counted as ``param_saved_bytes``,
  not activations; a checkpointed module also keeps its inputs alive (``input_bytes``: its input
  storages that no module outside it saves);
* a module whose forward runs again inside backward (recomputation: reentrant or not) is marked
  ``checkpointed``, as is a ``checkpoint_wrapper``;
* forward FLOPs per module (inclusive of its children) come from the FLOP counter (``on_fwd``);
* at the optimizer pre-hook (``stop``): parameters and gradients per module, as held by this rank
  (DTensor local shards under FSDP2/TP, FSDP1's flat parameter shard); at the optimizer's first
  post-hook: its state per parameter (a ZeRO-style optimizer's local state only) — then one
  ``memory_modules`` event is sent.

Bounded: at most ``MAX_MODULES`` entries (whole depth levels of the module tree while they fit; deeper
modules fold into their nearest listed ancestor). Every hook is guarded: a failure ends the measurement
and is never raised into training. Cost: the hooks run for one step only (``cost_s`` in the event).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["ModuleMemoryMeter", "MAX_MODULES", "clean_name"]

log = logging.getLogger(__name__)

#: meters waiting for the next optimizer step to read its state (ModuleMemoryMeter.stop). One global
#: optimizer post-hook per process dispatches to them and is never removed: removing a hook from inside
#: torch's hook loop (a lazy iteration over its OrderedDicts) raises "OrderedDict mutated during
#: iteration" in the training step whenever another hook follows it.
_PENDING: list[Any] = []
_DISPATCH: list[Any] = []  # the hook's handle, once registered
_DISPATCH_LOCK = threading.Lock()


def _dispatch_optimizer_step(opt: Any, args: Any, kwargs: Any) -> None:
    if not _PENDING:
        return
    with _DISPATCH_LOCK:
        waiting = list(_PENDING)
        _PENDING.clear()
    for meter in waiting:
        meter._optimizer_post(opt, args, kwargs)  # guarded inside: never raises


def _await_optimizer_step(meter: Any) -> None:
    """Have ``meter._optimizer_post`` called at the next optimizer step (once)."""
    with _DISPATCH_LOCK:
        if not _DISPATCH:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _DISPATCH.append(register_optimizer_step_post_hook(_dispatch_optimizer_step))
        _PENDING.append(meter)

MAX_MODULES = 256
"""Module entries one ``memory_modules`` event lists at most (the root included)."""

_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_wrapped_module"})
ROOT = "(model)"

Emit = Callable[[dict[str, Any]], None]


def clean_name(raw: str, strip_module: bool) -> str:
    """A module's name without wrapper segments (compile, FSDP1, checkpoint_wrapper; DDP's leading
    ``module``): the name the user's model gives it. The root is ``(model)``."""
    parts = [p for p in raw.split(".") if p and p not in _WRAPPER_SEGMENTS]
    if strip_module and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts) or ROOT


def _local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2, TP), an FSDP1 flat parameter's local shard; else the tensor."""
    inner = getattr(t, "_local_tensor", None)
    if inner is not None:
        return inner
    shard = getattr(t, "_local_shard", None)
    return shard if shard is not None else t


def _tensor_bytes(t: Any) -> int:
    try:
        t = _local(t)
        return int(t.numel()) * int(t.element_size())
    except Exception:  # noqa: BLE001 - not a tensor
        return 0


def _storage_key(t: Any) -> tuple[tuple[str, int], int] | None:
    """((device, storage address), storage bytes) of a tensor; None for tensors without storage."""
    try:
        t = _local(t)
        s = t.untyped_storage()
        return (str(t.device), int(s.data_ptr())), int(s.nbytes())
    except Exception:  # noqa: BLE001 - a subclass without storage, a meta/fake tensor
        return None


class _Obs:
    """One observer pushed on the saved-tensors hook stack, delegating to the hook below it."""

    __slots__ = ("ctx", "pack", "owner", "under")

    def __init__(self, ctx: Any, pack: Any, owner: int | None, under: str) -> None:
        self.ctx = ctx
        self.pack = pack
        self.owner = owner  # id of the module whose post-hook pops it (None: the top-level observer)
        self.under = under  # "none" | "checkpoint" | "other": the hook it delegates to


def _hook_kind(top: Any) -> str:
    if top is None:
        return "none"
    name = str(getattr(top[0], "__qualname__", ""))
    if "_checkpoint_hook" in name or "_recomputation_hook" in name:
        return "checkpoint"
    return "other"


class ModuleMemoryMeter:
    """Per-module saved tensors, parameters, gradients, optimizer state and forward FLOPs of one step
    (module docstring). ``start`` / ``stop`` bracket the measured step on the training thread;
    ``emit`` receives the event's data once (after the optimizer's first update)."""

    def __init__(self, emit: Emit | None, max_modules: int = MAX_MODULES) -> None:
        self.emit = emit
        self.max_modules = max(1, int(max_modules))
        self.failed: str | None = None
        self.done = False
        self._torch: Any = None
        self._tid = 0
        self._hooks: list[Any] = []
        self._stack: list[int] = []  # ids of the modules being run (training thread)
        self._mods: dict[int, Any] = {}  # id -> module, every module seen running
        self._order: list[int] = []
        self._saved: dict[tuple[str, int], list[Any]] = {}  # storage -> [module id, bytes, weakref]
        self._ckpt: dict[tuple[str, int], list[Any]] = {}  # tensors a checkpoint dropped (live ones)
        self._ckpt_log: list[tuple[int, tuple[str, int], int]] = []  # (module id, storage, bytes) as noted
        self._ckpt_inputs: set[tuple[str, int]] = set()
        self._inputs: dict[int, dict[tuple[str, int], int]] = {}  # module id -> input storages
        self._flops: dict[int, int] = {}
        self._root_flops = 0
        self._under_ckpt: set[int] = set()
        self._recomputed: set[int] = set()
        self._obs: list[_Obs] = []
        self._window = False  # the first top-level forward is running
        self._root: Any = None
        self._forwards = 0
        self._micro_batch: int | None = None
        self._cost_ns = 0
        self._state: dict[str, Any] = {}
        self._params: dict[int, int] = {}  # id(param) -> module id

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        t0 = time.perf_counter_ns()
        try:
            import torch
            from torch.nn.modules import module as nn_module

            self._torch = torch
            self._tid = threading.get_ident()
            self._hooks = [nn_module.register_module_forward_pre_hook(self._pre),
                           nn_module.register_module_forward_hook(self._post)]
            self._window = True
            self._push(None)
            for module, args in _running_modules(torch):
                self._pre(module, args)  # started inside a forward (automatic mode's pre-hook): it is the root
        except Exception as e:  # noqa: BLE001
            self._fail("start", e)
        self._cost_ns += time.perf_counter_ns() - t0

    def cancel(self) -> None:
        """End without a result (the measured step was dropped)."""
        self._remove_hooks()
        self._pop_all()
        self.done = True

    def stop(self) -> None:
        """At the optimizer's pre-hook: forward hooks off; parameters and gradients read; the optimizer's
        state is read at its first post-hook (a global optimizer post-hook, removed once it fired)."""
        t0 = time.perf_counter_ns()
        self._remove_hooks()
        self._pop_all()
        if self.failed is not None or self.done:
            self.done = True
            return
        try:
            self._collect()
            _await_optimizer_step(self)
        except Exception as e:  # noqa: BLE001
            self._fail("stop", e)
            self.done = True
        self._cost_ns += time.perf_counter_ns() - t0

    def _fail(self, where: str, e: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{where}: {type(e).__name__}"
            log.info("fleetscope: memory per module not measured (%s: %r)", where, e)
        self._window = False

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooks = []

    # ------------------------------------------------------------------ saved-tensor observers
    def _top(self) -> Any:
        try:
            return self._torch._C._autograd._top_saved_tensors_default_hooks(False)
        except Exception:  # noqa: BLE001 - a torch without it: only the top-level observer
            return None

    def _push(self, owner: int | None) -> None:
        top = self._top()
        under = _hook_kind(top)
        prev_pack = top[0] if top is not None else None
        prev_unpack = top[1] if top is not None else None
        ckpt = under == "checkpoint"

        def pack(x: Any) -> Any:
            try:
                if self._window:
                    self._note(x, ckpt)
            except Exception as e:  # noqa: BLE001
                self._fail("pack", e)
            return prev_pack(x) if prev_pack is not None else x

        def unpack(x: Any) -> Any:
            return prev_unpack(x) if prev_unpack is not None else x

        ctx = self._torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        self._obs.append(_Obs(ctx, pack, owner, under))

    def _pop(self) -> bool:
        """Pop the newest observer when it is on top of the hook stack (else leave the stack alone)."""
        ob = self._obs[-1]
        top = self._top()
        if top is not None and top[0] is not ob.pack:
            return False
        self._obs.pop()
        ob.ctx.__exit__(None, None, None)
        return True

    def _pop_all(self) -> None:
        self._window = False
        try:
            while self._obs and threading.get_ident() == self._tid:
                if not self._pop():
                    break  # another hook sits above ours: ours stays, observing nothing (_window off)
        except Exception as e:  # noqa: BLE001
            self._fail("pop", e)

    def _note(self, x: Any, ckpt: bool) -> None:
        got = _storage_key(x)
        if got is None:
            return
        key, nbytes = got
        table = self._ckpt if ckpt else self._saved
        old = table.get(key)
        if old is not None and old[2]() is not None:
            return  # this storage is already counted
        if ckpt:
            # a checkpoint drops what it is handed, so the address may be reused later: the entry is
            # tallied now. What stays alive anyway (saved outside, the checkpoint's own inputs) is not.
            live = self._saved.get(key)
            if (live is not None and live[2]() is not None) or key in self._ckpt_inputs:
                return
        owner = self._stack[-1] if self._stack else 0  # 0: the root's own body (not on the stack)
        try:
            ref: Any = weakref.ref(x)
        except TypeError:
            ref = lambda: x  # noqa: E731 - not weak-referenceable: keep the entry
        par = self._torch.nn.Parameter
        # a parameter (or a view of one): FSDP2's unsharded parameters are not the module's registered ones
        is_param = isinstance(x, par) or isinstance(getattr(x, "_base", None), par)
        table[key] = [owner, nbytes, ref, is_param]
        if ckpt:
            self._ckpt_log.append((owner, key, nbytes))

    # ------------------------------------------------------------------ module hooks
    def _pre(self, module: Any, args: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            if self._torch._C._current_graph_task_id() != -1:
                if self._torch.is_grad_enabled():
                    self._recomputed.add(id(module))  # a forward re-run inside backward: checkpointing
                return
            if threading.get_ident() != self._tid:
                return
            mid = id(module)
            if mid not in self._mods:
                self._mods[mid] = module
                self._order.append(mid)
            if not self._window:
                self._stack.append(mid)
                return
            if not self._stack and self._micro_batch is None:
                self._micro_batch = _batch_dim(args)
            self._stack.append(mid)
            if self._obs:
                top = self._top()
                if top is not None and top[0] is not self._obs[-1].pack:
                    self._push(mid)  # a hook was pushed since ours (checkpoint, save_on_cpu): observe over it
                    if self._obs[-1].under == "checkpoint":
                        for a in args if isinstance(args, (tuple, list)) else (args,):
                            got_in = _storage_key(a) if self._torch.is_tensor(a) else None
                            if got_in is not None:
                                self._ckpt_inputs.add(got_in[0])  # kept alive by the checkpoint
            if self._obs and self._obs[-1].under == "checkpoint":
                self._under_ckpt.add(mid)
            ins = self._inputs.setdefault(mid, {})
            for a in args if isinstance(args, (tuple, list)) else (args,):
                if self._torch.is_tensor(a):
                    got = _storage_key(a)
                    if got is not None:
                        ins[got[0]] = got[1]
        except Exception as e:  # noqa: BLE001
            self._fail("pre", e)
        finally:
            self._cost_ns += time.perf_counter_ns() - t0

    def _post(self, module: Any, args: Any, output: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            if threading.get_ident() != self._tid or self._torch._C._current_graph_task_id() != -1:
                return
            mid = id(module)
            if self._stack and self._stack[-1] == mid:
                self._stack.pop()
                if self._obs and self._obs[-1].owner == mid:
                    self._pop()
                if self._stack:
                    return
            elif mid not in self._mods:  # the module that started the meter (its pre-hook ran before ours)
                self._mods[mid] = module
                self._order.append(mid)
            else:
                return
            # the end of a top-level forward: the model's (the first), or another top-level module's (a loss)
            if self._root is None:
                self._root = module
            if module is self._root:
                self._forwards += 1  # micro-batches of the step
            if self._window:
                self._window = False
                while len(self._obs) > 0 and self._pop():
                    pass
        except Exception as e:  # noqa: BLE001
            self._fail("post", e)
        finally:
            self._cost_ns += time.perf_counter_ns() - t0

    def add_flops(self, n: int) -> None:
        """Forward FLOPs counted by the FLOP meter: to every module being run (inclusive) and the root."""
        if not self._window or threading.get_ident() != self._tid:
            return
        self._root_flops += n
        fl = self._flops
        for mid in set(self._stack):
            fl[mid] = fl.get(mid, 0) + n

    # ------------------------------------------------------------------ results
    def _collect(self) -> None:
        root = self._root
        if root is None:
            raise RuntimeError("no top-level forward seen")
        strip = type(root).__name__ in ("DistributedDataParallel", "DataParallel")
        names: dict[int, str] = {}
        kinds: dict[str, str] = {}
        ckpt_wrapped: set[str] = set()
        for raw, m in root.named_modules(remove_duplicate=True):
            n = clean_name(raw, strip)
            names[id(m)] = n
            kinds.setdefault(n, type(m).__name__)
            if "CheckpointWrapper" in type(m).__name__:
                ckpt_wrapped.add(n)
        names[0] = ROOT
        names[id(root)] = ROOT
        self._names = names
        params: dict[str, int] = {}
        grads: dict[str, int] = {}
        pstore: set[tuple[str, int]] = set()
        for m in root.modules():
            n = names.get(id(m), ROOT)
            for p in m.parameters(recurse=False):
                if id(p) in self._params:
                    continue
                self._params[id(p)] = id(m)
                params[n] = params.get(n, 0) + _tensor_bytes(p)
                g = getattr(p, "grad", None)
                if g is not None:
                    grads[n] = grads.get(n, 0) + _tensor_bytes(g)
                got = _storage_key(p)
                if got is not None:
                    pstore.add(got[0])
        # saved storages: activations vs parameters; bytes as retained now (FSDP2 frees what it unsharded)
        checkpointed = set(ckpt_wrapped)
        checkpointed.update(names[m] for m in self._under_ckpt | self._recomputed if m in names)
        roots = {n for n in checkpointed if n != ROOT and not any(a in checkpointed for a in _ancestors(n))}
        # a checkpoint saves its inputs (non-reentrant: before the module's pre-hook ran, so under its
        # caller): they are the checkpointed module's saved bytes
        root_inputs: dict[tuple[str, int], str] = {}
        for mid, ins in self._inputs.items():
            if names.get(mid) in roots:
                for key in ins:
                    root_inputs.setdefault(key, names[mid])
        act: dict[str, int] = {}
        psaved: dict[str, int] = {}
        saver: dict[tuple[str, int], str] = {}
        for key, (owner, nbytes, ref, is_param) in self._saved.items():
            n = names.get(owner, ROOT)
            r = root_inputs.get(key)
            if r is not None and (n == ROOT or n in _ancestors(r)):
                n = r
            t = ref()
            if t is not None:
                got = _storage_key(t)
                nbytes = got[1] if got is not None else nbytes
            saver[key] = n
            if key in pstore or is_param:
                psaved[n] = psaved.get(n, 0) + nbytes
            else:
                act[n] = act.get(n, 0) + nbytes
        inputs: dict[str, int] = {}
        retained: set[tuple[str, int]] = set()
        for mid, ins in self._inputs.items():
            nm = names.get(mid)
            if nm is None or nm == ROOT:
                continue
            n = nm
            tot = 0
            for key, nb in ins.items():
                owner = saver.get(key)
                if key in pstore:
                    continue
                if owner is None or owner == n or owner.startswith(n + "."):
                    tot += nb  # kept only because this module (or nothing outside it) saves it
                if n in roots and owner is None and key not in retained:
                    retained.add(key)  # a checkpoint keeps its inputs alive: its saved bytes
                    act[n] = act.get(n, 0) + nb
            inputs[n] = max(inputs.get(n, 0), tot)
        ck: dict[str, int] = {}
        for owner, key, nbytes in self._ckpt_log:
            if key in pstore:
                continue  # parameters are not added by un-checkpointing
            n = names.get(owner, ROOT)
            ck[n] = ck.get(n, 0) + nbytes
        flops: dict[str, int] = {ROOT: self._root_flops}
        for mid, f in self._flops.items():
            fn = names.get(mid)
            if fn is not None and fn != ROOT:
                flops[fn] = max(flops.get(fn, 0), f)
        self._state = {"act": act, "psaved": psaved, "ck": ck, "params": params, "grads": grads, "flops": flops,
                       "inputs": inputs, "ckpt": checkpointed, "kinds": kinds,
                       "all": [names[id(m)] for m in root.modules() if id(m) in names]}

    def _optimizer_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            if self.done:
                return
            self.done = True
            inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer: the local optimizer's state
            state = getattr(inner, "state", None) if inner is not None and hasattr(inner, "param_groups") else None
            state = state if state is not None else getattr(opt, "state", {})
            optim: dict[str, int] = {}
            names = self._names
            seen: set[tuple[str, int]] = set()
            for p, st in list(state.items()):
                mid = self._params.get(id(p))
                n = names.get(mid, ROOT) if mid is not None else ROOT
                for v in (st.values() if isinstance(st, dict) else ()):
                    got = _storage_key(v) if self._torch.is_tensor(v) else None
                    if got is None or got[0] in seen:
                        continue
                    seen.add(got[0])
                    optim[n] = optim.get(n, 0) + _tensor_bytes(v)
            self._state["optim"] = optim
            self._state["optimizer"] = type(inner if state is not getattr(opt, "state", None) else opt).__name__
            self._cost_ns += time.perf_counter_ns() - t0
            data = self.event()
            # what the measurement held (modules, storages' addresses) is let go before sending
            self._saved, self._ckpt, self._inputs, self._mods, self._root = {}, {}, {}, {}, None
            self._order, self._ckpt_log, self._params = [], [], {}
            if self.emit is not None:
                self.emit(data)
        except Exception as e:  # noqa: BLE001
            self._fail("optimizer", e)

    def event(self) -> dict[str, Any]:
        """The ``memory_modules`` event's data: per listed module (columns), totals and how it was measured."""
        s = self._state
        listed = _select(s["all"], self.max_modules)
        ls = set(listed)
        fold = {n: _listed_ancestor(n, ls) for n in s["all"]}
        cols: dict[str, list[Any]] = {k: [0] * len(listed) for k in (
            "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes", "param_saved_bytes", "ckpt_saved_bytes")}
        index = {n: i for i, n in enumerate(listed)}
        for col, src in (("activation_bytes", "act"), ("param_bytes", "params"), ("grad_bytes", "grads"),
                         ("optim_bytes", "optim"), ("param_saved_bytes", "psaved"), ("ckpt_saved_bytes", "ck")):
            for n, v in s.get(src, {}).items():
                cols[col][index[fold.get(n, ROOT)]] += int(v)
        flops = s["flops"]
        cols["flops"] = [flops.get(n) for n in listed]
        cols["input_bytes"] = [s["inputs"].get(n) for n in listed]
        cols["checkpointed"] = [n in s["ckpt"] for n in listed]
        cols["type"] = [s["kinds"].get(n, "")[:64] for n in listed]
        totals = {c: sum(v for v in cols[c] if v) for c in ("activation_bytes", "param_bytes", "grad_bytes",
                                                         "optim_bytes", "param_saved_bytes", "ckpt_saved_bytes")}
        dev_total = None
        torch = self._torch
        try:
            if torch is not None and torch.cuda.is_initialized():
                dev_total = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        except Exception:  # noqa: BLE001
            dev_total = None
        return {"modules": {"name": [n[:200] for n in listed], **cols}, "totals": totals,
                "modules_total": len(s["all"]), "forwards": self._forwards, "micro_batch": self._micro_batch,
                "forward_flops": self._root_flops, "device_total_bytes": dev_total,
                "optimizer": s.get("optimizer"), "cost_s": self._cost_ns / 1e9, "method": "saved_tensors_hooks"}


def _running_modules(torch: Any) -> list[tuple[Any, Any]]:
    """The modules whose ``__call__`` is on this thread's Python stack, outermost first, with their
    positional arguments (a meter started from a module's forward pre-hook runs inside its call)."""
    code = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
    out: list[tuple[Any, Any]] = []
    f: Any = sys._getframe(1)
    while f is not None and code is not None:
        if f.f_code is code:
            m = f.f_locals.get("self")
            if isinstance(m, torch.nn.Module):
                out.append((m, f.f_locals.get("args", ())))
        f = f.f_back
    out.reverse()
    return out


def _batch_dim(args: Any) -> int | None:
    for a in args if isinstance(args, (tuple, list)) else (args,):
        shape = getattr(a, "shape", None)
        if shape is not None and len(shape) >= 1:
            return int(shape[0])
    return None


def _select(names: list[str], cap: int) -> list[str]:
    """The listed modules: the root, then whole depth levels while they fit under ``cap`` (a first level
    that does not fit: its first modules in model order, the rest folded into the root)."""
    depth: dict[str, int] = {n: (0 if n == ROOT else n.count(".") + 1) for n in dict.fromkeys(names)}
    out = [ROOT]
    level = 1
    while len(out) < cap:
        row = [n for n, d in depth.items() if d == level]
        if not row:
            break
        if len(out) + len(row) > cap:
            if level == 1:
                out.extend(row[: cap - len(out)])
            break
        out.extend(row)
        level += 1
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _listed_ancestor(name: str, s: set[str]) -> str:
    n = name
    while n not in s:
        if "." not in n:
            return ROOT
        n = n.rsplit(".", 1)[0]
    return n


def meter_enabled() -> bool:
    """``FLEETSCOPE_MEMORY_MODULES=0`` turns the measurement off (default on, with the FLOP count)."""
    import os

    return os.environ.get("FLEETSCOPE_MEMORY_MODULES", "1").strip().lower() not in ("0", "false", "no", "off")

