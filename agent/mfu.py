"""Model FLOPs per step and peak FLOP/s per device (docs/metrics.md, "Throughput and MFU").

Sources of a step's FLOPs, in priority order, recorded with the number (``flops_source``):
``"given"`` (``flops_per_step``/``flops_per_token``), ``"measured"`` (``FlopCounterMode`` over the
forward and backward of the first step), ``"estimated"`` (the PaLM dense-transformer formula).
torch is imported only by :class:`FlopMeter`, i.e. only when a measurement starts.

Model vs hardware FLOPs (docs/metrics.md, "MFU and HFU"): a measurement counts what the device ran —
*hardware* FLOPs, activation recomputation included. :class:`FlopMeter` splits the count by where
each op ran: outside autograd's backward (``forward``), inside it with grad mode off (``backward``),
inside it with grad mode on (``recompute``: ``torch.utils.checkpoint`` re-running a forward to rebuild
activations, reentrant or not). Model FLOPs = hardware − recompute; per token, both are taken per
computed position (padded token) of the measured step, and a step's model FLOPs count its real tokens,
its hardware FLOPs its padded ones.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "compile_seen",
    "note_compile",
    "is_compiled",
    "watch_torch_compile",
    "PEAK_FLOPS",
    "peak_flops",
    "palm_flops_per_token",
    "mfu",
    "FlopMeter",
    "FlopRates",
    "flop_rates",
    "dtype_name",
    "detect_dtype",
    "count_params",
    "env_peak_flops",
    "model_parallel_degree",
    "measure_uncompiled",
    "ENV_PEAK_FLOPS",
]

#: Dense (no sparsity) peak FLOP/s per device for bf16/fp16 training, from the vendors' datasheets.
PEAK_FLOPS: dict[str, float] = {
    # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 312 TFLOPS (624 with sparsity),
    # same for the SXM4 and PCIe parts.
    "A100": 312e12,
    # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS *with sparsity*
    # -> 989 TFLOPS dense.
    "H100": 989e12,
    # same datasheet, H100 PCIe: 1,513 TFLOPS with sparsity -> 756 TFLOPS dense.
    "H100-PCIe": 756e12,
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM BF16 1,979 TFLOPS with sparsity -> 989 dense.
    "H200": 989e12,
    # NVIDIA HGX B200 datasheet: FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity -> 2.25 dense.
    "B200": 2.25e15,
    # AMD Instinct MI300X datasheet: peak BF16/FP16 1,307.4 TFLOPS dense (2,614.9 with sparsity).
    "MI300X": 1307e12,
}

_TABLE_DTYPES = frozenset({"bf16", "bfloat16", "fp16", "float16", "half", "torch.bfloat16", "torch.float16"})


ENV_PEAK_FLOPS = "FLEETSCOPE_PEAK_FLOPS"
"""Peak dense FLOP/s per device for runs that cannot pass ``peak_flops=`` (zero-code runs, devices the
table lacks); ``init(peak_flops=...)`` wins over it, it wins over the table."""

_env_warned: set[str] = set()


def env_peak_flops(environ: Any = None) -> float | None:
    """``FLEETSCOPE_PEAK_FLOPS`` as a positive number (``"989e12"``); None when unset or unusable
    (reported once, ignored: a typo must not kill the job)."""
    import logging
    import os

    raw = (os.environ if environ is None else environ).get(ENV_PEAK_FLOPS)
    if raw in (None, ""):
        return None
    try:
        v = float(raw)
        if not v > 0 or v == float("inf"):
            raise ValueError
        return v
    except ValueError:
        if raw not in _env_warned:
            _env_warned.add(raw)
            logging.getLogger(__name__).warning("fleetscope: ignoring %s=%r (not a positive number)", ENV_PEAK_FLOPS, raw)
        return None


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8"}


def dtype_name(dtype: Any) -> str | None:
    """Short name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``); None for non-float dtypes."""
    if dtype is None:
        return None
    return _DTYPE_NAMES.get(str(dtype).replace("torch.", ""))


def detect_dtype(model: Any = None) -> tuple[str | None, str]:
    """(dtype the step computes in, how it was found): the active autocast dtype of the model's device
    (``"autocast"``), else the floating dtype holding most of the model's parameter elements
    (``"parameters"``), else torch's default dtype (``"default"``); ``(None, "unknown")`` without torch.
    Never raises."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "unknown"
    try:
        by_dtype: dict[Any, int] = {}
        dev = "cpu"
        if model is not None and hasattr(model, "parameters"):
            for p in model.parameters():
                local = getattr(p, "_local_tensor", p)  # a DTensor computes in its local shard's dtype
                if local.is_floating_point():
                    by_dtype[local.dtype] = by_dtype.get(local.dtype, 0) + int(local.numel())
                    dev = local.device.type
        for d in dict.fromkeys((dev, "cuda", "cpu")):
            if _autocast_on(torch, d):
                name = dtype_name(_autocast_dtype(torch, d))
                if name:
                    return name, "autocast"
        name = dtype_name(_forward_autocast(torch, model)) if model is not None else None
        if name:
            return name, "autocast"
        if by_dtype:
            name = dtype_name(max(by_dtype.items(), key=lambda kv: kv[1])[0])
            if name:
                return name, "parameters"
        return dtype_name(torch.get_default_dtype()), "default"
    except Exception:  # noqa: BLE001 - detection is best effort
        return None, "unknown"


