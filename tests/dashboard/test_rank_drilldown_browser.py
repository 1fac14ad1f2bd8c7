"""The run page's rank drill-down in headless chromium against the real server: the heatmap draws another
component when picked, typing a rank draws its components against the median rank (the straggler's
compute 1.3× the median's), with its node, the URL keeps the rank, and a zero-code run's page says what
its data time holds, and the device panel beside the heatmap draws the GPU clocks with the throttled rank
marked by its reason (in the chart and its table row). One short browser session (chromium and chromedriver are required, as in
test_browser.py)."""

from __future__ import annotations

from typing import Any

from browser_util import severe_logs, wait_for, wait_for_charts
from dash_util import load
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from fleetscope.simulate import _Events, device_events
from fleetscope.synthetic import RunSpec

#: mean of the y values of trace i of the drill-down chart as drawn (plotly's decoded typed arrays)
_MEAN_JS = """
var gd = document.getElementById('run-rank-chart').querySelector('.js-plotly-plot') || document.getElementById('run-rank-chart');
var y = Array.from(gd._fullData[arguments[0]].y).filter(function (v) { return v === v && v !== null; });
return y.reduce(function (a, b) { return a + b; }, 0) / y.length;
"""


def test_run_page_heatmap_component_and_rank_drilldown(browser: Any, live_server: Any) -> None:
    spec = RunSpec(name="drill", family="vla-7b", world_size=8, steps=20, seed=2, straggler={3: 1.3})
    rid = load(live_server, spec, meta={"instrumented_by": "fleetscope run", "synthetic": True})
    with live_server.client() as c:  # the straggler's GPU held down by heat (simulate --throttle 3:thermal)
        evs = device_events(8, {3: "thermal"}, spec.start_ts, spec.start_ts + 60, _Events(), max_windows=2)
        assert c.ingest({"v": 1, "run_id": rid, "events": evs}, fmt="json")["accepted"]["events"] == 16
    browser.get(f"{live_server.url}/runs/{rid}")
    wait_for(browser, "document.querySelector('.fs-header') !== null", what="the dashboard shell")
    wait_for_charts(browser, ["run-heatmap"])
    browser.find_element(By.CSS_SELECTOR, "#run-heat-field input[value='compute_s']").click()
    wait_for(browser, "document.querySelector('#run-heatmap').textContent.includes('Per-rank compute')",
             what="the compute heatmap")
    box = browser.find_element(By.ID, "run-rank-pick")
    box.clear()
    box.send_keys("3", Keys.ENTER)
    wait_for_charts(browser, ["run-rank-chart"], min_traces=12)
    names = browser.execute_script(
        "var e = document.getElementById('run-rank-chart');"
        "return ((e.querySelector('.js-plotly-plot') || e).data || []).map(function (t) { return t.name; });")
    assert names.count("rank 3") == 6 and names.count("median rank") == 6, names
    # panels: step, data, compute …; per panel the rank's trace then the median's
    assert 1.2 < browser.execute_script(_MEAN_JS, 4) / browser.execute_script(_MEAN_JS, 5) < 1.4
    kpis = browser.find_element(By.ID, "run-rank-panel-kpis").text.lower()
    assert "node0000" in kpis and "slowdown" in kpis and "lateness at collectives" in kpis
    assert "optimizer.step()" in browser.find_element(By.ID, "run-rank-panel-zero-code").text
    assert "optimizer.step()" in browser.find_element(By.ID, "run-zero-code-data").text
    wait_for(browser, "window.location.search.includes('rank=3')", what="rank=3 in the URL")
    # the device panel: the throttled rank marked by its reason in the clock chart and in the table
    wait_for_charts(browser, ["run-devices-figure"], min_traces=2)
    traces = browser.execute_script(
        "var e = document.getElementById('run-devices-figure');"
        "return ((e.querySelector('.js-plotly-plot') || e).data || []).map(function (t) {"
        " return [t.name, Array.from(t.x)]; });")
    marked = {name: xs for name, xs in traces}
    assert marked.get("throttled: thermal") == [3] and len(marked.get("not throttled", [])) == 7, traces
    wait_for(browser, "document.getElementById('run-devices-table-rows') !== null", what="the device table")
    rows = browser.find_elements(By.CSS_SELECTOR, "#run-devices-table-rows tbody tr")
    assert len(rows) == 1 and "fs-differs" in (rows[0].get_attribute("class") or "")
    cells = [td.text for td in rows[0].find_elements(By.TAG_NAME, "td")]
    assert cells[0] == "3" and cells[2] == "thermal" and cells[3] == "95 %", cells
    errs = severe_logs(browser)
    assert not errs, "browser console errors:\n" + "\n".join(errs)
