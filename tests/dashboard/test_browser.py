"""The dashboard in headless chromium against the real server: every page draws its charts with
data, the fleet links through to a run, page state round-trips through the URL, an empty database
explains how to get data, and the browser console stays free of errors. One browser for the module.

Chromium and chromedriver are required: without them these tests fail with a message saying so.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from browser_util import severe_logs, wait_for, wait_for_charts
from conftest import _db_uri, start_server
from dash_util import add_alert, add_benchmarks, load
from selenium.webdriver.common.by import By

from fleetscope.synthetic import RunSpec

RUN_CHARTS = ["run-decomposition", "run-heatmap", "run-stragglers", "run-throughput", "run-memory",
              "run-collectives", "run-comm-dims-chart", "run-modality"]


@pytest.fixture(scope="module")
def fleet(pg_admin_uri: str) -> Iterator[dict[str, Any]]:
    """One server with a small fleet: a family at three sizes (one with a straggler node, per-modality
    tokens and events), another family, a regression alert and benchmark series."""
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    srv = start_server(_db_uri(pg_admin_uri, name))
    try:
        ids = {}
        for n in (8, 16, 32):
            slow = {r: 1.3 for r in range(8, 16)} if n == 16 else {}
            ids[n] = load(srv, RunSpec(name=f"vla-{n}", family="vla-7b", world_size=n, steps=40, seed=n, straggler=slow,
                                       start_ts=1.7e9 + n * 3600), modalities=n == 16, events=n == 16, compact=False)
        ids["vit"] = load(srv, RunSpec(name="vit-8", family="vit-h", world_size=8, steps=20, seed=3), compact=False)
        srv.compact()
        eng = srv.state.engine
        add_alert(eng, kind="run_series", run_id=ids[32], before=9000.0, after=7000.0, change=-0.22,
                  first_bad={"run_id": ids[16], "index": 1},
                  details={"runs": [ids[8], ids[16], ids[32]], "values": [9e3, 7e3, 7.1e3]})
        add_benchmarks(srv)
        from fleetscope.server.store.traces import save_traces

        summary = {"kernel_time_us": 81_234.0, "compute_pct": 71.25, "non_compute_pct": 20.5, "idle_pct": 8.25,
                   "comm_overlap_pct": 41.0, "top_kernels": [
                       {"kernel_type": "COMPUTATION", "name": "sm90_xmma_gemm_bf16", "count": 96, "sum_us": 41_000.0},
                       {"kernel_type": "COMMUNICATION", "name": "ncclKernel_AllReduce_RING_LL", "count": 8, "sum_us": 9_000.0}]}
        save_traces(eng, run_id=ids[16], rows=[(r, f"rank{r}.pt.trace.json", summary) for r in range(2)] + [
            (-1, "import", {"kernel_types": [{"kernel_type": "COMPUTATION", "time_us": 82_000.0, "percentage": 82.0}]})])
        yield {"srv": srv, "url": srv.url, "ids": ids}
    finally:
        srv.stop()
        with psycopg.connect(pg_admin_uri, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _open(browser: Any, url: str) -> None:
    browser.get(url)
    wait_for(browser, "document.querySelector('.fs-header') !== null", what="the dashboard shell")


def _no_console_errors(browser: Any) -> None:
    errs = severe_logs(browser)
    assert not errs, "browser console errors:\n" + "\n".join(errs)


@pytest.mark.parametrize("page,charts", [
    ("/runs/{r16}", RUN_CHARTS),
    ("/scaling?family=vla-7b", ["scaling-throughput", "scaling-efficiency", "scaling-decomposition-0"]),
    ("/compare?runs={r8},{r16}", ["compare-series", "compare-decomposition"]),
    ("/regressions", ["regressions-chart"]),
    ("/benchmarks", ["benchmarks-size", "benchmarks-0", "benchmarks-1"]),
])
def test_every_page_draws_its_charts_with_data(browser: Any, fleet: dict[str, Any], page: str, charts: list[str]) -> None:
    ids = fleet["ids"]
    _open(browser, fleet["url"] + page.format(**{f"r{k}": v for k, v in ids.items()}))
    counts = wait_for_charts(browser, charts)
    assert all(c >= 1 for c in counts)
    _no_console_errors(browser)


def test_run_page_shows_report_straggler_node_and_units(browser: Any, fleet: dict[str, Any]) -> None:
    _open(browser, f"{fleet['url']}/runs/{fleet['ids'][16]}")
    wait_for_charts(browser, RUN_CHARTS)
    text = wait_for(browser, "document.getElementById('run-bottleneck-report') && "
                             "document.getElementById('run-straggler-table').innerText", what="the reports")
    assert "node0001" in text  # the straggler node is named
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Fix first:" in body and "UTC" in body and "tokens/s" in body
    phases = browser.find_element(By.ID, "run-phases").text.lower()  # every phase, biggest first, median step
    assert "compute phases" in phases and all(p in phases for p in ("forward", "backward", "optimizer"))
    assert phases.index("backward") < phases.index("forward") < phases.index("optimizer")  # synthetic: 0.6 / 0.33 / rest
    heat = browser.execute_script("return document.querySelector('#run-heatmap').textContent")
    assert "Per-rank work time" in heat and "every rank and step (16 × 40)" in heat
    wait_for(browser, "document.getElementById('run-traces') !== null", what="the trace section")
    traces = browser.find_element(By.ID, "run-traces").text
    assert "71.25" in traces and "sm90_xmma_gemm_bf16" in traces and "COMPUTATION" in traces
    assert "Goodput" in body and "Events (4)" in body
    for axis in ("time per step (s)", "memory (GB)", "busbw (GB/s)", "throughput (tokens/s)"):
        assert axis in browser.page_source, axis
    _no_console_errors(browser)


def test_fleet_lists_runs_and_links_through_to_a_run(browser: Any, fleet: dict[str, Any]) -> None:
    _open(browser, fleet["url"] + "/")
    wait_for(browser, "document.querySelectorAll('#fleet-table a').length >= 4", what="fleet rows")
    body = browser.find_element(By.ID, "fleet-table").text
    assert "vla-16" in body and "vit-h" in body and "compute" in body
    browser.find_element(By.LINK_TEXT, "vla-16").click()
    wait_for(browser, f"window.location.pathname === '/runs/{fleet['ids'][16]}'", what="navigation to the run")
    wait_for_charts(browser, ["run-decomposition", "run-heatmap"])
    _no_console_errors(browser)


def test_page_state_round_trips_through_the_url(browser: Any, fleet: dict[str, Any]) -> None:
    ids = fleet["ids"]
    url = f"{fleet['url']}/compare?runs={ids[16]},{ids[8]}"
    _open(browser, url)
    wait_for_charts(browser, ["compare-series"])
    names = browser.execute_script("return Array.from(document.querySelectorAll('#compare-diff th')).map(e => e.innerText)")
    assert names[1:] == ["vla-16", "vla-8"]
    browser.find_element(By.CSS_SELECTOR, "#compare-only-diff input").click()  # show every config key
    wait_for(browser, "window.location.search.includes('diff=all')", what="diff=all in the URL")
    shared = browser.current_url
    assert f"runs={ids[16]},{ids[8]}" in shared
    _open(browser, shared)  # the link reproduces the view
    wait_for_charts(browser, ["compare-series"])
    assert not browser.find_element(By.CSS_SELECTOR, "#compare-only-diff input").is_selected()
    assert "bucket_mb" in browser.find_element(By.ID, "compare-config-table").text
    # fleet filters and the heatmap controls write their state into the URL too
    _open(browser, f"{fleet['url']}/?family=vit-h")
    wait_for(browser, "document.querySelectorAll('#fleet-table a').length === 1", what="the filtered fleet")
    browser.find_element(By.ID, "fleet-search").send_keys("vit")
    wait_for(browser, "window.location.search.includes('q=vit') && window.location.search.includes('family=vit-h')",
             what="the search in the URL")
    _open(browser, f"{fleet['url']}/runs/{ids[8]}")
    wait_for_charts(browser, ["run-heatmap"])
    browser.find_element(By.CSS_SELECTOR, "#run-heat-field input[value='step_s']").click()
    wait_for(browser, "window.location.search.includes('heat=step_s')", what="heat=step_s in the URL")
    wait_for(browser, "document.querySelector('#run-heatmap').textContent.includes('Per-rank step time')",
             what="the step-time heatmap")
    _no_console_errors(browser)


def test_empty_database_pages_explain_how_to_get_data(browser: Any, live_server: Any) -> None:
    expect = {"/": "No runs yet", "/scaling": "No model families yet", "/compare": "Pick runs to compare",
              "/regressions": "No firing alerts", "/benchmarks": "No microbenchmarks yet", "/runs/7": "There is no run"}
    for page, title in expect.items():
        _open(browser, live_server.url + page)
        text = wait_for(browser, "Array.from(document.querySelectorAll('.fs-empty')).map(e => e.innerText).join('\\n')",
                        what=f"the empty state of {page}")
        assert title in text, (page, text)
        _no_console_errors(browser)
