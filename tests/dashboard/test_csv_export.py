"""CSV export of the pages' tables, in headless chromium against the real server: every table of the
run page has a "CSV" link whose file holds the table as shown (header and every row, quoted where
needed, formula-like cells defused) and the browser saves it under the table's name; the fleet
table has Dash's export button."""

from __future__ import annotations

import csv
import io
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from browser_util import severe_logs, wait_for
from conftest import start_server
from dash_util import load
from selenium.webdriver.common.by import By

from fleetscope.synthetic import RunSpec

_TABLE_ROWS = """
return Array.from(arguments[0].querySelectorAll('tr')).map(function (tr) {
    return Array.from(tr.querySelectorAll('th, td')).map(function (c) {
        return (c.innerText || '').replace(/\\s+/g, ' ').trim(); });
});
"""

_FETCH_LINK = """
var done = arguments[arguments.length - 1];
var a = arguments[0];
a.click();
fetch(a.href).then(function (r) { return r.text(); }).then(function (t) { done([a.getAttribute('download'), t]); },
                                                           function (e) { done(['error', String(e)]); });
"""


def test_every_run_page_table_downloads_as_csv(db_url: str, browser: Any) -> None:
    srv = start_server(db_url)
    downloads = Path(tempfile.mkdtemp(prefix="fs-dl-"))
    try:
        rid = load(srv, RunSpec(name='=SUM(1), "quoted"', family="f", world_size=4, steps=12), events=True,
                   config={"lr": 0.001, "note": "a, b", "tp": 2})
        browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        browser.get(f"{srv.url}/runs/{rid}")
        n = wait_for(browser, "document.querySelectorAll('table.fs-table').length >= 3 && "
                              "document.querySelectorAll('table.fs-table').length === "
                              "document.querySelectorAll('a.fs-csv-link').length && "
                              "document.querySelectorAll('table.fs-table').length", timeout=60,
                     what="the run page's tables, each with its CSV link")
        time.sleep(1.0)  # callbacks settle: the count must stay one link per table
        tables = browser.find_elements(By.CSS_SELECTOR, "table.fs-table")
        links = browser.find_elements(By.CSS_SELECTOR, "a.fs-csv-link")
        assert len(tables) == len(links) >= n
        fetched: dict[str, str] = {}
        for table in tables:
            link = browser.execute_script("return arguments[0].previousSibling", table)
            assert link.get_attribute("class") == "fs-csv-link" and link.text == "CSV"
            shown = browser.execute_script(_TABLE_ROWS, table)
            name, text = browser.execute_async_script(_FETCH_LINK, link)
            assert name.startswith(f"fleetscope-runs-{rid}-") and name.endswith(".csv"), name
            rows = list(csv.reader(io.StringIO(text)))
            want = [[("'" + c) if re.match(r"[=+@]|-(?![\d.])", c) else c for c in r] for r in shown]
            assert rows == want, (name, rows[:3], want[:3])
            fetched[name] = text
        assert len(fetched) == len(tables)  # one file name per table
        # the run table: a name with a comma and quotes survives, and as a formula it is defused
        info = next(t for t in tables if t.text.startswith("run"))
        _, text = browser.execute_async_script(_FETCH_LINK, browser.execute_script("return arguments[0].previousSibling",
                                                                                   info))
        kv = {r[0]: r[1] for r in csv.reader(io.StringIO(text)) if len(r) >= 2}
        assert kv["name"] == "'=SUM(1), \"quoted\"", kv
        # real downloads: each click saved its table's file under the link's name, with the same content
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and {p.name for p in downloads.glob("*.csv")} != set(fetched):
            time.sleep(0.1)
        assert {p.name for p in downloads.glob("*.csv")} == set(fetched), sorted(p.name for p in downloads.iterdir())
        for name, text in fetched.items():
            assert (downloads / name).read_bytes().decode("utf-8") == text, name
        # the fleet table: Dash's export of every row
        browser.get(f"{srv.url}/")
        wait_for(browser, "document.querySelector('button.export')", timeout=60, what="the fleet table's export button")
        assert not severe_logs(browser)
    finally:
        srv.stop()
        shutil.rmtree(downloads, ignore_errors=True)
