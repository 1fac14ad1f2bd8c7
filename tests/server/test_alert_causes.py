"""Alerts that say why, beyond run regressions, through the real server: a node the network analysis
calls slow raises exactly one ``slow_node`` alert (per run and node) naming it, its busbw / latency
ratios and its ranks, posted to a local Slack receiver; a healthy run raises none; a straggler alert
carries ``cause`` (the component of its excess work: compute for a compute straggler, data for a
data straggler, with before / after / share) and ``diff`` (its node, local rank versus its peers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from analysis_util import Receiver, field_index, load
from dash_util import texts

from fleetscope.simulate import run_simulation
from fleetscope.synthetic import RunSpec

SLOW = "node0002"  # ranks 16-23 of 32 (8 per node)


@pytest.fixture
def slack() -> Iterator[Receiver]:
    rec = Receiver()
    yield rec
    rec.close()


@pytest.fixture
def alert_server(db_url: str, slack: Receiver) -> Iterator[Any]:
    from conftest import start_server

    srv = start_server(db_url, slack_webhook_url=slack.url, alert_interval_s=3600.0,
                       alert_step_check_interval_s=0.0, public_url="https://fleet.example")
    yield srv
    srv.stop()


def _alerts(srv: Any, **params: Any) -> list[dict[str, Any]]:
    r = httpx.get(f"{srv.url}/api/v1/alerts", params=params, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["alerts"])


def _rid(srv: Any, name: str) -> int:
    return int(httpx.get(f"{srv.url}/api/v1/runs", params={"name": name}).json()["runs"][0]["id"])


def _detect(srv: Any, *rids: int) -> None:
    srv.state.alerts.poke(runs=list(rids))
    srv.state.alerts.run_once()


def _page_detail(srv: Any, alert_id: int) -> Any:
    """The Regressions page's detail panel for one alert (its Dash callback over HTTP)."""
    outs = [("regressions-chart", "figure"), ("regressions-detail", "children")]
    body = {"output": ".." + "...".join(f"{i}.{p}" for i, p in outs) + "..",
            "outputs": [{"id": i, "property": p} for i, p in outs],
            "inputs": [{"id": "regressions-alert", "property": "data", "value": alert_id}],
            "changedPropIds": ["regressions-alert.data"], "state": []}
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()["response"]["regressions-detail"]["children"]


def test_a_slow_node_raises_one_alert_naming_it_and_posts_it_to_slack(alert_server: Any, slack: Receiver) -> None:
    srv = alert_server
    for name, seed, slow in (("slow", 1, {SLOW: 2.0}), ("healthy", 5, None)):
        run_simulation(server=srv.url, token=srv.token, run=name, family="vla-7b", ranks=32, steps=20, seed=seed,
                       slow_nodes=slow)
    srv.compact()
    slow_id, healthy_id = _rid(srv, "slow"), _rid(srv, "healthy")
    _detect(srv, slow_id, healthy_id)

    (a,) = _alerts(srv, kind="slow_node")
    assert a["run_id"] == slow_id and a["state"] == "firing" and a["metric"] == "node_network_slowdown"
    assert a["first_bad"]["node"] == SLOW and a["details"]["node"] == SLOW
    assert a["details"]["ranks"] == list(range(16, 24)) and a["details"]["node_ranks"] == 8
    assert a["details"]["busbw_ratio"] == pytest.approx(0.5, abs=0.1)
    assert a["details"]["latency_ratio"] == pytest.approx(2.0, rel=0.2)
    assert a["before"] == 1.0 and a["after"] == pytest.approx(2.0, rel=0.2)
    assert a["url"] == f"https://fleet.example/runs/{slow_id}"
    assert _alerts(srv, run_id=healthy_id) == []  # a healthy run raises nothing
    assert _alerts(srv, kind="straggler") == []  # a slow link is not more work

    msgs = [m for m in slack.wait(1) if "Slow node" in m["text"]]
    assert len(msgs) == 1
    blocks = str(msgs[0]["blocks"])
    assert SLOW in blocks and "16, 17, 18, 19, 20, 21, 22, 23" in blocks and "busbw" in blocks

    # detection again: the same alert, updated, not raised twice; dedup is per (run, node)
    _detect(srv, slow_id, healthy_id)
    assert [x["id"] for x in _alerts(srv, kind="slow_node")] == [a["id"]]
    assert len([m for m in slack.bodies if "Slow node" in m["text"]]) == 1
    assert a["dedup_key"].startswith("slow_node:") and a["dedup_key"].endswith(f":{slow_id}")

    # the Regressions page draws it: the run's step time for context (no change point of its own)
    from fleetscope.server import reports

    ser = reports.alert_series(srv.state.engine, a)
    assert ser is not None and ser["source"] == "run steps" and len(ser["y"]) > 0 and ser["change_x"] is None


