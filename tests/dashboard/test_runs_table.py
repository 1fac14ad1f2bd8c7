"""The runs table page (``/runs-table``) in headless chromium against the real server: filtering by a
config key with an operator and by a tag, grouping with medians, a chosen config column and a scalar
column, server-side sorting and paging, a bad filter named, the state round-tripping through the URL,
selected runs opening in Compare, and a console free of errors.

Chromium and chromedriver are required: without them these tests fail with a message saying so."""

from __future__ import annotations

from typing import Any

import pytest
from browser_util import severe_logs, wait_for
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from fleetscope.wire import RANK_STEP_FIELDS

_NAMES = [f.name for f in RANK_STEP_FIELDS]


def _steps(n: int, step_s: float) -> list[tuple]:
    rows = []
    for s in range(n):
        row: list[Any] = [None] * len(_NAMES)
        for k, v in {"rank": 0, "step": s, "step_s": step_s, "ts": 1.7e9 + s, "compute_s": step_s, "data_s": 0.0,
                     "comm_exposed_s": 0.0, "other_s": 0.0, "tokens": 1000, "flops": 0.2e12, "flags": 0}.items():
            row[_NAMES.index(k)] = v
        rows.append(tuple(row))
    return rows


@pytest.fixture
def runs(live_server: Any) -> dict[str, int]:
    """60 runs (more than a page): tp 1/2/4 × lr, tagged; six with steps (MFU) and one with a loss."""
    ids = {}
    with live_server.client() as c:
        for i in range(60):
            tp = (1, 2, 4)[i % 3]
            ids[f"t{i:02d}"] = c.register_run({
                "name": f"t{i:02d}", "model_family": "llm", "world_size": 1, "peak_flops": 1e12,
                "config": {"tp": tp, "lr": round(1e-4 * (1 + i % 5), 6)}, "meta": {"tags": ["sweep"] if i < 30 else []},
                "started_at": 1.7e9 + 60 * i})
        for i, step_s in enumerate((0.5, 1.0, 2.0, 0.25, 4.0, 1.0)):
            c.ingest_rows(ids[f"t{i:02d}"], _steps(4, step_s))
        c.ingest({"v": 1, "run_id": ids["t03"], "events": [
            {"rank": 0, "seq": s, "kind": "scalars", "ts": 1.7e9, "step": s, "data": {"loss": 2.0 - s / 10}} for s in range(4)]},
            fmt="json")
    live_server.compact()
    return ids


def _rows(browser: Any) -> list[list[str]]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#rt-table tr')).slice(1).map("
        "tr => Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim()));")


def _wait_rows(browser: Any, js_cond: str, what: str) -> None:
    wait_for(browser, "(function () { const rows = Array.from(document.querySelectorAll('#rt-table tr')).slice(1).map("
                      "tr => Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim())); return " + js_cond
             + "; })()", what=what)


def test_filter_group_columns_sort_page_and_url_round_trip(browser: Any, live_server: Any, runs: dict[str, int]) -> None:
    browser.get(live_server.url + "/runs-table")
    wait_for(browser, "document.querySelector('#rt-count') && "
                      "document.querySelector('#rt-count').innerText.includes('60 runs match')", what="60 runs listed")
    assert len(_rows(browser)) == 50  # a page; the server pages
    # filter: tp=4 with lr above 0.0002, tag sweep
    box = browser.find_element(By.ID, "rt-filter")
    box.send_keys("config.tp=4 config.lr>0.0002 tag=sweep" + Keys.ENTER)
    expected = sorted(f"t{i:02d}" for i in range(30) if i % 3 == 2 and 1e-4 * (1 + i % 5) > 2e-4)
    wait_for(browser, f"document.querySelector('#rt-count').innerText.includes('{len(expected)} runs match') && "
                      "window.location.search.includes('filter=')", what="the filtered count")
    _wait_rows(browser, f"rows.length === {len(expected)}", "the filtered rows")
    assert sorted(r[1] for r in _rows(browser)) == expected  # column 0: the selection box
    assert f"{len(expected)} runs match" in browser.find_element(By.ID, "rt-count").text

    # a bad clause is named
    box.send_keys(" colour=red" + Keys.ENTER)
    wait_for(browser, "document.querySelector('#rt-error').innerText.includes('colour')", what="the error")
    box.clear()
    box.send_keys(Keys.ENTER)
    wait_for(browser, "document.querySelector('#rt-count').innerText.includes('60 runs match')", what="all runs again")

    # state from the URL: group by tp, config.lr and the loss as columns, sorted by MFU, descending
    browser.get(live_server.url + "/runs-table?filter=tag%3Dsweep&group=config.tp&columns=config.lr,scalar.loss.last"
                "&sort=mfu:desc")
    wait_for(browser, "document.querySelector('#rt-groups') && "
                      "document.querySelector('#rt-groups').innerText.includes('median MFU')", what="the groups table")
    groups = browser.find_element(By.ID, "rt-groups").text
    assert "config.tp" in groups and "runs" in groups
    _wait_rows(browser, "rows.length === 30 && rows[0][1] === 't03'", "rows sorted by MFU")
    rows = _rows(browser)
    # MFU 0.2 TFLOP / step_s / 1 TFLOP/s: t03 (0.25 s) 80 %, t00 40 %, t01 20 %, t05 20 %, t02 10 %, t04 5 %
    assert [r[1] for r in rows[:6]] == ["t03", "t00", "t01", "t05", "t02", "t04"] or \
        [r[1] for r in rows[:6]] == ["t03", "t00", "t05", "t01", "t02", "t04"]
    header = browser.execute_script("return Array.from(document.querySelectorAll('#rt-table th')).map(t => t.innerText.trim());")
    assert "config.lr" in header and "scalar.loss.last" in header
    lr_col, loss_col = header.index("config.lr"), header.index("scalar.loss.last")
    assert rows[0][loss_col] == "1.7" and rows[0][lr_col] == "0.0004"
    group_rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#rt-groups tr')).slice(1).map("
        "tr => Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim()));")
    assert sorted((g[0], g[1]) for g in group_rows) == [("1", "10"), ("2", "10"), ("4", "10")]
    # tp=1 holds t00 (40 %) and t03 (80 %): median 60 %
    assert next(g for g in group_rows if g[0] == "1")[2] == "60.0%"

    # select two runs → compare
    boxes = browser.find_elements(By.CSS_SELECTOR, "#rt-table input[type='checkbox']")
    boxes[0].click()
    boxes[1].click()
    # the link appears at the first box and is drawn again at the second: wait for the one of both runs
    want = f"/compare?runs={runs['t03']},{runs['t00']}"
    wait_for(browser, f"(document.querySelector('#rt-compare-link') || {{}}).href?.endsWith('{want}') === true",
             what="the compare link of both runs")
    link = browser.find_element(By.ID, "rt-compare-link")
    assert link.get_attribute("href").endswith(want)
    link.click()
    wait_for(browser, "window.location.pathname === '/compare'", what="the compare page")
    assert severe_logs(browser) == []


