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

    def __init__(self) -> None:
        self._mode: Any = None
        self.flops: int | None = None
        self.forward: int | None = None
        self.backward: int | None = None
        self.recompute: int | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        self._mode = _split_counter_class()(display=False)
        self._mode.__enter__()

    def stop(self) -> int | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return self.flops
        mode.__exit__(None, None, None)
        self.flops = int(mode.get_total_flops())
        if getattr(mode, "split_ok", False):
            self.forward, self.backward, self.recompute = int(mode.fwd), int(mode.bwd), int(mode.rec)
        return self.flops


_split_cls: Any = None


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

    class SplitFlopCounterMode(FlopCounterMode):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fwd = self.bwd = self.rec = 0
            self.split_ok = task_id is not None

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
                if n:
                    if task_id() == -1:
                        self.fwd += n
                    elif grad_on():  # a forward re-run inside backward: activation checkpointing
                        self.rec += n
                    else:
                        self.bwd += n
            except Exception:  # noqa: BLE001 - never raise into the training step
                self.split_ok = False
            return res

    _split_cls = SplitFlopCounterMode
    return _split_cls


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
    import sys

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
