"""Model FLOPs per step and peak FLOP/s per device (docs/metrics.md, "Throughput and MFU").

Sources of a step's FLOPs, in priority order, recorded with the number (``flops_source``):
``"given"`` (``flops_per_step``/``flops_per_token``), ``"measured"`` (``FlopCounterMode`` over the
forward and backward of the first step), ``"estimated"`` (the PaLM dense-transformer formula).
torch is imported only by :class:`FlopMeter`, i.e. only when a measurement starts.
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
    """Counts FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` between ``start`` and ``stop``.

    Entered and left from hooks (forward pre-hook ... optimizer pre-hook), so it is driven by explicit
    ``start``/``stop`` rather than a ``with`` block. Used once per run: the dispatch-mode overhead
    slows the measured step, which is flagged (``FLAG_FLOPS_MEASURED``).
    """

    def __init__(self) -> None:
        self._mode: Any = None
        self.flops: int | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def stop(self) -> int | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return self.flops
        mode.__exit__(None, None, None)
        self.flops = int(mode.get_total_flops())
        return self.flops


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
    torch.compile = compile