def test_a_compute_straggler_alert_says_compute_and_names_its_node(alert_server: Any, slack: Receiver) -> None:
    srv = alert_server
    rid = load(srv, RunSpec(name="strag", family="llm-70b", world_size=32, steps=12, straggler={9: 1.3}),
               collectives=False)
    _detect(srv, rid)
    (a,) = _alerts(srv, kind="straggler")
    assert a["first_bad"]["rank"] == 9
    c = a["cause"]
    assert c["component"] == "compute" and c["basis"] == "rank_vs_median" and c["rank"] == 9
    assert c["after"] / c["before"] == pytest.approx(1.3, abs=0.05)
    assert c["share_of_change"] > 0.8 and set(c["components"]) == {"data", "compute", "other"}
    d = a["diff"]
    assert d["kind"] == "rank_vs_peers" and d["rank"] == 9 and d["node"] == "node0001" and d["local_rank"] == 1
    assert d["node_ranks"] == 8 and d["node_straggler_ranks"] == 1 and d["node_flagged"] is False
    assert "compute explains" in a["explanation"] and "node0001" in a["explanation"]
    msg = next(m for m in slack.wait(1) if "Straggler" in m["text"])
    assert "compute explains" in str(msg["blocks"]) and "node0001" in str(msg["blocks"])
    page = " ".join(texts(_page_detail(srv, a["id"])))
    assert a["explanation"] in page and "rank 9" in page and "1 of 8" in page


def test_a_data_straggler_alert_says_data(alert_server: Any) -> None:
    srv = alert_server
    i_data, i_step, i_comp = field_index("data_s"), field_index("step_s"), field_index("compute_s")

    def slow_loader(step: int, rows: list[tuple]) -> list[tuple]:
        out = []
        for row in rows:
            r = list(row)
            if r[0] == 5:  # rank 5 waits on its data loader: +30 % of its compute, all in data
                extra = 0.3 * r[i_comp]
                r[i_data] += extra
                r[i_step] += extra
            out.append(tuple(r))
        return out

    assert field_index("rank") == 0
    rid = load(srv, RunSpec(name="loader", family="llm-70b", world_size=32, steps=12, seed=3), collectives=False,
               transform=slow_loader)
    _detect(srv, rid)
    (a,) = _alerts(srv, kind="straggler")
    c, d = a["cause"], a["diff"]
    assert a["first_bad"]["rank"] == 5 and c["component"] == "data" and c["share_of_change"] > 0.8
    assert c["after"] > c["before"] and c["components"]["compute"]["share_of_change"] < 0.2
    assert d["node"] == "node0000" and d["local_rank"] == 5 and "data explains" in a["explanation"]


def test_slow_node_slack_text_is_escaped() -> None:
    from fleetscope.server.notifier import slack_message

    alert = {"id": 1, "kind": "slow_node", "metric": "node_network_slowdown", "state": "firing", "run_id": 3,
             "before": 1.0, "after": 2.0, "change": 1.0, "significance": None, "url": "https://fleet.example/runs/3",
             "first_bad": {"run_id": 3, "node": "<!channel>"}, "cause": None, "diff": None,
             "details": {"node": "<!channel>", "ranks": [0, 1], "node_ranks": 2, "slow_ranks": 2,
                         "busbw_ratio": 0.5, "latency_ratio": 2.0, "unit": "x"}}
    msg = slack_message(alert, "fired")
    text = str(msg["blocks"]) + msg["text"]
    assert "<!channel>" not in text and "&lt;!channel&gt;" in text and "Slow node" in msg["text"]
