"""Kineto / Chrome trace reduction with exact Holistic Trace Analysis parity.

``reduce_traces(dir_or_files)`` streams each rank's trace (bounded memory) and returns per-rank
summaries: temporal breakdown, comm/compute overlap, idle-time breakdown, kernel types and top
kernels, the per-ProfilerStep decomposition of docs/metrics.md, and late-start stragglers across ranks.
Formulas: tests/data/kineto/TRACE_FORMULAS.md; design and measurements: docs/traces.md.

Importing this package is light (stdlib only); ijson and numpy load when a trace is reduced.
"""

from __future__ import annotations

from .errors import TraceError
from .reduce import TraceSet, find_trace_files, reduce_trace, reduce_traces

__all__ = ["TraceError", "reduce_traces", "reduce_trace", "find_trace_files", "TraceSet"]
