"""The run page's "what if" panel in headless chromium against the real server: a link with ``?ws=8`` opens
with the projection at 8 GPUs, typing another world size projects there and puts it in the URL, and the
URL alone brings the same answer back (dashboard/projection_panel.py). One short browser session."""

from __future__ import annotations

from typing import Any

from browser_util import severe_logs, wait_for
from dash_util import load
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from fleetscope.synthetic import RunSpec


def test_what_if_panel_keeps_its_inputs_in_the_url(browser: Any, live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="whatif", family="llm-70b", world_size=4, steps=12, seed=5, comm_bound=True))
    with live_server.client() as c:
        want16 = c.projection(rid, world_size=16)["step_s"]
    browser.get(f"{live_server.url}/runs/{rid}?ws=8")
    wait_for(browser, "(document.getElementById('run-whatif-out-layout') || {}).textContent === '8 GPUs = dp 8 × tp 1 × pp 1'",
             what="the projection at 8 GPUs")
    assert "estimated" in browser.find_element(By.ID, "run-whatif-out-step").text.lower()
    box = browser.find_element(By.ID, "run-whatif-ws")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("16", Keys.ENTER)
    wait_for(browser, "document.getElementById('run-whatif-out-layout').textContent.startsWith('16 GPUs')",
             what="the projection at 16 GPUs")
    wait_for(browser, "window.location.search.includes('ws=16')", what="ws=16 in the URL")
    shown16 = browser.find_element(By.ID, "run-whatif-out-step").text
    # the URL alone restores the inputs and the answer (the same figure as the API's)
    browser.get(browser.current_url)
    wait_for(browser, "((document.getElementById('run-whatif-out-layout') || {}).textContent || '').startsWith('16 GPUs')",
             what="the projection restored from the URL")
    assert browser.find_element(By.ID, "run-whatif-ws").get_attribute("value") == "16"
    assert browser.find_element(By.ID, "run-whatif-out-step").text == shown16
    assert want16 is not None and want16 > 0
    errs = severe_logs(browser)
    assert not errs, "browser console errors:\n" + "\n".join(errs)


def test_projected_curve_starts_at_the_measured_point_with_its_band() -> None:
    from fleetscope.dashboard.projection_panel import add_projected_traces, what_if_body

    fig = {"data": [{"x": [4, 8], "y": [100.0, 180.0], "legendgroup": "0", "name": "measured"}]}
    proj = {"configs": [{"config": "H100 · a", "from_world_size": 4, "points": [
        {"world_size": 8, "status": "ok", "tokens_per_s": 190.0, "tokens_per_s_band": [170.0, 210.0]},
        {"world_size": 16, "status": "insufficient_data", "missing": ["x"]}]}]}
    out = add_projected_traces(fig, proj, ["H100 · a"], ["#123456"])
    hi, lo, line = out["data"][1:]
    assert line["x"] == [4, 8] and line["y"] == [100.0, 190.0] and line["line"]["dash"] == "dash"
    assert "estimated" in line["name"]
    assert (lo["y"], hi["y"], lo["fill"]) == ([100.0, 170.0], [100.0, 210.0], "tonexty")
    assert add_projected_traces(fig, proj, ["another config"], ["#123456"]) == fig  # nothing to add
    missing = what_if_body({"status": "insufficient_data", "missing": ["the run's collectives (none recorded)"]})
    assert "none recorded" in str(missing)


def test_scaling_page_draws_projections_from_the_smallest_run(live_server: Any, monkeypatch: Any) -> None:
    from fleetscope.dashboard import _state
    from fleetscope.dashboard import figures as F
    from fleetscope.dashboard.app import build_dash
    from fleetscope.dashboard.projection_panel import add_projected_traces, track_record_table
    from fleetscope.server import reports

    eng = live_server.state.engine
    ids = {n: load(live_server, RunSpec(name=f"sc{n}", family="vit-h", world_size=n, steps=8, seed=n)) for n in (4, 8, 16)}
    view = reports.scaling_view(eng, "vit-h")
    proj = reports.scaling_projections(eng, "vit-h")
    [cfg] = proj["configs"]
    assert cfg["config"] == view["configs"][0]["config"] and cfg["from_run"] == ids[4]
    assert [p["world_size"] for p in cfg["points"]] == [8, 16, 32, 64]  # measured sizes, then 2× and 4× the largest
    assert [p["measured"] for p in cfg["points"]] == [True, True, False, False]
    # compute-bound: the back-test (without the measured runs' own collectives) is close
    assert [b["world_size"] for b in cfg["backtest"]] == [8, 16]
    assert all(abs(b["error"]) < 0.1 for b in cfg["backtest"])
    fig = add_projected_traces(F.scaling_throughput_figure(view), proj, [view["configs"][0]["config"]], ["#123456"])
    dashed = [t for t in fig["data"] if (t.get("line") or {}).get("dash") == "dash"]
    assert len(dashed) == 1 and dashed[0]["x"] == [4, 8, 16, 32, 64]
    table = str(track_record_table(reports.track_record(eng, "vit-h")))
    assert "Back-test: 2 checked" in table and "back-test" in table
    # the page's own callbacks (not a browser): the throughput chart carries the dashed projection
    build_dash()
    from fleetscope.dashboard.pages import scaling as page

    monkeypatch.setattr(_state, "engine", lambda: eng)
    through = page._fill("vit-h", {})[0]
    assert any((t.get("line") or {}).get("dash") == "dash" for t in through["data"])
    assert "Back-test: 2 checked" in str(page._track("vit-h"))
