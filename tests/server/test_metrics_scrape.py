"""/metrics parsed as Prometheus parses it (prometheus_client.parser): build info, the process
collectors, a zero for every run status, cluster-wide figures under their own names, rejections in
batches and records by distinct reason, bounded per-run gauges (labels run and family, never a rank),
the state and alert gauges of ended runs while one of their alerts fires (a failed run pages), and a
scrape during a database outage that still answers with every per-instance family."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import start_server
from dash_util import add_alert
from fleetscope.server.db import EmbeddedPostgres
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

STATES = ("running", "stalled", "hung", "failed", "finished", "aborted")


def scrape(url: str) -> dict[str, Any]:
    """{family name: family} of one scrape (the parser rejects malformed exposition)."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(fams: dict[str, Any], name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for f in fams.values():
        for s in f.samples:
            if s.name == name:
                out.append((dict(s.labels), s.value))
    return out


def value(fams: dict[str, Any], name: str, **labels: str) -> float:
    got = [v for lv, v in samples(fams, name) if all(lv.get(k) == x for k, x in labels.items())]
    assert len(got) == 1, (name, labels, samples(fams, name))
    return got[0]


def load(srv: Any, spec: RunSpec) -> int:
    with srv.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    srv.compact()
    return int(rid)


def test_a_scrape_parses_and_has_build_info_process_zeros_and_cluster_names(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="m-a", family="fam-a", world_size=4, steps=5))
    rid_b = load(live_server, RunSpec(name="m-b", family="fam-b", world_size=2, steps=3))
    with live_server.client() as c:
        c.finish_run(rid)
    for kind, metric in (("straggler", "straggler_slowdown"), ("slow_node", "node_network_slowdown"),
                         ("straggler", "other")):
        add_alert(live_server.state.engine, kind=kind, metric=metric, run_id=rid_b)
    add_alert(live_server.state.engine, kind="straggler", metric="x", run_id=rid_b, state="resolved")
    fams = scrape(live_server.url)
    from fleetscope import __version__

    (lv, v), = samples(fams, "fleetscope_build_info")
    assert lv["version"] == __version__ and v == 1.0
    assert value(fams, "process_resident_memory_bytes") > 0 and value(fams, "process_cpu_seconds_total") >= 0
    assert samples(fams, "python_info")
    assert value(fams, "fleetscope_db_up") == 1.0
    # a zero for every status, the counts where runs are
    by_status = {lv["status"]: v for lv, v in samples(fams, "fleetscope_cluster_runs")}
    assert set(STATES) <= set(by_status), by_status
    assert by_status["finished"] == 1.0 and by_status["running"] == 1.0
    assert all(by_status[s] == 0.0 for s in ("stalled", "hung", "failed", "aborted"))
    assert value(fams, "fleetscope_cluster_active_ranks") == 2.0
    # cluster counts are not exported under the per-instance names any more
    assert "fleetscope_runs" not in fams and "fleetscope_active_ranks" not in fams
    # per-run gauges: the running run only, labelled by name and family
    assert [lv for lv, _ in samples(fams, "fleetscope_run_steps")] == [{"run": "m-b", "family": "fam-b"}]
    assert value(fams, "fleetscope_run_steps", run="m-b") == 3.0
    assert value(fams, "fleetscope_run_step_seconds", run="m-b") > 0
    assert 0 < value(fams, "fleetscope_run_mfu", run="m-b") < 1
    assert value(fams, "fleetscope_run_tokens_per_second", run="m-b") > 0
    assert value(fams, "fleetscope_run_state", run="m-b", state="running") == 1.0
    assert value(fams, "fleetscope_run_state_code", run="m-b") == 0.0
    # alert state: firing alerts of the run by kind (a resolved one does not count)
    assert value(fams, "fleetscope_run_alerts_firing", run="m-b", kind="straggler") == 2.0
    assert value(fams, "fleetscope_run_alerts_firing", run="m-b", kind="slow_node") == 1.0
    last = value(fams, "fleetscope_run_last_step_timestamp_seconds", run="m-b")
    since = value(fams, "fleetscope_run_seconds_since_last_step", run="m-b")
    assert abs((time.time() - last) - since) < 60
    for name in [n for n in fams if n.startswith("fleetscope_run_")]:
        for lv, _ in samples(fams, name) + samples(fams, name + "_total"):
            assert "rank" not in lv and set(lv) <= {"run", "family", "state", "kind"}, (name, lv)


