"""The store: every SQL statement of the server, read side and write side, one module per subject.

Readers return typed rows (``runs.RunRow``, ``steps.StepFrame`` of numpy columns,
``aggregates.RunAggregate``) and never compute a figure: what a number means is defined once, in
``fleetscope.server.analysis`` (pure functions), and composed for the API and the dashboard by the
façade ``fleetscope.server.reports``. Writers take plain values (ingest landing, compaction, rollups,
alerts, benchmarks, traces) and keep their transactions here.

| module | tables |
|---|---|
| ``runs`` | ``runs`` (+ not-yet-compacted counts from ``ingest_fragments``) |
| ``steps`` | ``steps`` rollup columns and per-rank blocks |
| ``aggregates`` | per-run aggregates over ``steps``, the ``run_stats`` cache |
| ``ranks`` | ``ranks``, ``rank_rollups``, ``rank_windows`` |
| ``collectives`` | ``run_collectives``, ``run_modalities`` |
| ``events`` | ``run_events``, ``run_groups``, ``run_event_counts`` (written at ingest: ``land_events``) |
| ``scalars`` | ``run_scalars``, ``run_scalar_names`` (training scalars: ``scalars`` events, via ``events.land_events``) |
| ``run_query`` | run filters, sorting, grouping and paging over ``runs`` (JSONB config/meta), ``run_stats``, ``run_scalars`` |
| ``step_rows`` | a run's per-step rows from ``steps``, paged (``/steps``) |
| ``alerts`` / ``benchmarks`` / ``traces`` | their tables |
| ``kernels`` | ``run_kernels``, ``run_kernel_ranks``, ``run_kernel_windows`` (folded from ``run_events``) |
| ``landing`` | ingest: ``ingest_fragments``, ``modality_raw``, ``ranks``, events via ``events.land_events`` |
| ``compaction`` | the compactor's transaction (fragments → ``steps``, ``run_collectives``, counters) |
| ``bounds`` | ``run_names`` (names a run keeps under a bound), ``run_folded`` (records folded to keep it) |
| ``bootstrap`` | creating the database of embedded Postgres |
| ``citus`` | Citus: detection and per-connection settings, ``fleetscope db distribute``'s plan from the catalog |

Import the submodule you need (``from fleetscope.server.store import runs``); this package itself
imports nothing, so any part of the server can depend on one subject without pulling in the rest.
"""
