"""Projections over the API: a run at 4 GPUs projected to 8, then a run of the same signature measured at 8;
the track record shows the projection's error (server/reports/projection.py, docs/api.md "Projections")."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from analysis_util import load
from typer.testing import CliRunner

from fleetscope.cli import app
from fleetscope.client import ApiError
from fleetscope.synthetic import RunSpec

FAMILY = "llm-70b"
# comm-bound: exposed communication is a large part of the step, so the projection has to move it
SHIFT = {"comm_exposed_s": 60.0}


def test_a_projection_is_checked_against_the_run_that_followed(live_server: Any) -> None:
    small = load(live_server, RunSpec("proj-4", FAMILY, world_size=4, steps=24, seed=1, comm_bound=True, shift=SHIFT))
    with live_server.client() as c:
        base = c.summary(small)
        out = c.projection(small, world_size=8)
        assert out["status"] == "ok", out
        assert out["estimated"] is True
        # the baseline's exposed comm grows with the ring's 2(n−1)/n: 4 → 8 ranks, compute per rank unchanged
        parts = out["parts"]
        assert parts["comm_exposed"] > out["basis"]["measured_parts"]["comm_exposed"]
        assert parts["compute"] == pytest.approx(out["basis"]["measured_parts"]["compute"])
        assert out["step_s"] > base["step_s_p50"]
        assert out["tokens_per_s"] > base["tokens_per_s"]  # twice the replicas, each a little slower
        lo, hi = out["error_band"]["step_s"]
        assert lo < out["step_s"] < hi
        # no run measured 8 ranks yet: the busbw at 8 is extrapolated from this run's own collectives
        assert out["basis"]["sizes"] == "extrapolated_world"
        assert f"run:{small}" in out["basis"]["sources"]
        assert out["target"] == {"world_size": 8, "dp": 8, "tp": 1, "pp": 1, "micro_batches": None, "bucket_bytes": None}

        rec = c.projection_track_record(FAMILY)
        assert rec["checked"] == [] and [p["from_run"] for p in rec["pending"]] == [small]
    # the CLI prints the same projection
    res = CliRunner().invoke(app, ["project", str(small), "-n", "8", "--server", live_server.url,
                                   "--token", live_server.token])
    assert res.exit_code == 0, res.output
    assert "at 8 GPUs (dp 8 × tp 1 × pp 1), estimated" in res.output
    assert f"step       {out['step_s']:.4g} s" in res.output

    large = load(live_server, RunSpec("proj-8", FAMILY, world_size=8, steps=24, seed=2, comm_bound=True, shift=SHIFT,
                                      start_ts=time.time() + 5))
    with live_server.client() as c:
        measured = c.summary(large)["step_s_p50"]
        rec = c.projection_track_record(FAMILY)
    assert rec["pending"] == []
    [chk] = rec["checked"]
    assert (chk["from_run"], chk["measured_run"], chk["world_size"], chk["from_world_size"]) == (small, large, 8, 4)
    assert chk["projected_step_s"] == pytest.approx(out["step_s"])
    assert chk["measured_step_s"] == pytest.approx(measured)
    assert chk["error"] == pytest.approx(out["step_s"] / measured - 1)
    assert abs(chk["error"]) <= 0.15  # targets.md: projection error
    assert chk["blind"] is True  # the run started after the projection was made
    assert rec["summary"]["n"] == 1 and rec["summary"]["by_ratio"]["2"]["worst_abs_error"] == pytest.approx(abs(chk["error"]))
    # the back-test projects the smallest run to 8 without the 8-rank run's collectives
    [bt] = rec["backtest"]
    assert (bt["from_run"], bt["world_size"], bt["measured_runs"]) == (small, 8, [large])


def test_bad_layouts_are_422_and_thin_runs_say_what_is_missing(live_server: Any) -> None:
    rid = load(live_server, RunSpec("proj-thin", "vit-h", world_size=4, steps=2, seed=3))
    with live_server.client() as c:
        thin = c.projection(rid, world_size=8)
        assert thin["status"] == "insufficient_data" and thin["step_s"] is None
        assert any("steady steps" in m for m in thin["missing"])
        for params, word in (({"world_size": 6, "tp": 4}, "not a multiple of tp·pp"), ({"world_size": 0}, "world_size"),
                             ({"world_size": 8, "batch": "sometimes"}, "batch")):
            with pytest.raises(ApiError) as e:
                c.projection(rid, **params)
            assert e.value.status == 422 and word in str(e.value), (params, str(e.value))
        with pytest.raises(ApiError) as e:
            c.projection(rid + 1000, world_size=8)
        assert e.value.status == 404
    r = httpx.get(f"{live_server.url}/api/v1/projections/track_record", timeout=30)
    assert r.status_code == 422  # family is required
