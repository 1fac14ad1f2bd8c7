"""Server-side bounds on everything a run may store, in one place.

The agent keeps most of these itself; the server enforces them too, because a client that is not our
agent (or a job at a scale nobody tried) must not be able to make a read unbounded. Each bound is
either refused at ingest with a 4xx that names it, or folded and counted (the record is kept in a
bounded form and the run says how much was folded). docs/security.md has the table; a test checks
that every name here appears there.
"""

from __future__ import annotations

#: run_events rows one run may hold (all kinds together); beyond it events are dropped and counted
MAX_EVENTS_PER_RUN = 50_000
#: run_events rows of one kind one run may hold; beyond it that kind's events are dropped and counted
MAX_EVENTS_PER_KIND = 20_000
#: JSON values in one event's ``data`` (every scalar, list and object counts as one)
MAX_EVENT_VALUES = 1_000
#: JSON values in one ``trace_summary`` event (the agent's sampled-trace reduction: per-step rows and
#: top kernels grow with the profiled window; the kernel fold reads only its kernel rows)
MAX_TRACE_SUMMARY_VALUES = 10_000
#: JSON values in one ``memory_modules`` event (the agent's per-module memory: ≤ 256 modules × 11 columns)
MAX_MEMORY_MODULES_VALUES = 4_000
#: distinct process groups (``comm_group``) one run may describe; a group is stored once, not per rank
MAX_GROUPS_PER_RUN = 65_536
#: ranks listed explicitly in one group description (a longer group is sent as start/stride/size)
MAX_GROUP_RANKS_LISTED = 16_384
#: custom phase names per run (the agent's own limit); further names fold into ``other_phases`` (the agent's overflow name)
MAX_PHASE_NAMES_PER_RUN = 32
#: distinct node / host names one run may report; further ranks' names are dropped and counted
MAX_NODES_PER_RUN = 32_768
#: characters kept of a reason (recompile, graph break, exception message); longer ones are cut, marked "…"
MAX_REASON_CHARS = 512
#: collective records of one rank in one step
MAX_COLLECTIVES_PER_RANK_STEP = 8_192
#: kernel names kept per uploaded trace summary (the rest is summed into one "other" row)
MAX_KERNELS_PER_TRACE = 1_000
#: bins of one histogram (sequence lengths: log2 bins)
MAX_HIST_BINS = 64
#: largest count in one histogram bin (finite, non-negative)
MAX_HIST_COUNT = 1e15
#: pipeline stages of one run
MAX_PIPELINE_STAGES = 4_096
#: micro-batches per pipeline schedule step
MAX_MICROBATCHES = 65_536
#: rows any list endpoint returns at most in one page
MAX_PAGE_ROWS = 1_000
#: stack frames kept of one rank's position or failure (innermost last); more are refused (422)
MAX_STACK_FRAMES = 12
#: failure records one run keeps (one per rank and source); further failures are dropped and counted
MAX_FAILURES_PER_RUN = 1_024
#: characters kept of a failure's message; longer ones are cut, marked "…"
MAX_FAILURE_MESSAGE_CHARS = 1_000
#: distinct declared-pause reasons one run keeps (per rank: the open pause and the seconds of ended ones);
#: pauses of further reasons are dropped and counted
MAX_PAUSE_REASONS_PER_RUN = 16
#: ranks a run's health lists by number (missing ranks, failed ranks); the rest are counted
MAX_HEALTH_RANKS_LISTED = 1_024
#: ranks whose stacks a run's health shows
MAX_HEALTH_STACKS = 16
#: distinct training-scalar names (``run.log``) one run keeps; points of further names are dropped and counted
MAX_SCALAR_NAMES_PER_RUN = 256
#: characters of one training-scalar name; longer names are refused (422)
MAX_SCALAR_NAME_CHARS = 128
#: training-scalar points (name, step, rank) one run keeps; further points are dropped and counted
MAX_SCALAR_POINTS_PER_RUN = 1_000_000
#: points per scalar name one ``/scalars`` read or the run page returns at most (downsampled, minima and maxima kept)
MAX_SCALAR_READ_POINTS = 20_000
#: device-telemetry windows (rank, window) one run keeps (``run_devices``); further windows are dropped and counted
MAX_DEVICE_WINDOWS_PER_RUN = 2_000_000