def test_rejections_are_counted_in_batches_and_records_with_distinct_reasons(live_server: Any) -> None:
    spec = RunSpec(name="rej", family="f", world_size=2, steps=2)
    rid = load(live_server, spec)
    h = {"Authorization": f"Bearer {live_server.token}"}
    before = scrape(live_server.url)
    for reason in ("auth", "auth_limited", "invalid", "backlog", "queue_full", "db_unavailable"):
        assert value(before, "fleetscope_ingest_rejections_total", reason=reason) == 0.0
    # three bad records in one batch: 422, one batch and three records refused as "invalid"
    bad = {"v": 1, "run_id": rid, "rank_steps": [{"rank": 0, "step": 9, "step_s": "slow"}] * 3}
    r = httpx.post(f"{live_server.url}/api/v1/ingest", json=bad, headers=h)
    assert r.status_code == 422, r.text
    r = httpx.post(f"{live_server.url}/api/v1/ingest", json={"v": 1, "run_id": rid}, headers={"Authorization": "Bearer fs_no"})
    assert r.status_code == 401
    fams = scrape(live_server.url)
    assert value(fams, "fleetscope_ingest_rejections_total", reason="invalid") == 1.0
    assert value(fams, "fleetscope_ingest_rejected_records_total", reason="invalid") == 3.0
    assert value(fams, "fleetscope_ingest_rejections_total", reason="auth") == 1.0
    assert value(fams, "fleetscope_ingest_rejections_total", reason="auth_limited") == 0.0
    assert "overloaded" not in {lv["reason"] for lv, _ in samples(fams, "fleetscope_ingest_rejections_total")}


def test_per_run_gauges_are_capped_most_recently_active_first(db_url: str) -> None:
    srv = start_server(db_url, metrics_max_runs=2)
    try:
        for i in range(4):
            load(srv, RunSpec(name=f"cap-{i}", family="f", world_size=1, steps=2, seed=i))
            time.sleep(0.05)  # distinct last_seen_at
        fams = scrape(srv.url)
        runs = sorted(lv["run"] for lv, _ in samples(fams, "fleetscope_run_steps"))
        assert runs == ["cap-2", "cap-3"], runs
        assert value(fams, "fleetscope_cluster_runs", status="running") == 4.0
    finally:
        srv.stop()


def test_ended_runs_keep_state_and_alert_gauges_while_an_alert_fires_bounded_paging_first(db_url: str) -> None:
    """A failed run is not live, but while its failure alert fires the rules must see it: its state and
    alert gauges stay (no step figures, no stall gauge), for at most --metrics-max-runs ended runs —
    those with a hang / node-lost / failure alert first — and go when the alert stops firing."""
    srv = start_server(db_url, metrics_max_runs=2)
    eng = srv.state.engine
    try:
        from fleetscope.server.auth import create_token

        other = create_token(eng, "other-owner", scope="admin")
        ids = {}
        for name in ("quiet", "failed-old", "failed-new", "strag", "live", "again-0", "again"):
            spec = RunSpec(name=name if not name.startswith("again") else "again", family="f", world_size=1, steps=2)
            if name == "again-0":  # the same name and family, another owner's run
                with srv.client(other) as c:
                    ids[name] = rid = int(c.register_run(spec.run_info()))
                    for _, rows in rank_step_rows(spec):
                        c.ingest_rows(rid, rows)
                    c.finish_run(rid, "failed")
            else:
                ids[name] = load(srv, spec)
            time.sleep(0.05)  # distinct last_seen_at
        assert len(set(ids.values())) == len(ids)
        with srv.client() as c:
            c.finish_run(ids["quiet"])
            c.finish_run(ids["failed-old"], "failed")
            c.finish_run(ids["failed-new"], "failed")
            c.finish_run(ids["strag"])
        for name, kind in (("failed-old", "failure"), ("failed-new", "failure"), ("strag", "straggler"),
                           ("again-0", "failure")):
            add_alert(eng, kind=kind, metric="x", run_id=ids[name])
        fams = scrape(srv.url)
        runs = {lv["run"]: lv["state"] for lv, _ in samples(fams, "fleetscope_run_state")}
        # live: "live" and "again"; ended with a firing alert, paging kinds first: two of the three
        # failures (the two most recently active: "again-0" shares the live run's labels)
        assert runs == {"live": "running", "again": "running", "failed-new": "failed"}, runs
        assert value(fams, "fleetscope_run_state_code", run="failed-new") == 3.0
        assert value(fams, "fleetscope_run_alerts_firing", run="failed-new", kind="failure") == 1.0
        # the failed attempt's failure is counted under the name it shares with the live run
        assert value(fams, "fleetscope_run_alerts_firing", run="again", kind="failure") == 1.0
        assert value(fams, "fleetscope_run_state_code", run="again") == 0.0
        for name in ("fleetscope_run_steps", "fleetscope_run_seconds_since_last_step", "fleetscope_run_step_seconds"):
            assert {lv["run"] for lv, _ in samples(fams, name)} == {"live", "again"}, name
        assert not [lv for lv, _ in samples(fams, "fleetscope_run_state") if lv["run"] in ("quiet", "strag")]
        # acknowledged: not firing any more, so the run leaves; the next one in line comes in
        with eng.begin() as c:
            c.execute(text("UPDATE alerts SET state = 'acknowledged' WHERE run_id = :r"), {"r": ids["failed-new"]})
        fams = scrape(srv.url)
        runs = {lv["run"]: lv["state"] for lv, _ in samples(fams, "fleetscope_run_state")}
        assert runs == {"live": "running", "again": "running", "failed-old": "failed"}, runs
    finally:
        srv.stop()


