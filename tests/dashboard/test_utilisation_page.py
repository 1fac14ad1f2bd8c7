"""The Utilisation page in headless chromium against the real server: runs of two teams with known spans and
world sizes (tests/server/test_utilisation_api.py's fleet) → the per-team table's GPU-hours are the runs'
world size × wall hours in the window and add up to the page's total; the per-day chart stacks running and
idle GPU-hours; the window stays in the URL, and the nav links to the page. One short browser session."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from browser_util import severe_logs, wait_for, wait_for_charts
from selenium.webdriver.common.by import By

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_utilisation_api import T0, make_fleet  # noqa: E402


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def test_utilisation_page_per_team_gpu_hours_add_up(browser: Any, live_server: Any) -> None:
    make_fleet(live_server)
    since, until = T0.isoformat(), (T0.timestamp() + 72 * 3600)
    browser.get(f"{live_server.url}/utilisation?since={since.replace('+', '%2B')}&until={until}")
    wait_for(browser, "document.querySelectorAll('#util-team-table tbody tr').length === 2", what="the team table")
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#util-team-table tbody tr')).map("
        "tr => Array.from(tr.children).map(td => td.innerText.trim()))")
    teams = {r[0]: _num(r[1]) for r in rows}
    # vision: 4 GPUs × 8 h; lang: 8 GPUs × 3 h (of a failed run) + 2 GPUs × 22 h
    assert teams == {"vision": 32.0, "lang": 68.0}, rows
    total = browser.find_element(By.ID, "util-kpi-strip").text
    assert "100.00" in total and sum(teams.values()) == 100.0
    idle = {r[0]: _num(r[3]) for r in rows}
    assert idle == {"vision": 28.0, "lang": 68.0}
    assert wait_for_charts(browser, ["util-chart"], min_traces=2) == [2]
    stacked = browser.execute_script(
        "var gd = document.getElementById('util-chart').querySelector('.js-plotly-plot');"
        "return gd._fullData.map(t => Array.from(t.y).reduce((a, b) => a + b, 0));")
    assert sum(stacked) == pytest.approx(100.0)
    fams = browser.execute_script(
        "return Array.from(document.querySelectorAll('#util-family-table tbody tr')).map("
        "tr => [tr.children[0].innerText.trim(), tr.children[1].innerText.trim()])")
    assert {f: _num(v) for f, v in fams} == {"vit": 76.0, "llm": 24.0}
    assert "since=" in browser.current_url
    assert browser.find_elements(By.CSS_SELECTOR, "a.fs-nav-link[href='/utilisation']")
    assert severe_logs(browser) == []
