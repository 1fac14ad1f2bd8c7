"""Analysis (docs/metrics.md, docs/analysis.md): pure functions over data the store loaded.

Nothing here touches the database: every function takes rows (``store.rows``), numpy frames or plain
values and returns plain values, so it is tested without Postgres. The façade
``fleetscope.server.reports`` loads what each needs and composes them.

- ``figures``: per-run figures (MFU, throughput, step time per 1k tokens, shares, …), each defined once
- ``bottlenecks``: shares of step time, Amdahl ceilings and findings
- ``stragglers``: the straggler report from per-rank rollups or step blocks
- ``collectives``: busbw and efficiency against the declared link peaks
- ``goodput``: productive share of wall time and the badput by cause
- ``scaling``: scaling curves and cross-run comparison
- ``regressions``: regressions of run, benchmark and within-run series (``fleetscope.changepoint``)
- ``rollups``: the per-rank straggler rollup fold the compactor runs
"""
