"""One rank's breakdown over HTTP (``GET /api/v1/runs/{id}/ranks/{rank}/steps``), through the real server
and real Postgres: a synthetic run whose rank 5 computes 1.3× longer than the others. The rank's
components come from the stored per-rank blocks (equal to what was sent, float32), the medians are
the step rollups ``/steps`` returns; paging, the cursor, min/max downsampling, the bounds on what one
request reads (only the page's blocks; fewer steps per page on a wide run; a sampled series), the
404s — a rank outside the run, an unknown run, a run of another team —, the notebook client's
``rank_steps`` and the run page's heatmap of every component (the same numbers)."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import numpy as np
import pandas as pd
import pytest
from analysis_util import load
from conftest import start_server
from dash_util import load as load_steps
from fleetscope.server.auth import create_token

from fleetscope.client import ApiError
from fleetscope.synthetic import RunSpec, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

SPEC = RunSpec(name="strag", family="vla-7b", world_size=16, steps=30, seed=4, straggler={5: 1.3})
NAMES = [f.name for f in RANK_STEP_FIELDS]


@pytest.fixture
def run(live_server: Any) -> tuple[Any, int]:
    return live_server, load(live_server, SPEC)


def _get(srv: Any, rid: int, rank: int, **params: Any) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/api/v1/runs/{rid}/ranks/{rank}/steps", params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_straggler_ranks_components_against_the_median_rank(run: tuple[Any, int]) -> None:
    srv, rid = run
    body = _get(srv, rid, 5)
    rows = body["steps"]
    assert [r["step"] for r in rows] == list(range(30)) and body["total"] == 30 and body["points"] == 30
    assert body["rank"] == 5 and body["world_size"] == 16 and body["node"] == "node0000" and body["local_rank"] == 5
    assert body["reduced"] is False and body["sampled_every_steps"] == 1 and body["fields"][:4] == ["step", "ts", "n_ranks",
                                                                                                   "present"]
    # what the job sent for rank 5 (float32 in the blocks)
    sent = {step: dict(zip(NAMES, rs[5], strict=True)) for step, rs in rank_step_rows(SPEC)}
    for r in rows:
        assert r["present"] is True and r["n_ranks"] == 16
        for k in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "forward_s", "comm_total_s"):
            assert r[k] == pytest.approx(sent[r["step"]][k], rel=1e-6), (r["step"], k)
        # compute 1.3× the median rank's (1 % jitter per rank), the slowest rank: it waits for nobody
        assert 1.22 < r["compute_s"] / r["median_compute_s"] < 1.38, r
        assert r["work_ratio"] > 1.2 and r["straggler_wait_s"] == pytest.approx(0.0, abs=1e-5)
        assert r["median_straggler_wait_s"] > 0.1 * r["median_compute_s"]
    ratios = sorted(r["compute_s"] / r["median_compute_s"] for r in rows)
    assert ratios[15] == pytest.approx(1.3, abs=0.02)
    # the medians are the step rollups /steps returns
    steps = {s["step"]: s for s in httpx.get(f"{srv.url}/api/v1/runs/{rid}/steps", timeout=30).json()["steps"]}
    for r in rows:
        s = steps[r["step"]]
        for k in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "straggler_wait_s"):
            assert r[f"median_{k}"] == pytest.approx(s[k], rel=1e-12), k
    roll = body["rollups"]
    assert roll["steps"] == 30 and roll["slowdown"] > 1.2 and roll["compute_excess_s"] > 0
    assert roll["late_collectives"] > 0 and roll["lateness_s"] is not None  # start times are stored
    # an ordinary rank: at the median, waiting for rank 5
    other = _get(srv, rid, 2)["steps"]
    assert all(0.95 < r["compute_s"] / r["median_compute_s"] < 1.05 for r in other)
    assert all(r["straggler_wait_s"] > 0 for r in other)


def test_paging_the_cursor_and_downsampling(run: tuple[Any, int]) -> None:
    srv, rid = run
    full = _get(srv, rid, 5)["steps"]
    page = _get(srv, rid, 5, limit=7, offset=7)
    assert [r["step"] for r in page["steps"]] == list(range(7, 14)) and page["limit"] == 7 and page["total"] == 30
    got: list[dict[str, Any]] = []
    after = None
    while True:
        p = _get(srv, rid, 5, limit=8, **({"after": after} if after is not None else {}))
        got += p["steps"]
        if len(p["steps"]) < p["limit"]:
            break
        after = p["steps"][-1]["step"]
    assert got == full
    small = _get(srv, rid, 5, max_points=14)
    rows = small["steps"]
    assert small["reduced"] is True and small["points"] == 30 and 2 < len(rows) <= 14
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 29
    by_step = {r["step"]: r for r in full}
    assert all(r == by_step[r["step"]] for r in rows)  # every row a real step, unchanged
    top = max(full, key=lambda r: r["compute_s"])["step"]
    low = min(full, key=lambda r: r["data_s"])["step"]
    assert {top, low} <= {r["step"] for r in rows}  # the extremes survive
    assert _get(srv, rid, 5, max_points=100)["steps"] == full
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}/ranks/5/steps", params={"max_points": 1}).status_code == 422


def test_what_one_request_reads_is_bounded(run: tuple[Any, int], monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetscope.server.reports import _cache, rank_view

    srv, rid = run
    asked: list[list[int]] = []
    real = rank_view.step_store.blocks_of_steps

    def spy(engine: Any, run_id: int, steps: list[int], chunk: int = 500) -> Any:
        asked.append(list(steps))
        return real(engine, run_id, steps, chunk)

    monkeypatch.setattr(rank_view.step_store, "blocks_of_steps", spy)
    _get(srv, rid, 5, limit=4, after=20)
    assert asked == [[21, 22, 23, 24]]  # the page's blocks only
    monkeypatch.setattr(rank_view, "PAGE_CELLS", 16 * 3)  # a "wide" run: 3 steps of 16 ranks per page
    assert [r["step"] for r in _get(srv, rid, 5, limit=10)["steps"]] == [0, 1, 2]
    monkeypatch.setattr(rank_view, "SERIES_CELLS", 16 * 10)  # the series reads every 3rd step of 30
    _cache.clear()
    s = _get(srv, rid, 5, max_points=500)
    assert s["sampled_every_steps"] == 3 and s["points"] == 10 and [r["step"] for r in s["steps"]] == list(range(0, 30, 3))
    assert sorted(asked[-1]) == list(range(0, 30, 3))


def test_missing_records_and_404s(run: tuple[Any, int]) -> None:
    srv, rid = run
    r = httpx.get(f"{srv.url}/api/v1/runs/{rid}/ranks/16/steps")
    assert r.status_code == 404 and "outside run" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid + 1000}/ranks/0/steps").status_code == 404
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}/ranks/-1/steps").status_code == 422
    # steps where the rank sent nothing (its blocks lack its row): present false, its fields null
    spec = RunSpec(name="gaps", family="vla-7b", world_size=4, steps=6, seed=1)
    gaps = load(srv, spec, transform=lambda step, rows: [r for r in rows if not (r[0] == 1 and step in (2, 3))])
    rows = _get(srv, gaps, 1)["steps"]
    assert [r["present"] for r in rows] == [True, True, False, False, True, True]
    assert rows[2]["compute_s"] is None and rows[2]["median_compute_s"] > 0 and rows[2]["n_ranks"] == 3
    # the ranks after it sit one row earlier in those blocks: found by their rank, not their position
    sent = {step: rs[3] for step, rs in rank_step_rows(spec)}
    three = _get(srv, gaps, 3)["steps"]
    assert [r["present"] for r in three] == [True] * 6
    assert [r["compute_s"] for r in three] == pytest.approx([sent[s][NAMES.index("compute_s")] for s in range(6)], rel=1e-6)
    # a run with nothing compacted yet: an empty page
    with srv.client() as c:
        empty = c.register_run({"name": "empty", "world_size": 32})
    body = _get(srv, empty, 31)
    assert body["steps"] == [] and body["total"] == 0 and body["rollups"] is None


def test_the_picker_reads_one_rank_of_any_block() -> None:
    from fleetscope.server.codec import STEP_BLOCK_FIELDS, decode_block, encode_block
    from fleetscope.server.rank_matrix import RankPicker

    rng = np.random.default_rng(0)
    ranks = np.array([r for r in range(300) if r % 7])  # gaps: every 7th rank sent nothing
    block = encode_block(STEP_BLOCK_FIELDS, {f: ranks if f == "rank" else rng.random(ranks.size) * 10
                                             for f, _ in STEP_BLOCK_FIELDS})
    cols = decode_block(STEP_BLOCK_FIELDS, block)
    fields = ("step_s", "compute_s", "mem_peak_bytes", "ts", "hw_flops")
    picker = RankPicker(fields)
    for r in (1, 6, 8, 150, 299):
        i = int(np.flatnonzero(ranks == r)[0])
        assert picker.pick(block, r) == {f: float(cols[f][i]) for f in fields}, r
    assert picker.pick(block, 7) is None and picker.pick(block, 0) is None and picker.pick(block, 10_000) is None
    with pytest.raises(ValueError):
        RankPicker(("nope",))


def test_a_run_of_another_team_is_404(db_url: str) -> None:
    srv = start_server(db_url, read_auth=True)
    try:
        eng = srv.state.engine
        a_ing = create_token(eng, "a-ingest", scope="ingest", team="team-a")
        b_ing = create_token(eng, "b-ingest", scope="ingest", team="team-b")
        a_read = create_token(eng, "a-read", scope="read", team="team-a")
        ids = {}
        for name, tok in (("a", a_ing), ("b", b_ing)):
            r = httpx.post(f"{srv.url}/api/v1/runs", json={"name": name, "world_size": 2},
                           headers={"Authorization": f"Bearer {tok}"}, timeout=30)
            ids[name] = r.json()["id"]
        h = {"Authorization": f"Bearer {a_read}"}
        assert httpx.get(f"{srv.url}/api/v1/runs/{ids['b']}/ranks/0/steps", headers=h).status_code == 404
        assert httpx.get(f"{srv.url}/api/v1/runs/{ids['a']}/ranks/0/steps", headers=h).status_code == 200
        admin = {"Authorization": f"Bearer {srv.token}"}
        assert httpx.get(f"{srv.url}/api/v1/runs/{ids['b']}/ranks/0/steps", headers=admin).status_code == 200
    finally:
        srv.stop()


def test_the_client_reads_ranks_into_one_dataframe(run: tuple[Any, int]) -> None:
    srv, rid = run
    with srv.client() as c:
        df = c.rank_steps(rid, [5, 2], page_size=7)  # five pages each
        assert isinstance(df, pd.DataFrame) and list(df.columns[:2]) == ["rank", "step"] and len(df) == 60
        five = df[df["rank"] == 5].set_index("step")
        assert list(five.index) == list(range(30))
        assert (five["compute_s"] / five["median_compute_s"]).median() == pytest.approx(1.3, abs=0.02)
        assert df[df["rank"] == 2]["straggler_wait_s"].gt(0).all()
        every = c.rank_steps(rid)  # 16 ranks: within the client's bound
        assert sorted(every["rank"].unique()) == list(range(16)) and len(every) == 16 * 30
        small = c.rank_steps(rid, 5, max_points=14)
        assert len(small) <= 14 and set(small["rank"]) == {5}
        with pytest.raises(ValueError, match="max_ranks"):
            c.rank_steps(rid, max_ranks=8)
        with pytest.raises(ApiError) as e:
            c.rank_steps(rid, [16])
        assert e.value.status == 404 and "outside run" in str(e.value)


def test_the_heatmap_of_every_component_matches_the_rank_rows(run: tuple[Any, int]) -> None:
    from fleetscope.server import rank_matrix, reports

    srv, rid = run
    eng = srv.state.engine
    rank_matrix.clear_cache()
    comp = reports.rank_heatmap(eng, rid, field="compute_s", how="mean")["values"]  # ranks × steps, raw (16 × 30)
    assert comp.shape == (16, 30)
    ratio = comp[5] / np.median(comp, axis=0)
    assert 1.22 < ratio.min() and ratio.max() < 1.38
    wait = reports.rank_heatmap(eng, rid, field="straggler_wait_s")["values"]
    assert np.allclose(wait[5], 0.0, atol=1e-5) and (np.delete(wait, 5, axis=0) > 0).all()
    rows = {r: _get(srv, rid, r)["steps"] for r in (2, 5)}
    for field in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "straggler_wait_s", "work_s"):
        hm = reports.rank_heatmap(eng, rid, field=field)
        assert hm["label"] and hm["values"].shape == (16, 30), field
        for r, rr in rows.items():
            assert np.allclose(hm["values"][r], [x[field] for x in rr], rtol=1e-5, atol=1e-6), (field, r)
    # ten more steps arrive: the components loaded so far are brought up to date with the rest
    load_steps(srv, dataclasses.replace(SPEC, steps=40), step_lo=30)
    m = rank_matrix.rank_matrices(eng, rid)
    assert m is not None and m.steps.size == 40 and m.extra["compute_s"].shape == (40, 16)
    comp = reports.rank_heatmap(eng, rid, field="compute_s")["values"]
    assert np.allclose(comp[5], [x["compute_s"] for x in _get(srv, rid, 5)["steps"]], rtol=1e-6)
    with pytest.raises(ValueError):
        reports.rank_heatmap(eng, rid, field="tokens")
