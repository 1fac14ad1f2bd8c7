"""The provisioned Grafana dashboard (docker/grafana) and the Prometheus rules (docs/prometheus-rules.yml):
every metric their queries use exists in a live ``/metrics`` scrape after some ingest; every panel reads
the ``datasource`` variable, draws its figures in their unit and run states by name; the rules'
structure is checked here, and ``promtool check rules`` runs on the rules — and on the dashboard's
queries, wrapped as recording rules — with Debian's promtool (installed with apt-get when missing:
tests/prometheus/prom_util.py). tests/prometheus runs the queries and the rules in a real Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "fleetscope.json"
RULES = ROOT / "docs" / "prometheus-rules.yml"
#: series Prometheus makes itself (not in /metrics)
SYNTHETIC = {"up"}
_FUNCS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "deriv", "delta", "histogram_quantile",
          "by", "without", "on", "ignoring", "offset", "and", "or", "unless", "bool", "label_values", "humanize",
          "humanizeDuration", "topk", "bottomk", "group_left", "group_right", "abs", "clamp_min", "clamp_max",
          "max_over_time", "min_over_time", "last_over_time"}
#: the data source every panel, target and query variable reads: the dashboard's variable
DS = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    d = dashboard()
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", ())]
    # a variable's query: label_values(<series selector>, <label>) reads the selector's metric
    out += [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["definition"])
            for v in d["templating"]["list"] if v.get("type") == "query"]
    return out


def rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def rule_exprs() -> list[str]:
    return [r["expr"] for g in rules()["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: identifiers outside label matchers and strings that are
    not PromQL keywords or functions."""
    expr = re.sub(r'"[^"]*"', '""', expr)          # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)         # label matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)        # ranges
    expr = re.sub(r"\b\d+(ms|[smhdwy])\b", " ", expr)  # durations (offset 15m)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)  # grouping labels
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {n for n in names if n not in _FUNCS and not n.startswith("__") and not re.fullmatch(r"e\d*|\d.*", n)}