def _autocast_on(torch: Any, device: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device))
    except TypeError:  # torch < 2.4: no device argument
        if device == "cuda":
            return bool(torch.is_autocast_enabled())
        fn = getattr(torch, "is_autocast_cpu_enabled", None)
        return bool(fn()) if device == "cpu" and fn is not None else False
    except Exception:  # noqa: BLE001 - a device type this torch does not know
        return False


def _forward_autocast(torch: Any, model: Any) -> Any:
    """The dtype of an enabled autocast that wraps ``model.forward`` itself, or None. Accelerate (and so
    the HF Trainer with ``bf16=True``) and ``@torch.autocast``-decorated forwards enter autocast inside
    ``forward``, after the module's forward pre-hooks, where the autocast state still reads off: the
    wrapper chain (``__wrapped__``, bound ``__func__``, accelerate's ``model_forward``) is walked and
    each function's closure searched for an ``autocast`` instance."""
    cls = getattr(getattr(torch, "amp", None), "autocast", None) or getattr(torch, "autocast", None)
    if not isinstance(cls, type):
        return None
    for _ in range(3):  # DDP / FSDP wrap the module accelerate patched: look through ``.module``
        f = getattr(model, "forward", None)
        for _ in range(8):
            if f is None:
                break
            fn = getattr(f, "__func__", f)
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(v, cls) and getattr(v, "_enabled", True):
                    return getattr(v, "fast_dtype", None)
            f = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
        model = getattr(model, "module", None)
        if model is None:
            return None
    return None


def _autocast_dtype(torch: Any, device: str) -> Any:
    fn = getattr(torch, "get_autocast_dtype", None)
    if fn is not None:
        return fn(device)
    legacy = {"cuda": "get_autocast_gpu_dtype", "cpu": "get_autocast_cpu_dtype"}.get(device)
    return getattr(torch, legacy)() if legacy and hasattr(torch, legacy) else None


#: DeviceMesh dimension names (prefixes) that split one replica's model work across ranks: tensor,
#: pipeline, context/sequence parallelism. Data-parallel dims (dp, fsdp, ddp, hsdp, replicate,
#: shard) do not.
MP_DIM_PREFIXES = ("tp", "pp", "cp", "sp", "mp", "tensor", "pipe", "context", "seq", "model")
MESH_SIZES: dict[str, int] = {}
"""DeviceMesh dim name -> size, of the meshes made while the agent records (collectives.register_mesh)."""