def test_sorting_and_paging_run_on_the_server_and_reach_the_url(browser: Any, live_server: Any,
                                                               runs: dict[str, int]) -> None:
    browser.get(live_server.url + "/runs-table?sort=name:asc")
    _wait_rows(browser, "rows.length === 50 && rows[0][1] === 't00'", "the first page by name")
    browser.find_element(By.CSS_SELECTOR, "#rt-table .next-page").click()
    _wait_rows(browser, "rows.length === 10 && rows[0][1] === 't50'", "the second page")
    wait_for(browser, "window.location.search.includes('page=1')", what="page in the URL")
    assert "sort=name%3Aasc" in browser.current_url or "sort=name:asc" in browser.current_url
    browser.get(browser.current_url)  # a shared link shows the same page
    _wait_rows(browser, "rows.length === 10 && rows[9][1] === 't59'", "the same page after reload")
    # a new filter starts again at the first page
    browser.find_element(By.ID, "rt-filter").send_keys("config.tp=1" + Keys.ENTER)
    _wait_rows(browser, "rows.length === 20 && rows[0][1] === 't00' && rows[1][1] === 't03'", "page 1 of the filter")
    wait_for(browser, "!window.location.search.includes('page=')", what="no page in the URL")
    assert severe_logs(browser) == []


def test_run_page_draws_scalars_beside_step_time_and_compare_overlays_them(browser: Any, live_server: Any,
                                                                          runs: dict[str, int]) -> None:
    from browser_util import wait_for_charts

    with live_server.client() as c:  # a checkpoint at step 2 of t03, and a loss on t00 too
        c.ingest({"v": 1, "run_id": runs["t03"], "events": [
            {"rank": 0, "seq": 100, "kind": "checkpoint", "ts": 1.7e9 + 2, "step": 2, "data": {"duration_s": 1.0}}]},
            fmt="json")
        c.ingest({"v": 1, "run_id": runs["t00"], "events": [
            {"rank": 0, "seq": s, "kind": "scalars", "ts": 1.7e9, "step": s, "data": {"loss": 3.0 - s / 10}}
            for s in range(4)]}, fmt="json")
    browser.get(f"{live_server.url}/runs/{runs['t03']}")
    (n,) = wait_for_charts(browser, ["run-scalars"], min_traces=3)
    fig = browser.execute_script(
        "const gd = document.querySelector('#run-scalars .js-plotly-plot'); "
        "return gd.data.map(t => [t.name, Array.from(t.x || []), Array.from(t.y || [])]);")
    by = {name: (x, y) for name, x, y in fig}
    assert by["loss"] == ([0, 1, 2, 3], [2.0, 1.9, 1.8, 1.7])
    assert by["step time (s)"][0] == [0, 1, 2, 3] and by["step time (s)"][1] == [0.25] * 4
    assert by["checkpoint"][0] == [2]
    # no panel on a run without scalars
    browser.get(f"{live_server.url}/runs/{runs['t01']}")
    wait_for(browser, "document.querySelector('#run-decomposition') !== null", what="the run page")
    assert browser.execute_script("return document.querySelector('#run-scalars') === null")
    # compare overlays the loss of both runs
    browser.get(f"{live_server.url}/compare?runs={runs['t03']},{runs['t00']}")
    wait_for_charts(browser, ["compare-scalars"], min_traces=2)
    names = browser.execute_script("return document.querySelector('#compare-scalars .js-plotly-plot').data.map(t => t.name);")
    assert names == ["t03", "t00"]
    assert severe_logs(browser) == []