def test_cluster_metrics_can_be_left_to_another_instance(db_url: str) -> None:
    srv = start_server(db_url, cluster_metrics=False)
    try:
        load(srv, RunSpec(name="nc", family="f", world_size=1, steps=2))
        fams = scrape(srv.url)
        assert not samples(fams, "fleetscope_cluster_runs") and not samples(fams, "fleetscope_run_steps")
        assert value(fams, "fleetscope_ingest_records_total", kind="rank_steps") == 2.0
        assert value(fams, "fleetscope_db_up") == 1.0
    finally:
        srv.stop()


def test_a_scrape_during_a_database_outage_keeps_the_target_up() -> None:
    d = Path(tempfile.mkdtemp(prefix="fsm-", dir="/tmp"))
    pg = EmbeddedPostgres(d)
    url = pg.start()
    srv = None
    try:
        srv = start_server(url)
        load(srv, RunSpec(name="out", family="f", world_size=2, steps=3))
        up = scrape(srv.url)
        assert value(up, "fleetscope_db_up") == 1.0 and value(up, "fleetscope_run_steps", run="out") == 3.0
        pg.stop()
        down = scrape(srv.url)  # 200, parseable
        assert value(down, "fleetscope_db_up") == 0.0
        assert value(down, "fleetscope_metrics_collection_errors_total", group="database") >= 1.0
        # per-instance families survive; the cluster-wide ones read from the database are left out
        assert value(down, "fleetscope_ingest_records_total", kind="rank_steps") == 6.0
        for name in ("fleetscope_ingest_queue_depth", "fleetscope_db_pool_checked_out", "fleetscope_build_info",
                     "process_resident_memory_bytes", "fleetscope_compaction_backlog_rows"):
            assert samples(down, name), name
        assert not samples(down, "fleetscope_cluster_runs") and not samples(down, "fleetscope_run_steps")
        again = scrape(srv.url)
        assert value(again, "fleetscope_metrics_collection_errors_total", group="database") >= 2.0
        # an ingest refused for the outage is counted under its own reason
        r = httpx.post(f"{srv.url}/api/v1/runs", json={"name": "x"}, headers={"Authorization": f"Bearer {srv.token}"})
        assert r.status_code == 503
        assert value(scrape(srv.url), "fleetscope_ingest_rejections_total", reason="db_unavailable") == 1.0
    finally:
        if srv is not None:
            srv.stop()
        pg.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_compaction_in_worker_processes_is_counted(db_url: str) -> None:
    """--compaction-workers: the passes happen in other processes; their counts reach this /metrics."""
    srv = start_server(db_url, compaction_workers=1)
    try:
        spec = RunSpec(name="workers", family="f", world_size=4, steps=5)
        with srv.client() as c:
            rid = c.register_run(spec.run_info())
            for step, rows in rank_step_rows(spec):
                c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
        # no srv.compact(): only the worker process compacts
        deadline = time.monotonic() + 60
        fams = scrape(srv.url)
        while time.monotonic() < deadline and value(fams, "fleetscope_compacted_records_total",
                                                      kind="rank_step") < 20:
            time.sleep(0.3)
            fams = scrape(srv.url)
        assert value(fams, "fleetscope_compacted_records_total", kind="rank_step") == 20.0
        assert value(fams, "fleetscope_compacted_records_total", kind="collective") > 0
        assert value(fams, "fleetscope_compaction_seconds_count") >= 1
        runs = httpx.get(f"{srv.url}/api/v1/runs").json()["runs"]
        assert runs[0]["id"] == rid and runs[0]["steps"] == 5
    finally:
        srv.stop()
