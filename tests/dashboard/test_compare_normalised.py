"""Honest display in headless chromium against the real server: compare colours Δ better/worse only within
the first run's family (across families neutral), the normalisation selector shows per-parameter throughput
and keeps itself in the URL, and a CPU run's MFU tile says there is no peak for its device. One short
browser session (chromium and chromedriver are required, as in test_browser.py)."""

from __future__ import annotations

from typing import Any

from browser_util import severe_logs, wait_for
from dash_util import load
from selenium.webdriver.common.by import By

from fleetscope.synthetic import RunSpec

#: per run column of the diff table: the classes of its Δ spans
_DELTA_CLASSES_JS = """
var rows = Array.from(document.querySelectorAll('#compare-diff tbody tr'));
var out = [[], [], []];
rows.forEach(function (tr) {
    Array.from(tr.children).slice(1).forEach(function (td, i) {
        td.querySelectorAll('.fs-delta').forEach(function (s) { out[i].push(s.className); });
    });
});
return out;
"""


def test_compare_colours_within_a_family_normalises_and_cpu_mfu_tile(browser: Any, live_server: Any) -> None:
    a = load(live_server, RunSpec(name="vla-a", family="vla-7b", world_size=4, steps=8, seed=1))
    b = load(live_server, RunSpec(name="vla-slow", family="vla-7b", world_size=4, steps=8, seed=2, slow_factor=1.3))
    c = load(live_server, RunSpec(name="vit-c", family="vit-h", world_size=4, steps=8, seed=3))
    cpu = load(live_server, RunSpec(name="cpu-run", family="vit-h", world_size=2, steps=6, seed=4),
               device_type="cpu", peak_flops=None)

    browser.get(f"{live_server.url}/compare?runs={a},{b},{c}")
    wait_for(browser, "document.querySelectorAll('#compare-diff .fs-delta').length > 0", what="the diff table")
    cols = browser.execute_script(_DELTA_CLASSES_JS)
    same, other = cols[1], cols[2]
    assert "fs-delta fs-bad" in same  # the slower run of the same family: judged (tokens/s/GPU down → red)
    assert other and all(k == "fs-delta fs-neutral" for k in other), other  # another family: never red/green

    browser.find_element(By.CSS_SELECTOR, "#compare-norm input[value='param']").click()
    wait_for(browser, "window.location.search.includes('norm=param')", what="norm=param in the URL")
    text = wait_for(browser, "(function () { var t = document.getElementById('compare-normalised-table');"
                             "return t && t.innerText.includes('active params') ? t.innerText : null; })()",
                    what="the per-parameter table")
    assert "7G" in text and "630M" in text  # 7B and 0.63B parameters, as recorded

    browser.get(f"{live_server.url}/runs/{cpu}")
    tile = wait_for(browser, "(function () { var e = document.getElementById('run-mfu'); return e && e.innerText; })()",
                    what="the MFU tile")
    assert "no peak for this device" in tile and "measured" not in tile, tile
    errs = severe_logs(browser)
    assert not errs, "browser console errors:\n" + "\n".join(errs)


def test_bus_bandwidth_keeps_its_digits_and_a_straggler_from_step_0_is_no_change_point(live_server: Any) -> None:
    from dash_util import add_alert
    from fleetscope.dashboard import figures as F
    from fleetscope.dashboard.theme import fmt_bw
    from fleetscope.server import reports
    from fleetscope.server.analysis.explain import format_metric

    # a real small bandwidth is never "0.0 GB/s"
    assert [fmt_bw(v) for v in (3.2e6, 45.3e6, 12.5e9, 0.0, None)] == ["3.2 MB/s", "45.3 MB/s", "12.5 GB/s", "0 B/s", "–"]
    assert format_metric(3.2e6, "B/s") == "3.2 MB/s"  # alert sentences (Slack, the Regressions page) alike

    rid = load(live_server, RunSpec(name="strag", family="vla-7b", world_size=4, steps=12, seed=5, straggler={2: 1.3}))
    first = {"run_id": rid, "rank": 2, "node": "node0000", "step": 0}
    alert = add_alert(live_server.state.engine, kind="straggler", metric="straggler_slowdown", run_id=rid, first_bad=first)
    late = add_alert(live_server.state.engine, kind="straggler", metric="straggler_slowdown", run_id=rid,
                     first_bad={**first, "step": 6}, dedup_key="test:late")
    by_id = {a["id"]: a for a in reports.alerts_view(live_server.state.engine)}
    ser = reports.alert_series(live_server.state.engine, by_id[alert])
    assert ser is not None and len(ser["y"]) == 12 and ser["change_x"] is None  # slow from its first step
    fig = F.alert_series_figure(ser, by_id[alert])
    assert not fig["layout"].get("shapes") and not any(a.get("text") == "change point"
                                                       for a in fig["layout"].get("annotations") or [])
    assert reports.alert_series(live_server.state.engine, by_id[late])["change_x"] == 6  # it came later: marked
