"""The vocabulary of a step: the training thread's states, the ``rank_step`` flags, the host-clock
accumulator encoding, and ``StepData``, one step on one rank from its first mark until it is submitted.

Standard library only; imported by every part of the step machine (machine.py, step.py,
collective_stats.py, pending.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, SupportsInt

from .protocols import Mark, MemSample

__all__ = [
    "OTHER", "DATA", "FORWARD", "BACKWARD", "OPTIMIZER", "COMM", "STATE_NAMES", "FIRST_CUSTOM",
    "FLAG_NEGATIVE_RESIDUAL", "FLAG_FLOPS_MEASURED", "BIG", "MASK", "NONE4", "StepData", "Tokens", "Count",
]  # fmt: skip

# states of the training thread; custom phases get the states from FIRST_CUSTOM on
OTHER, DATA, FORWARD, BACKWARD, OPTIMIZER, COMM = range(6)
STATE_NAMES: tuple[str, ...] = ("other", "data", "forward", "backward", "optimizer", "comm")
FIRST_CUSTOM = 6

#: rank_step ``flags`` bits
FLAG_NEGATIVE_RESIDUAL = 1
"""bit 0: a measurement error: the measured components exceeded step_s (other_s reported as 0, and
the excess not charged), docs/metrics.md "never clamped silently"."""
FLAG_FLOPS_MEASURED = 2
"""bit 1: FLOPs were counted (FlopCounterMode) during this step, which slowed it."""

# Host clock (CPU) accounting is incremental: at each transition the interval since the previous one
# is added to the state that was current, plus BIG. A state's accumulator is therefore 0 if the state
# never occurred in the step ("not measured", None on the wire) and k·BIG + ns after k intervals, so
# one integer add per transition records both the time and the fact (``MASK`` takes the ns back).
# The trick costs nothing on the hot path: ``StepMachine._last`` holds the previous mark minus BIG.
# The CUDA resolution (pending.py) fills its accumulators the same way.
BIG = 1 << 50  # 13 days of ns: more than any step
MASK = BIG - 1

NONE4: MemSample = (None, None, None, None)

Count = SupportsInt | None
"""A step's samples or padded tokens: an int (anything ``int()`` takes), None = not given."""
Tokens = SupportsInt | Mapping[str, SupportsInt] | None
"""A step's tokens: an int, or a mapping modality -> int (summed, and sent per modality)."""
_time = time.time


class StepData:
    """One step on one rank, from its first mark until it is resolved and submitted. On the host
    clock the per-state times live on the machine (``StepMachine._durs``), on CUDA in ``marks``. Slots:
    every field is read at the step's end, and a slot read is the cheapest attribute read there is."""

    __slots__ = (
        "index", "ts", "auto", "calls", "pre_calls", "ddp", "tokens", "padded", "samples", "modality",
        "mem", "flags", "flops", "ready_upto", "check", "marks",
    )  # fmt: skip

    def __init__(self, index: int, auto: bool) -> None:
        self.index = index
        self.ts = _time()
        self.auto = auto
        self.calls: list[Sequence[Any]] = []  # collective call records (layout: collective_stats.C_*)
        # calls issued between the previous step and this one: recorded with it, not timed in it
        self.pre_calls: Sequence[Sequence[Any]] = ()
        self.ddp = False  # DDP buckets among the calls (their exposure is the backward tail)
        self.tokens: int | None = None
        self.padded: int | None = None
        self.samples: int | None = None
        self.modality: dict[str, int] | None = None
        self.mem: MemSample = NONE4
        self.flags = 0
        self.flops: int | None = None
        self.ready_upto = 0
        self.check: list[Mark] | None = None
        # CUDA clock: [(event, state), ...], a list from the step's first mark; host clock: ()
        self.marks: Sequence[tuple[Mark, int]] = ()
