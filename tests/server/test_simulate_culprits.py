"""``fleetscope simulate --slow-link RANK=FACTOR`` and ``--slow-loader RANK=FACTOR`` (the culprits of
bench/straggler_cause.py): the synthetic rows slow only that rank's collectives / data loading; through the real
server the slow link is a network-slow rank (not a straggler) and the slow loader a straggler late in data, with
its bystander GPU throttle kept out of its cause; bad values are refused naming the option."""

from __future__ import annotations

import time
from typing import Any

import httpx
from typer.testing import CliRunner

from fleetscope.cli import app
from fleetscope.synthetic import RunSpec, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]


def _col(rows: list[tuple], rank: int, name: str) -> float:
    return float(next(r for r in rows if r[0] == rank)[NAMES.index(name)])


def test_slow_link_and_slow_loader_slow_only_their_rank_and_part() -> None:
    base = RunSpec(name="c", family="llm-70b", world_size=16, steps=3, seed=4)
    link = RunSpec(name="c", family="llm-70b", world_size=16, steps=3, seed=4, slow_links={3: 2.0})
    loader = RunSpec(name="c", family="llm-70b", world_size=16, steps=3, seed=4, slow_loaders={9: 20.0})
    for (_, a), (_, b), (_, d) in zip(rank_step_rows(base), rank_step_rows(link), rank_step_rows(loader), strict=True):
        assert _col(b, 3, "comm_total_s") == 2.0 * _col(a, 3, "comm_total_s")
        assert _col(b, 3, "comm_exposed_s") == 2.0 * _col(a, 3, "comm_exposed_s")
        assert _col(b, 3, "compute_s") == _col(a, 3, "compute_s") and _col(b, 3, "data_s") == _col(a, 3, "data_s")
        assert _col(b, 0, "comm_total_s") == _col(a, 0, "comm_total_s")  # only rank 3's link
        assert _col(d, 9, "data_s") == 20.0 * _col(a, 9, "data_s")
        assert _col(d, 9, "compute_s") == _col(a, 9, "compute_s")
        assert _col(d, 0, "data_s") == _col(a, 0, "data_s") and _col(d, 0, "compute_s") == _col(a, 0, "compute_s")


def test_bad_culprit_options_are_refused_naming_the_option() -> None:
    base = ["simulate", "--server", "http://127.0.0.1:9", "--run", "x", "--family", "llm-70b", "--ranks", "16",
            "--steps", "1"]
    for opt, val, msg in (("--slow-link", "3", "RANK=FACTOR"), ("--slow-link", "3=0", "FACTOR > 0"),
                          ("--slow-loader", "x=2", "RANK=FACTOR"), ("--slow-loader", "16=2", "not < --ranks 16")):
        out = CliRunner().invoke(app, [*base, opt, val])
        text = " ".join(out.output.replace("│", " ").split())  # the error panel wraps its lines
        assert out.exit_code == 2 and opt in text and msg in text, out.output


def test_a_slow_link_is_network_slow_and_a_slow_loader_a_data_straggler(live_server: Any) -> None:
    srv = ["--server", live_server.url, "--token", live_server.token]
    out = CliRunner().invoke(app, ["simulate", *srv, "--run", "culprits", "--family", "llm-70b", "--ranks", "32",
                                   "--steps", "30", "--step-ms", "1000", "--slow-link", "3=2.5",
                                   "--slow-loader", "9=20", "--throttle", "20:thermal"])
    assert out.exit_code == 0, out.output
    h = {"Authorization": f"Bearer {live_server.token}"}
    rid = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "culprits"}, headers=h).json()["runs"][0]["id"]
    with live_server.client() as c:  # rank 9's GPU also sat at its power cap, after the steps: a bystander
        from fleetscope.simulate import _Events, device_events

        ev = _Events()
        ev.seq[9] = 5_000_000
        evs = [e for e in device_events(32, {9: "power"}, 1.7e9 + 40, 1.7e9 + 70, ev, max_windows=1) if e["rank"] == 9]
        assert c.ingest({"v": 1, "run_id": rid, "events": evs}, fmt="json")["accepted"]["events"] == 1
    live_server.compact()
    deadline = time.monotonic() + 60
    while True:  # the device windows written (ingest lands them in the background), then the steps compacted
        devs = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/devices", headers=h).json()
        if devs["throttled_ranks"] == [9, 20] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    while True:
        s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary", headers=h, timeout=60).json()
        if s["steps"] >= 30 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by = {st["rank"]: st for st in s["stragglers"]}
    assert sorted(by) == [9, 20], s["stragglers"]
    assert by[9]["component"] == "data" and by[9]["cause"]["reason"] is None
    assert by[9]["cause"]["device"]["throttle_reason"] == "power" and "its excess is in data" in by[9]["cause"]["text"]
    assert by[20]["cause"]["reason"] == "thermal" and by[20]["component"] == "compute"
    assert [r["rank"] for r in s["network"]["slow_ranks"]] == [3] and s["network"]["slow_nodes"] == []
    assert devs["throttled_ranks"] == [9, 20]
