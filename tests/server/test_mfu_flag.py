"""An MFU or HFU above 1 — more FLOPs than peak × step time, which no device can run — is flagged and
never returned as a number (summary, fleet list, run-page series); the summary's
``flops_per_rank_step`` is the median over steps of one rank's FLOPs, with its source."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
PEAK = 1e12


def _row(rank: int, step: int, step_s: float, flops: float, hw: float | None) -> tuple:
    v: dict[str, Any] = {"rank": rank, "step": step, "step_s": step_s, "ts": 1.7e9 + step, "compute_s": step_s,
                         "other_s": 0.0, "tokens": 100, "flops": flops, "hw_flops": hw}
    return tuple(v.get(n) for n in NAMES)


def test_mfu_above_one_is_flagged_not_returned(live_server: Any) -> None:
    # 2 ranks, 1 s steps, 1.08e12 FLOPs per rank against a 1e12 peak: MFU 1.08 (e.g. counted ×TP)
    rows = [_row(r, s, 1.0, 1.08e12, 1.2e12) for s in range(4) for r in range(2)]
    with live_server.client() as c:
        rid = c.register_run({"name": "mfu-over", "model_family": "f", "world_size": 2, "peak_flops": PEAK,
                              "meta": {"flops_source": "measured"}})
        c.ingest_rows(rid, rows)
        live_server.compact()
        s = c.summary(rid)
    assert s["mfu"] is None and s["hfu"] is None
    assert s["mfu_flag"].startswith("implausible: MFU 1.08 > 1")
    assert s["hfu_flag"].startswith("implausible: HFU 1.20 > 1")
    assert s["flops_per_rank_step"] == {"model": pytest.approx(1.08e12), "hardware": pytest.approx(1.2e12),
                                        "source": "measured"}
    listed = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "mfu-over"}, timeout=10).json()["runs"][0]
    assert listed.get("mfu") is None  # the fleet list shows no number either


def test_plausible_mfu_stays_and_the_formula_source_is_named(live_server: Any) -> None:
    rows = [_row(r, s, 2.0, 4e11 * (1 + r), None) for s in range(3) for r in range(2)]
    with live_server.client() as c:
        rid = c.register_run({"name": "mfu-ok", "model_family": "f", "world_size": 2, "peak_flops": PEAK,
                              "meta": {"flops_source": "estimated"}})
        c.ingest_rows(rid, rows)
        live_server.compact()
        s = c.summary(rid)
    assert s["mfu"] == pytest.approx(1.2e12 / (2 * 2.0) / PEAK) and s["mfu_flag"] is None
    assert s["hfu"] is None and s["hfu_flag"] is None  # not measured: no flag
    assert s["flops_per_rank_step"] == {"model": pytest.approx(6e11), "hardware": None, "source": "formula"}


def test_the_flag_is_a_pure_function_of_the_ratio() -> None:
    from fleetscope.server.analysis.figures import plausible_utilisation

    assert plausible_utilisation("MFU", 0.4) == (0.4, None)
    assert plausible_utilisation("MFU", 1.0) == (1.0, None)
    assert plausible_utilisation("MFU", None) == (None, None)
    v, why = plausible_utilisation("HFU", 2.5)
    assert v is None and why is not None and "HFU 2.50 > 1" in why
