"""Alerts that explain, end to end: a family of good runs and then bad runs with a shifted component
and a config change, sent by `fleetscope simulate` (the real agent transport; the first bad run
through the CLI itself) → one alert whose cause and diff are the known answers → the Slack payload
received by a local receiver says it in one sentence → the Regressions page (Dash's callback
endpoint) shows the sentence, the components and the diff. Plus: a component regression that does
not move the step alerts on its own, and `--shift`/`--config-json` refuse bad input naming the option."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from analysis_util import Receiver, load
from dash_util import texts as _texts

from fleetscope.simulate import run_simulation
from fleetscope.synthetic import RunSpec, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

FAMILY, RANKS, STEPS = "vla-7b", 16, 6
SHIFT = 15.0  # exposed comm of vla-7b on 2 nodes is ~1 % of the step: ×15 makes it ~+10 %
GOOD, BAD = 6, 5
COMPS = ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s")


@pytest.fixture
def slack() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def alert_server(db_url: str, slack: Receiver) -> Iterator[Any]:
    from conftest import start_server

    srv = start_server(db_url, slack_webhook_url=slack.url, alert_interval_s=3600.0, public_url="https://fleet.example")
    yield srv
    srv.stop()


def _run_levels(spec: RunSpec) -> dict[str, float]:
    """The run's decomposition as docs/metrics.md defines it, computed here from the synthetic rows:
    median over steps of the cross-rank median."""
    idx = [[f.name for f in RANK_STEP_FIELDS].index(c) for c in COMPS]
    per_step = [np.median(np.array([[row[i] for i in idx] for row in rows]), axis=0) for _, rows in rank_step_rows(spec)]
    return dict(zip(COMPS, np.median(np.array(per_step), axis=0).tolist(), strict=True))


def _expected_cause(good: list[RunSpec], bad: list[RunSpec]) -> tuple[dict[str, float], dict[str, float]]:
    g = [_run_levels(s) for s in good[-5:]]
    b = [_run_levels(s) for s in bad[:5]]
    return ({c: float(np.median([x[c] for x in g])) for c in COMPS}, {c: float(np.median([x[c] for x in b])) for c in COMPS})




def _ids(node: Any) -> list[str]:
    if isinstance(node, list):
        return [i for n in node for i in _ids(n)]
    if isinstance(node, dict):
        props = node.get("props") or {}
        own = [props["id"]] if isinstance(props.get("id"), str) else []
        return own + _ids(props.get("children"))
    return []


def _page_detail(srv: Any, alert_id: int) -> Any:
    """POST /_dash-update-component as the Regressions page does when its selected-alert store is set."""
    outs = [("regressions-chart", "figure"), ("regressions-detail", "children")]
    body = {"output": ".." + "...".join(f"{i}.{p}" for i, p in outs) + "..",
            "outputs": [{"id": i, "property": p} for i, p in outs],
            "inputs": [{"id": "regressions-alert", "property": "data", "value": alert_id}],
            "changedPropIds": ["regressions-alert.data"], "state": []}
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()["response"]


def test_a_comm_regression_at_a_config_change_explains_itself_in_the_api_slack_and_the_page(
        alert_server: Any, slack: Receiver) -> None:
    from typer.testing import CliRunner

    from fleetscope.cli import app

    srv = alert_server
    good_cfg, bad_cfg = {"fsdp": {"prefetch": True}}, {"fsdp": {"prefetch": False}}
    good = [RunSpec(name=f"nightly-{i}", family=FAMILY, world_size=RANKS, steps=STEPS, seed=i, config=good_cfg,
                    git_commit=f"good{i:04d}") for i in range(GOOD)]
    bad = [RunSpec(name=f"nightly-{GOOD + i}", family=FAMILY, world_size=RANKS, steps=STEPS, seed=GOOD + i, config=bad_cfg,
                   git_commit=f"bad{i:04d}", shift={"comm_exposed_s": SHIFT}) for i in range(BAD)]
    common = {"server": srv.url, "token": srv.token, "family": FAMILY, "ranks": RANKS, "steps": STEPS}
    for s in good:
        run_simulation(run=s.name, seed=s.seed, config=s.config, git_commit=s.git_commit, **common)
    # the first bad run through the command line itself
    out = CliRunner().invoke(app, ["simulate", "--server", srv.url, "--token", srv.token, "--run", bad[0].name,
                                   "--family", FAMILY, "--ranks", str(RANKS), "--steps", str(STEPS), "--seed", str(bad[0].seed),
                                   "--shift", f"comm_exposed_s={SHIFT}", "--config-json", json.dumps(bad_cfg),
                                   "--commit", "bad0000", "--legacy-model"])  # the model run_simulation sends
    assert out.exit_code == 0, out.output
    for s in bad[1:]:
        run_simulation(run=s.name, seed=s.seed, config=s.config, git_commit=s.git_commit, shift=s.shift, **common)
    srv.compact()
    srv.state.alerts.run_once(everything=True)

    alerts = httpx.get(f"{srv.url}/api/v1/alerts", params={"state": "firing"}).json()["alerts"]
    assert len(alerts) == 1, [(a["metric"], a["details"].get("scope")) for a in alerts]  # no storm
    a = alerts[0]
    runs = {r["name"]: r["id"] for r in httpx.get(f"{srv.url}/api/v1/runs", params={"limit": 100}).json()["runs"]}
    assert a["kind"] == "run_series" and a["metric"] == "tokens_per_s_per_gpu" and a["details"]["scope"] == "family"
    assert a["first_bad"]["run_id"] == runs["nightly-6"] and a["first_bad"]["commit"] == "bad0000"

    # cause: the known answer from the synthetic rows (last 5 good vs first 5 bad runs)
    before, after = _expected_cause(good, bad)
    c = a["cause"]
    assert c["component"] == "comm_exposed_s" and c["basis"] == "step"
    assert c["before"] == pytest.approx(before["comm_exposed_s"], rel=0.02)
    assert c["after"] == pytest.approx(after["comm_exposed_s"], rel=0.02)
    assert c["step_before"] == pytest.approx(before["step_s"], rel=0.005)
    assert c["step_after"] == pytest.approx(after["step_s"], rel=0.005)
    share = (after["comm_exposed_s"] - before["comm_exposed_s"]) / (after["step_s"] - before["step_s"])
    assert c["share_of_change"] == pytest.approx(share, abs=0.05) and c["share_of_change"] > 0.8
    assert c["dim"]["name"] == "dp" and c["op"] == {**c["op"], "name": "all_reduce", "dim": "dp"}

    # diff: last good vs first bad
    d = a["diff"]
    assert d["good_run"]["id"] == runs["nightly-5"] and d["bad_run"]["id"] == runs["nightly-6"]
    assert d["config"] == {"fsdp.prefetch": [True, False]} and d["meta"] == {}
    assert d["commit"] == ["good0005", "bad0000"] and d["world_size"] == [16, 16] and d["nodes"] == [2, 2]
    assert d["truncated"] == 0
    assert httpx.get(f"{srv.url}/api/v1/alerts/{a['id']}").json()["cause"] == c  # the one-alert read too

    sentence = a["explanation"]
    assert sentence.startswith("tokens/s per GPU -") and "exposed comm explains" in sentence
    assert f"{100 * c['share_of_change']:.0f} % of it" in sentence and "mostly dim dp all_reduce" in sentence
    assert sentence.endswith("changed: config.fsdp.prefetch true → false, commit good0005 → bad0000")

    (msg,) = slack.wait(1)
    assert sentence in msg["text"]
    assert any(b.get("type") == "section" and b.get("text", {}).get("text") == f"*Why:* {sentence}" for b in msg["blocks"])

    resp = _page_detail(srv, a["id"])
    detail = resp["regressions-detail"]["children"]
    text = " ".join(_texts(detail))
    assert sentence in text and "config.fsdp.prefetch" in text and "good0005" in text and "bad0000" in text
    assert {"regressions-why", "regressions-cause", "regressions-diff"} <= set(_ids(detail))
    assert resp["regressions-chart"]["figure"]["data"]  # the series is still drawn


def test_a_data_stall_that_does_not_move_the_step_alerts_on_its_own(live_server: Any) -> None:
    # data_s ×2.5 on vla-7b: +0.04 s on a 1.5 s step (+3 %: the step does not regress), 2.9 % of the step
    for i in range(12):
        load(live_server, RunSpec(name=f"r{i}", family=FAMILY, world_size=8, steps=6, seed=i, start_ts=1.7e9 + i,
                                  shift={"data_s": 2.5} if i >= 6 else {}), collectives=False)
    live_server.state.alerts.run_once(everything=True)
    alerts = httpx.get(f"{live_server.url}/api/v1/alerts").json()["alerts"]
    assert [(x["metric"], x["details"]["primary_metric"]) for x in alerts] == [("data_s", "tokens_per_s_per_gpu")]
    a = alerts[0]
    assert a["change"] == pytest.approx(1.5, rel=0.15)  # the median of the run medians: the loader's noise is skewed
    assert a["diff"]["config"] == {} and a["diff"]["commit"] == [None, None]
    assert a["explanation"].startswith("data time +")


def test_simulate_refuses_bad_shift_and_config_naming_the_option() -> None:
    from typer.testing import CliRunner

    from fleetscope.cli import app

    base = ["simulate", "--server", "http://127.0.0.1:9", "--run", "x", "--family", "f", "--ranks", "2", "--steps", "1"]
    for opt, val, says in (("--shift", "comm_total_s=2", "--shift expects COMPONENT=FACTOR"),
                           ("--shift", "data_s=-1", "--shift expects"), ("--shift", "data_s", "--shift expects"),
                           ("--config-json", "{not json", "--config-json is not valid JSON"),
                           ("--config-json", "[1, 2]", "--config-json must be a JSON object"),
                           ("--commit", "x" * 65, "--commit must be 1-64 characters")):
        r = CliRunner().invoke(app, [*base, opt, val])
        assert r.exit_code == 2 and says in r.output, (opt, val, r.output)
    with pytest.raises(ValueError, match="shift"):
        list(rank_step_rows(RunSpec(name="x", family="f", world_size=1, steps=1, shift={"comm_total_s": 2.0})))


def test_the_slack_sentence_escapes_config_keys_values_and_commits() -> None:
    from fleetscope.server.notifier import slack_message, webhook_payload

    diff = {"config": {"<!channel>": ["<@U1>", "x"]}, "meta": {}, "commit": ["a", "<https://evil|b>"],
            "world_size": [8, 8], "nodes": [1, 1], "device_type": ["H100", "H100"], "mp_size": [1, 1],
            "hosts": {"added": ["<!here>"], "removed": []}, "truncated": 0}
    cause = {"component": "comm_exposed_s", "label": "exposed comm", "before": 0.1, "after": 0.3, "share_of_change": 0.9,
             "step_before": 1.0, "step_after": 1.22, "step_change": 0.22, "basis": "step",
             "dim": {"name": "<!everyone>"}, "op": {"name": "all_reduce"}}
    alert = {"id": 1, "kind": "run_series", "metric": "step_s", "state": "firing", "run_id": 1, "before": 1.0,
             "after": 1.22, "change": 0.22, "significance": 0.001, "url": None, "details": {"unit": "s"},
             "first_bad": {}, "cause": cause, "diff": diff}
    msg = slack_message(alert, "fired")
    text = json.dumps(msg)
    for bad in ("<!channel>", "<@U1>", "<https://evil|b>", "<!here>", "<!everyone>"):
        assert bad not in text, bad
    (why,) = [b["text"]["text"] for b in msg["blocks"] if b.get("text", {}).get("text", "").startswith("*Why:*")]
    assert why.startswith("*Why:* step time +22 % (1.00 s → 1.22 s): exposed comm explains 90 % of it (100 ms → 300 ms, "
                          "mostly dim &lt;!everyone&gt; all_reduce); changed: config.&lt;!channel&gt; &lt;@U1&gt; → x")
    # the generic webhook gets the sentence unescaped (JSON, not mrkdwn)
    assert "config.<!channel> <@U1> → x" in webhook_payload(alert, "fired")["explanation"]


def test_a_step_time_shift_within_a_run_names_its_component(live_server: Any) -> None:
    from analysis_util import scale_rows

    # from step 50 on, every rank's compute (and so its step) is 1.25x: a restart onto slower GPUs
    rid = load(live_server, RunSpec(name="restart", family="vit-h", world_size=4, steps=80),
               transform=scale_rows(1.25, 50), collectives=False)
    live_server.state.alerts.poke(runs=[rid])
    live_server.state.alerts.run_once()
    (a,) = httpx.get(f"{live_server.url}/api/v1/alerts", params={"kind": "step_time_shift"}).json()["alerts"]
    c = a["cause"]
    # the transform scales step_s and compute_s by 1.25: Δstep = 0.25 step, Δcompute = 0.25 compute
    assert c["component"] == "compute_s" and c["share_of_change"] == pytest.approx(c["before"] / c["step_before"], rel=0.02)
    assert c["after"] / c["before"] == pytest.approx(1.25, rel=0.02) and a["diff"] is None
    assert a["explanation"].startswith("step time +25 % (") and f"compute explains {100 * c['share_of_change']:.0f} % of it" in a["explanation"]
