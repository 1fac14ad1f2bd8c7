"""Kernel classification by name, as Holistic Trace Analysis does it (TRACE_FORMULAS.md §2.2).

``kernel_type(name)`` follows HTA 0.6.1 (current) exactly. Its communication rule has one known
flaw: the alternative ``^hip`` labels every ``hip*`` name as communication (meant for RCCL, it also
swallows ``hipMemcpy*``/``hipMemset*``, which never reach the MEMORY rule). ``kernel_type_corrected``
drops that alternative (RCCL kernels keep NCCL's names, ``ncclKernel_*``/``ncclDevKernel_*``), so
hip memory copies are MEMORY and other hip kernels COMPUTATION.
"""

from __future__ import annotations

import re

__all__ = [
    "COMPUTATION",
    "COMMUNICATION",
    "MEMORY",
    "OTHER",
    "TYPE_NAMES",
    "kernel_type",
    "kernel_type_corrected",
    "is_straggler_comm_kernel",
    "STEP_NAME_RE",
    "ITER_NAME_RE",
]

# bit values as in HTA's kernel-type sweep (COMPUTATION=1, COMMUNICATION=2, MEMORY=4)
COMPUTATION = 1
COMMUNICATION = 2
MEMORY = 4
OTHER = 8
TYPE_NAMES = {COMPUTATION: "COMPUTATION", COMMUNICATION: "COMMUNICATION", MEMORY: "MEMORY", OTHER: "OTHER"}

_COMM = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
_COMM_CORRECTED = re.compile(r"(^nccl)|(^hccl)|(^rccl)|(.*ncclKernel)|(.*ncclDevKernel)")
_MEMORY = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
_NOT_COMPUTE = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)|(^runFunction)"
    r"|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)|(^collective_subgraph_execution)"
)
_NOT_COMPUTE_CORRECTED = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)|(^runFunction)"
    r"|(^hipLaunchKernel)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)|(^rccl)"
    r"|(^collective_subgraph_execution)"
)

# ProfilerStep names: the last-step filter uses the first pattern (symbol-table match), iteration
# numbers the second (both from HTA).
STEP_NAME_RE = re.compile(r"ProfilerStep#(\d+)")
ITER_NAME_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")


def kernel_type(name: str) -> int:
    """HTA's classification (communication first, then memory, then computation, else other)."""
    if _COMM.match(name):
        return COMMUNICATION
    if _MEMORY.match(name):
        return MEMORY
    if not _NOT_COMPUTE.match(name):
        return COMPUTATION
    return OTHER


def kernel_type_corrected(name: str) -> int:
    """Like ``kernel_type`` without the ``^hip`` ⇒ communication flaw."""
    if _COMM_CORRECTED.match(name):
        return COMMUNICATION
    if _MEMORY.match(name):
        return MEMORY
    if not _NOT_COMPUTE_CORRECTED.match(name):
        return COMPUTATION
    return OTHER


def is_straggler_comm_kernel(name: str, corrected: bool) -> bool:
    """HTA's straggler analysis takes names starting with ``ncclKernel`` only, which finds no kernel on
    NCCL >= 2.19 (``ncclDevKernel_*``; HTA issue #360). The corrected rule takes both."""
    if corrected:
        return name.startswith(("ncclKernel", "ncclDevKernel"))
    return name.startswith("ncclKernel")
