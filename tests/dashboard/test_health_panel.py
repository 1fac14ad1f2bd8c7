"""The health panel in chromium on the real server: a hung run's page leads with where it stopped (the
finding, the ranks that never arrived, their node and stack), a failed run's page with its failures
(root cause first), a restarted job's page lists its attempts, and the fleet page lists hung and
failed runs first with their finding."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_util import severe_logs, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from health_util import FAST, event, frame, nodes, state_is, steps_batch, stuck, waiting  # noqa: E402
from health_util import wait_for as poll  # noqa: E402


@pytest.fixture
def srv(db_url: str) -> Iterator[Any]:
    from conftest import start_server

    # positions stay live for the whole test; a run without steps stays running (its first-step minimum)
    s = start_server(db_url, **{**FAST, "stall_silence_s": 600.0, "stall_first_s": 600.0})
    yield s
    s.stop()


def _fleet(srv: Any) -> dict[str, int]:
    t0 = time.time() - 120
    ids: dict[str, int] = {}
    with srv.client() as c:
        ids["ok"] = c.register_run({"name": "healthy-run", "world_size": 2, "started_at": t0})
        ids["hung"] = c.register_run({"name": "stuck-run", "world_size": 4, "started_at": t0})
        ids["failed"] = c.register_run({"name": "crashed-run", "world_size": 2, "started_at": t0})
        for k in ("hung", "failed"):
            ws = 4 if k == "hung" else 2
            c.ingest(steps_batch(ids[k], ws, range(3), t0=t0, ranks=nodes(ws, per_node=2)))
        srv.compact()
        poll(state_is(srv, ids["hung"], "running"))
        evs = [waiting(r, 3, "all_reduce", 7) for r in (0, 1, 2)]
        evs.append(stuck(3, 3, 6, [frame("/ws/train.py", 9, "main"), frame("/ws/io/reader.py", 42, "read_shard")],
                         phase="data"))
        c.ingest({"v": 1, "run_id": ids["hung"], "events": evs})
        c.ingest({"v": 1, "run_id": ids["failed"], "events": [
            event(1, "failure", {"source": "exception", "exception": "KeyError", "message": "'labels'", "rank": 1,
                                 "frames": [frame("/ws/train.py", 50, "step")]}, step=3, ts=time.time() - 5),
            event(0, "failure", {"source": "signal", "signal": "SIGTERM", "rank": 0}, step=3, ts=time.time() - 3)]})
        # a restarted job: two attempts
        a0 = c.register_run({"name": "restarted", "world_size": 1, "job_id": "job-9", "started_at": t0})
        c.ingest(steps_batch(a0, 1, range(6), t0=t0))
        c.finish_run(a0, "failed", finished_at=t0 + 10)
        ids["a1"] = c.register_run({"name": "restarted", "world_size": 1, "job_id": "job-9", "attempt": 1,
                                    "started_at": t0 + 20})
        c.ingest(steps_batch(ids["a1"], 1, range(4, 9), t0=t0 + 20))
        srv.compact()
        c.finish_run(ids["a1"], "finished")
    poll(state_is(srv, ids["hung"], "hung"))
    poll(state_is(srv, ids["failed"], "failed"))
    return ids


def _text(browser: Any, css: str) -> str:
    return str(wait_for(browser, f"document.querySelector({css!r}) && document.querySelector({css!r}).innerText",
                        what=css))


def test_health_panel_leads_the_run_page_and_the_fleet_lists_hung_and_failed_first(srv: Any, browser: Any) -> None:
    ids = _fleet(srv)
    browser.get(f"{srv.url}/runs/{ids['hung']}")
    finding = _text(browser, "#run-health-finding")
    assert "run stuck-run hung at step 3: 3 of 4 ranks wait in all_reduce #7 on dim dp" in finding
    assert "rank 3 (node n0001) never arrived — stuck in `reader.py:42 read_shard`" in finding
    assert "3" in _text(browser, "#run-health-missing") and "n0001" in _text(browser, "#run-health-nodes")
    assert "reader.py:42 read_shard" in _text(browser, "#run-health-stacks")
    # it leads the page: before the KPI strip and every other panel
    first = browser.execute_script(
        "const h = document.getElementById('run-health'), k = document.getElementById('run-kpis');"
        "return !!h && !!k && !!(h.compareDocumentPosition(k) & Node.DOCUMENT_POSITION_FOLLOWING);")
    assert first is True

    browser.get(f"{srv.url}/runs/{ids['failed']}")
    assert "rank 1 (node n0000) raised KeyError: 'labels'" in _text(browser, "#run-health-finding")
    rows = wait_for(browser, "Array.from(document.querySelectorAll('#run-health-failures tbody tr'))"
                             ".map(r => r.innerText)", what="failure rows")
    assert rows[0].startswith("root cause") and "KeyError" in rows[0] and "SIGTERM" in rows[1]

    browser.get(f"{srv.url}/runs/{ids['a1']}")
    att = wait_for(browser, "Array.from(document.querySelectorAll('#run-attempts tbody tr')).map(r => r.innerText)",
                   what="attempts rows")
    assert len(att) == 2 and "redone" not in att[0]
    cells = wait_for(browser, "Array.from(document.querySelectorAll('#run-attempts tbody tr:nth-child(2) td'))"
                              ".map(c => c.innerText)", what="attempt 1 cells")
    assert cells[0] == "1" and cells[6] == "2"  # steps 4 and 5 redone
    assert browser.execute_script("return document.getElementById('run-health')") is None  # finished: no panel

    browser.get(f"{srv.url}/")
    names = wait_for(browser, "(() => { const c = Array.from(document.querySelectorAll("
                              "'#fleet-table td[data-dash-column=name]')).map(x => x.innerText);"
                              " return c.length >= 4 && c.every(x => x) ? c : null; })()", what="fleet rows")
    # the hung run, then the two runs that failed today (the crash, the job's first attempt), then the rest
    assert names[0] == "stuck-run" and set(names[1:3]) == {"crashed-run", "restarted"}, names
    status = browser.execute_script("return Array.from(document.querySelectorAll("
                                    "'#fleet-table td[data-dash-column=status]')).map(x => x.innerText)")
    assert status[:3] == ["hung", "failed", "failed"] and "running" in status[3:]
    why = browser.execute_script("return document.querySelector('#fleet-table td[data-dash-column=health]').innerText")
    assert "never arrived" in why
    assert "%" in _text(browser, "#fleet-goodput")  # fleet goodput of the last 7 days
    assert severe_logs(browser) == []
