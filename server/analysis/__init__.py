"""Analysis: bottlenecks, stragglers, scaling, regressions (metrics.md)."""