def model_parallel_degree() -> int | None:
    """Product of the sizes of this process's DeviceMesh dimensions that split a replica's model work
    (``MP_DIM_PREFIXES``): the meshes made after ``init`` (``MESH_SIZES``), and the
    process groups of earlier ones (``group_desc`` ``mesh_<dim>``; a 1-D mesh over the whole world
    reuses the default group and is not seen: pass ``mp_size``); None without any such dim."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return None
    try:
        if not c10d.is_initialized():
            return None
        # meshes made while the agent ran (collectives.register_mesh), then the groups meshes made
        # before it (a mesh dim spanning the whole world reuses the default group: only the former)
        sizes: dict[str, int] = {d: n for d, n in MESH_SIZES.items() if d.lower().startswith(MP_DIM_PREFIXES)}
        for pg in list(getattr(c10d._world, "pg_map", {})):
            desc = getattr(pg, "group_desc", None)
            dim = desc[5:] if isinstance(desc, str) and desc.startswith("mesh_") else None
            if dim and dim.lower().startswith(MP_DIM_PREFIXES):
                sizes.setdefault(dim, int(pg.size()))
        if not sizes:
            return None
        out = 1
        for n in sizes.values():
            out *= max(n, 1)
        return out
    except Exception:  # noqa: BLE001 - best effort
        return None


def peak_flops(device_type: str | None, dtype: str | None = "bf16") -> float | None:
    """Dense peak FLOP/s of ``device_type`` (as :func:`fleetscope.agent.env.device_type_of` names it)
    for ``dtype``; None for CPUs, unknown devices and dtypes the table does not cover (no guessing)."""
    if not device_type or dtype is None:
        return None
    if str(dtype).lower() not in _TABLE_DTYPES:
        return None
    return PEAK_FLOPS.get(device_type)


def palm_flops_per_token(*, params: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a dense transformer, PaLM (Chowdhery et al. 2022) appendix B:
    ``6 N + 12 L H Q T`` with N non-embedding parameters, L layers, H heads, Q head dimension and
    T the sequence length (the attention term grows with the context each token attends over).
    A step's FLOPs are this times the step's tokens."""
    return 6.0 * params + 12.0 * layers * heads * head_dim * seq_len