def test_the_dashboard_is_provisioned_and_built_on_the_per_run_gauges() -> None:
    d = dashboard()
    assert d["uid"] == "fleetscope" and d["panels"]
    # no hard-coded data source: a `datasource` variable (Prometheus, the provisioned one by default)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    dsv = variables["datasource"]
    assert dsv["type"] == "datasource" and dsv["query"] == "prometheus" and dsv["current"]["value"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DS, v["name"]
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"] == DS, p["title"]
            for t in p["targets"]:
                assert t["datasource"] == DS, (p["title"], t["refId"])
    assert '"uid": "prometheus"' not in json.dumps(d)  # anywhere (a panel's override, a variable ...)
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    for name in ("fleetscope_run_step_seconds", "fleetscope_run_steps", "fleetscope_run_mfu",
                 "fleetscope_run_tokens_per_second", "fleetscope_run_last_step_timestamp_seconds",
                 "fleetscope_run_seconds_since_last_step", "fleetscope_run_state", "fleetscope_run_alerts_firing",
                 "fleetscope_cluster_runs", "fleetscope_db_up"):
        assert name in used, name
    # cluster-wide series are never summed across instances
    for e in dashboard_exprs():
        assert not re.search(r"\bsum\b[^(]*\(\s*fleetscope_(cluster|run)_", e), e
    prov = yaml.safe_load((ROOT / "docker" / "grafana" / "provisioning" / "dashboards" / "fleetscope.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    ds = yaml.safe_load((ROOT / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus" and ds["datasources"][0]["type"] == "prometheus"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = compose["grafana"]["volumes"]
    assert f"./docker/grafana/dashboards:{path}:ro" in mounts
    assert "./docker/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    assert "./docs/prometheus-rules.yml:/etc/prometheus/rules/fleetscope.yml:ro" in compose["prometheus"]["volumes"]
    prom = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/rules/fleetscope.yml"]


def _unit_for(expr: str) -> set[str]:
    """The units a query's figure may be drawn in, from what it reads."""
    if re.search(r"\brate\(process_cpu_seconds_total\b", expr):
        return {"percentunit"}  # CPU seconds per second of wall time: 1 = one core busy
    if "histogram_quantile" in expr and "_seconds_bucket" in expr:
        return {"s"}
    if "_timestamp_seconds" in expr and "* 1000" in expr:
        return {"dateTimeAsIso", "dateTimeFromNow"}
    if re.search(r"_bytes\b", expr):
        return {"bytes", "decbytes"}
    if "fleetscope_run_mfu" in expr:
        return {"percentunit"}
    if "fleetscope_run_state_code" in expr or "fleetscope_db_up" in expr:
        return {"", "none"}  # drawn through value mappings
    if "rate(" not in expr and "_seconds" in expr:
        return {"s"}
    return {"short", "none"}  # counts, and counts per second


def test_every_panel_draws_its_figures_in_their_unit_and_run_states_by_name() -> None:
    from fleetscope.server.prom import STATE_CODES

    for p in dashboard()["panels"]:
        if p["type"] == "row":
            continue
        fc = p.get("fieldConfig", {})
        default = fc.get("defaults", {}).get("unit", "")
        for t in p["targets"]:
            unit = default
            for o in fc.get("overrides", ()):
                if o["matcher"] == {"id": "byFrameRefID", "options": t["refId"]}:
                    unit = next((x["value"] for x in o["properties"] if x["id"] == "unit"), unit)
            assert unit in _unit_for(t["expr"]), (p["title"], t["expr"], unit)
        if any("fleetscope_run_state_code" in t["expr"] for t in p["targets"]):
            (m,) = fc["defaults"]["mappings"]
            names = {int(k): v["text"] for k, v in m["options"].items()}
            assert m["type"] == "value" and names == {v: k for k, v in STATE_CODES.items()}, names
            assert p["type"] == "state-timeline", p["type"]


def test_the_rules_are_well_formed() -> None:
    """What promtool checks first, checked here too (so the structure is covered without promtool)."""
    doc = rules()
    assert set(doc) == {"groups"} and doc["groups"]
    names = set()
    for g in doc["groups"]:
        assert set(g) <= {"name", "rules", "interval"} and g["name"] not in names
        names.add(g["name"])
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, r
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r["alert"])
            assert isinstance(r["expr"], str) and r["expr"].count("(") == r["expr"].count(")"), r["alert"]
            assert "for" not in r or re.fullmatch(r"\d+[smhd]", r["for"]), r["alert"]
            assert "keep_firing_for" not in r or re.fullmatch(r"\d+[smhd]", r["keep_firing_for"]), r["alert"]
            assert r["labels"]["severity"] in ("critical", "warning", "info") and r["annotations"]["summary"]
    alerts = {r["alert"] for g in doc["groups"] for r in g["rules"]}
    for want in ("FleetscopeRunStalled", "FleetscopeRunHung", "FleetscopeRunFailed", "FleetscopeDatabaseDown",
                 "FleetscopeIngestRejections"):
        assert want in alerts, want


def test_every_metric_of_the_dashboard_and_the_rules_is_in_a_live_scrape(live_server: Any) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

    spec = RunSpec(name="graf", family="gfam", world_size=2, steps=4)
    with live_server.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    live_server.compact()
    httpx.post(f"{live_server.url}/api/v1/ingest", json={"v": 1, "run_id": rid})  # a rejection
    text = httpx.get(f"{live_server.url}/metrics").text
    fams = list(text_string_to_metric_families(text))
    exported = {f.name for f in fams} | {s.name for f in fams for s in f.samples}
    used = set().union(*(metric_names(e) for e in dashboard_exprs() + rule_exprs()))
    assert len(used) >= 20
    missing = sorted(n for n in used - SYNTHETIC if n not in exported)
    assert not missing, missing
    # and the per-run series the dashboard reads carry samples for the running run
    run_samples = {s.name for f in fams for s in f.samples if s.labels.get("run") == "graf"}
    assert {"fleetscope_run_steps", "fleetscope_run_step_seconds", "fleetscope_run_state"} <= run_samples


def _promtool() -> str:
    """Debian's promtool, installed with apt-get when missing (prometheus.prom_util.ensure_tools); the
    test fails with the command to run when it cannot be."""
    from prometheus.prom_util import ensure_tools

    try:
        return ensure_tools()["promtool"]
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def test_the_rules_pass_promtool_check_rules() -> None:
    exe = _promtool()
    out = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in rules()["groups"])
    assert f"SUCCESS: {n} rules found" in out.stdout


def test_the_dashboard_queries_parse_as_promql() -> None:
    """Each panel query, with Grafana's variables filled in, as a recording rule: promtool parses it."""
    exe = _promtool()
    fill = {"$__rate_interval": "5m", "$__interval": "1m", "$family": ".*", "$run": ".*"}
    recs = []
    for i, e in enumerate(t["expr"] for p in dashboard()["panels"] for t in p.get("targets", ())):
        for k, v in fill.items():
            e = e.replace(k, v)
        assert "$" not in e, e
        recs.append({"record": f"fleetscope:dashboard_query_{i}", "expr": e})
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "dashboard.yml"
        f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recs}]}))
        out = subprocess.run([exe, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