def mfu(flops: float | None, step_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation ``flops / step_s / peak``; None (absent, not zero) if any is unknown."""
    if not flops or not step_s or not peak or step_s <= 0:
        return None
    return flops / step_s / peak


class FlopMeter:
    """Counts FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` between ``start`` and ``stop``,
    split into ``forward``, ``backward`` and ``recompute`` (module docstring).

    Entered and left from hooks (forward pre-hook ... optimizer pre-hook), so it is driven by explicit
    ``start``/``stop`` rather than a ``with`` block. Used once per run: the dispatch-mode overhead
    slows the measured step, which is flagged (``FLAG_FLOPS_MEASURED``). ``recompute`` is None when
    the split is not available (a torch without ``torch._C._current_graph_task_id``, or the counter's
    internals changed): the total is still counted.
    """

    def __init__(self, memory_emit: Any = None) -> None:
        self._mode: Any = None
        #: receives the ``memory_modules`` event (memory_modules.py), measured alongside; None: not measured
        self.memory_emit = memory_emit
        self.memory: Any = None  # the ModuleMemoryMeter of this measurement
        self.flops: int | None = None
        self.forward: int | None = None
        self.backward: int | None = None
        self.recompute: int | None = None
        self.local: bool | None = None  # DTensor ops counted at their local shards (None: unknown yet)
        self.dtensor_ops = 0  # DTensor ops seen (each counted by the local ops it ran)
        self.deferred = False  # a compiled model: measured at stop() by measure_uncompiled
        self.forwards = 0  # forwards (micro-batches) of the deferred step
        self.modules = True  # counted with the module tracker (False under pipelining)
        self.refused: str | None = None  # why a deferred measurement did not happen
        self._probe: tuple[Any, Any, Any] | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self, modules: bool = True) -> None:
        """Count from now. ``modules=False``: no module tracker (its input hooks break the pipeline
        schedules' ``autograd.grad``): the total and the forward/backward split are still counted."""
        mode = _split_counter_class()(display=False)
        mode.no_modules = not modules
        self.modules = modules
        mode.__enter__()
        self._mode = mode
        if modules and self.memory_emit is not None:
            self._start_memory(mode)

    def _start_memory(self, mode: Any) -> None:
        """Per-module memory on the same step (memory_modules.py); its failure leaves the FLOPs alone."""
        try:
            from .memory_modules import ModuleMemoryMeter, meter_enabled

            if not meter_enabled():
                return
            mm = self.memory = ModuleMemoryMeter(self.memory_emit)
            mm.start()
            mode.on_fwd = mm.add_flops
        except Exception:  # noqa: BLE001 - best effort, never into the training step
            self.memory = None

    def defer(self, probe: tuple[Any, Any, Any]) -> None:
        """Measure a compiled model at ``stop``: ``probe`` = (module, args, kwargs) of the step's first
        forward, replayed by :func:`measure_uncompiled` and multiplied by the step's forwards."""
        self._probe = probe
        self.deferred = True
        self.forwards = 1
        self._mode = _DEFERRED

    def cancel(self) -> None:
        """Stop without measuring (the step was dropped)."""
        if self.memory is not None:
            self.memory.cancel()
            self.memory = None
        if self._mode is _DEFERRED:
            self._mode = self._probe = None
        elif self._mode is not None:
            self.stop()

    def info(self) -> dict[str, Any]:
        """What the "flops" event says about how the count was made."""
        if self.deferred:
            return {"method": "uncompiled_fake", "forwards": self.forwards, "scope": "local"}
        out: dict[str, Any] = {"method": "flop_counter", "scope": "local" if self.local else "global",
                               "dtensor_ops": self.dtensor_ops}
        if not self.modules:
            out["pipeline_stage"] = True  # this rank's stage: its own micro-batches' work
        return out

    def stop(self) -> int | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return self.flops
        if mode is _DEFERRED:
            probe, self._probe = self._probe, None
            got = measure_uncompiled(*probe) if probe is not None else "no inputs"
            if isinstance(got, str):
                self.refused = got
                return None
            n = max(self.forwards, 1)
            total, fwd, bwd, rec = got
            self.flops = total * n
            if fwd is not None and bwd is not None and rec is not None:
                self.forward, self.backward, self.recompute = fwd * n, bwd * n, rec * n
            return self.flops
        mode.__exit__(None, None, None)
        if self.memory is not None:
            mode.on_fwd = None
            self.memory.stop()
        self.flops = int(mode.get_total_flops())
        self.local = bool(getattr(mode, "local", False))
        self.dtensor_ops = int(getattr(mode, "dtensor_ops", 0))
        if getattr(mode, "split_ok", False):
            self.forward, self.backward, self.recompute = int(mode.fwd), int(mode.bwd), int(mode.rec)
        return self.flops


_split_cls: Any = None
_DEFERRED = object()


def _split_counter_class() -> Any:
    """``FlopCounterMode`` that also sums each counted op into forward / backward / recompute (built
    once, on first use: torch is imported here)."""
    global _split_cls
    if _split_cls is not None:
        return _split_cls
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    task_id: Any = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside autograd's backward
    grad_on = torch.is_grad_enabled
    inner_mode = _local_dispatch_mode()

    class SplitFlopCounterMode(FlopCounterMode):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fwd = self.bwd = self.rec = 0
            self.split_ok = task_id is not None
            self.local = False
            self.dtensor_ops = 0
            self.count_fake = False  # FakeTensor ops run nowhere: counted only when measuring on fakes
            self.on_fwd: Any = None  # forward FLOPs callback (per-module attribution: memory_modules.py)

        def __exit__(self, *args: Any) -> Any:
            if not getattr(self, "no_modules", False):
                return super().__exit__(*args)
            mode, self.mode = self.mode, None  # torch's __exit__ without the module tracker
            return mode.__exit__(*args) if mode is not None else None

        def __enter__(self) -> Any:
            # torch >= 2.4: FlopCounterMode drives an inner dispatch mode; ours lets DTensor ops
            # through to their local shards (_local_dispatch_mode). The same steps as torch's own
            # __enter__; if its internals differ, torch's (global counts) is used.
            mode = None
            if inner_mode is not None and hasattr(self, "mod_tracker") and hasattr(self, "mode"):
                try:
                    mode = inner_mode(self)
                except Exception:  # noqa: BLE001 - another signature: torch's own mode
                    mode = None
            if mode is None:
                if getattr(self, "no_modules", False):
                    raise RuntimeError("FLOPs without module hooks need torch >= 2.4")
                return super().__enter__()
            self.flop_counts.clear()
            if not getattr(self, "no_modules", False):
                # per-module attribution: hooks on every module's inputs. Off under pipelining, whose
                # schedules' autograd.grad(inputs=...) fails on them (pipeline_watch.py)
                self.mod_tracker.__enter__()
            self.mode = mode
            mode.__enter__()
            self.local = True
            return self

        if inner_mode is None and hasattr(FlopCounterMode, "__torch_dispatch__"):
            # torch < 2.4: FlopCounterMode is the dispatch mode itself
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if _has_dtensor(types):
                    self.dtensor_ops += 1
                    self.local = True
                    return NotImplemented
                if _has_fake(types) and not self.count_fake:
                    return func(*args, **(kwargs or {}))
                return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if not self.split_ok:
                return super()._count_flops(func_packet, out, args, kwargs)
            try:
                g = self.flop_counts["Global"]
                before = g.get(func_packet, 0)
            except Exception:  # noqa: BLE001 - torch's internals changed: count the total only
                self.split_ok = False
                return super()._count_flops(func_packet, out, args, kwargs)
            res = super()._count_flops(func_packet, out, args, kwargs)
            try:
                n = g.get(func_packet, 0) - before
                r = _attention_recompute(func_packet, n, args) if n else 0
                if r:  # a fused attention backward: its score recompute is hardware work, not the model's
                    self.rec += r
                    self.bwd += n - r
                elif n:
                    if task_id() == -1:
                        self.fwd += n
                        if self.on_fwd is not None:
                            self.on_fwd(n)
                    elif grad_on():  # a forward re-run inside backward: activation checkpointing
                        self.rec += n
                    else:
                        self.bwd += n
            except Exception:  # noqa: BLE001 - never raise into the training step
                self.split_ok = False
            return res

    _split_cls = SplitFlopCounterMode
    return _split_cls


#: fused attention backward kernels: torch's FLOP formula (``sdpa_backward_flop_count``) counts five
#: matmuls, the first recomputing the score matrix Q·Kᵀ the forward did not keep
_ATTENTION_BACKWARD = frozenset({
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward", "_efficient_attention_backward",
})  # fmt: skip


def _attention_recompute(func_packet: Any, n: int, args: Any) -> int:
    """The FLOPs of a fused attention backward's score recompute (0 for any other op): of its
    ``2·b·h·s_q·s_k·(3·d_q + 2·d_v)`` the ``2·b·h·s_q·s_k·d_q`` of Q·Kᵀ (query = args[1], value =
    args[3]; their last dim is the head dim in both layouts). Counting it as recompute keeps model
    FLOPs at the convention (attention backward = twice its forward, as the math path counts it) while
    hardware FLOPs keep it."""
    name = str(getattr(func_packet, "__name__", func_packet)).rsplit(".", 1)[-1]
    if name not in _ATTENTION_BACKWARD:
        return 0
    try:
        dq, dv = int(args[1].shape[-1]), int(args[3].shape[-1])
        return n * dq // (3 * dq + 2 * dv)
    except Exception:  # noqa: BLE001 - other arguments: equal head dims
        return n // 5


def _has_fake(types: Any) -> bool:
    """Whether a dispatch involves a FakeTensor (shape propagation, e.g. DTensor's sharding rules)."""
    mod = sys.modules.get("torch._subclasses.fake_tensor")
    cls = getattr(mod, "FakeTensor", None) if mod is not None else None
    return cls is not None and any(isinstance(t, type) and issubclass(t, cls) for t in types)


def _has_dtensor(types: Any) -> bool:
    """Whether a dispatch involves a DTensor (its module is imported only by jobs that use it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    if cls is None:
        return False
    return any(isinstance(t, type) and issubclass(t, cls) for t in types)


def _local_dispatch_mode() -> Any:
    """torch's inner FlopCounterMode dispatch mode, changed to count each rank's LOCAL work under
    tensor parallelism: an op on DTensors returns ``NotImplemented`` from the mode, so DTensor's own
    dispatch runs it — on the local shards, with any redistribution it needs — and those local ops
    come back through the mode and are counted with their local shapes. (The stock mode counts the
    DTensor op at its global shapes on every rank: ×TP.) None where torch has no such inner mode."""
    try:
        from torch.utils.flop_counter import _FlopCounterMode
    except ImportError:
        return None

    class LocalFlopCounterMode(_FlopCounterMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if _has_dtensor(types):
                try:
                    self.counter.dtensor_ops += 1  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001
                    pass
                return NotImplemented
            if _has_fake(types) and not getattr(self.counter, "count_fake", False):
                return func(*args, **(kwargs or {}))  # DTensor's sharding propagation: runs on no device
            if _on_meta(args):
                return func(*args, **(kwargs or {}))  # shape inference (a pipeline stage's first step): no work
            return super().__torch_dispatch__(func, types, args, kwargs)

    return LocalFlopCounterMode


def _on_meta(args: Any) -> bool:
    """Whether an op's first tensor argument is on the meta device (it computes nothing)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            a = a[0] if a else None
        is_meta = getattr(a, "is_meta", None)
        if is_meta is not None:
            return bool(is_meta)
    return False


class FlopRates:
    """What one measured step teaches about every later step: FLOPs per computed position (padded
    token) — model and hardware — and, for steps without token counts, per step."""

    __slots__ = ("model_per_pos", "hw_per_pos", "model_per_step", "hw_per_step")

    def __init__(self, model_per_pos: float | None, hw_per_pos: float | None, model_per_step: float,
                 hw_per_step: float) -> None:
        self.model_per_pos = model_per_pos
        self.hw_per_pos = hw_per_pos
        self.model_per_step = model_per_step
        self.hw_per_step = hw_per_step

    def step(self, tokens: int | None, padded: int | None) -> tuple[float, float]:
        """(model, hardware) FLOPs of a step with these counts: model over its real tokens, hardware
        over the positions computed (padded tokens; the real ones when padding is not counted)."""
        if self.model_per_pos is not None and self.hw_per_pos is not None and (tokens or padded):
            return self.model_per_pos * (tokens or padded), self.hw_per_pos * (padded or tokens)  # type: ignore[operator]
        return self.model_per_step, self.hw_per_step


def flop_rates(total: float, recompute: float | None, tokens: int | None, padded: int | None) -> FlopRates:
    """Rates from one measured step: ``total`` FLOPs counted (hardware), ``recompute`` of them re-run
    forwards (None: unknown, counted as model FLOPs), over ``padded`` (else ``tokens``) positions."""
    model = total - (recompute or 0.0)
    positions = padded or tokens
    if positions:
        return FlopRates(model / positions, total / positions, model, total)
    return FlopRates(None, None, model, total)


# --- a compiled model's FLOPs: its uncompiled module, once, on fake tensors ------------------------
def count_params(model: Any) -> int | None:
    """``sum(p.numel())`` of the model's parameters, whole-model sizes where it is sharded (a DTensor's
    global numel; FSDP's flat parameter: its unsharded size); None without parameters. Never raises."""
    try:
        m = _unwrap(model)
        if not hasattr(m, "parameters"):
            return None
        n = 0
        for p in m.parameters():
            full = getattr(p, "_unpadded_unsharded_size", None)  # FSDP1 FlatParameter
            if full is not None:
                k = 1
                for d in full:
                    k *= int(d)
                n += k
            else:
                n += int(p.numel())
        return n or None
    except Exception:  # noqa: BLE001 - counting is best effort
        return None


def _unwrap(model: Any) -> Any:
    """The eager module under ``torch.compile`` and DDP wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ == "DistributedDataParallel":
            inner = getattr(model, "module", None)
        if inner is None:
            return model
        model = inner
    return model


def _refuse_reason(module: Any) -> str | None:
    """Why the module cannot be replayed on fake tensors without side effects (None: it can)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dt = getattr(mod, "DTensor", None) if mod is not None else None
    for m in module.modules():
        name = type(m).__name__
        if "FSDP" in name or "FullyShard" in name:
            return "fsdp"  # its hooks all-gather: collectives must not run on fake tensors
    if dt is not None and any(isinstance(p, dt) for p in module.parameters()):
        return "dtensor"
    return None


def measure_uncompiled(model: Any, args: Any, kwargs: Any) -> tuple[int, int | None, int | None, int | None] | str:
    """FLOPs of one forward and backward of a compiled ``model``'s eager module on these inputs,
    counted by the FLOP meter (:func:`_split_counter_class`) under ``FakeTensorMode``: nothing runs on
    the device, no parameter's ``.grad``, buffer, optimizer or compiled graph is touched (the backward
    is ``torch.autograd.grad`` of the outputs' sum with respect to the parameters; ``torch.compile``
    stays out of it: ``set_stance("force_eager")`` / ``torch._dynamo.disable``). Returns (total,
    forward, backward, recompute), or why it could not be measured."""
    import torch

    module = _unwrap(model)
    if not isinstance(module, torch.nn.Module):
        return "not a module"
    why = _refuse_reason(module)
    if why is not None:
        return why
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten, tree_map

    def body() -> tuple[int, int | None, int | None, int | None] | str:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        fargs, fkwargs = tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        params = [p for p in module.parameters() if p.requires_grad]
        counter = _split_counter_class()(display=False)
        counter.count_fake = True
        with fake, counter:
            out = module.forward(*fargs, **(fkwargs or {}))
            flat = tree_flatten(out)[0]
            if len(flat) == 1 and not isinstance(flat[0], torch.Tensor) and hasattr(flat[0], "values"):
                flat = tree_flatten(list(flat[0].values()))[0]  # a dict-like output pytree does not know
            leaves = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
            if leaves and params:
                loss = leaves[0].sum()
                for t in leaves[1:]:
                    loss = loss + t.sum()
                torch.autograd.grad(loss, params, allow_unused=True)
        total = int(counter.get_total_flops())
        if getattr(counter, "split_ok", False):
            return total, int(counter.fwd), int(counter.bwd), int(counter.rec)
        return total, None, None, None

    try:
        stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
        if stance is not None:
            with stance("force_eager"):
                return body()
        return torch._dynamo.disable(body)()  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001 - e.g. data-dependent shapes (.item(), nonzero) on fake tensors
        return f"replay failed: {type(e).__name__}"


# --- torch.compile and the FLOP measurement -------------------------------------------------------
# FlopCounterMode is a TorchDispatchMode; Dynamo refuses to compile a frame entered while one is
# active ("non-infra torch dispatch mode present") and does not try that frame again, so measuring
# the first step's FLOPs would leave a compiled model running eager for the whole job. A job that
# compiles is therefore never measured: its FLOPs are given or estimated, or MFU stays unknown.
_compile_seen = False
_orig_compile: Any = None


def note_compile() -> None:
    global _compile_seen
    _compile_seen = True


def compile_seen() -> bool:
    """Whether this process called ``torch.compile`` (since ``watch_torch_compile``) or handed the
    agent a compiled module."""
    return _compile_seen


def is_compiled(model: Any) -> bool:
    """``torch.compile(module)`` (an OptimizedModule) or ``module.compile()``."""
    return hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None


def watch_torch_compile() -> None:
    """Wrap ``torch.compile`` so that a call marks the process as compiling (idempotent; the wrapper
    only sets a flag and calls through)."""
    global _orig_compile

    torch = sys.modules.get("torch")
    fn = getattr(torch, "compile", None) if torch is not None else None
    if fn is None or getattr(fn, "_fleetscope", False):
        return
    _orig_compile = fn

    def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 - torch's own name
        note_compile()
        return fn(*args, **kwargs)

    compile.__wrapped__ = fn  # type: ignore[attr-defined]
    compile.__doc__ = fn.__doc__
    compile._fleetscope = True  # type: ignore[attr-defined]
    setattr(torch, "compile", compile)  # noqa: B010 - torch is a Module | None to mypy here
