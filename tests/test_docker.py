"""No Docker daemon here: check what can be checked — the compose file parses, and its commands and
environment match the CLI (the same options `fleetscope serve` accepts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_parses_and_wires_postgres_server_prometheus_and_alertmanager() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = doc["services"]
    assert svc["postgres"]["image"].startswith("postgres:16")
    fs = svc["fleetscope"]
    assert fs["build"]["dockerfile"] == "docker/Dockerfile" and (ROOT / fs["build"]["dockerfile"]).is_file()
    cmd = fs["command"]
    assert cmd[0] == "serve" and "--database-url" in cmd
    url = cmd[cmd.index("--database-url") + 1]
    assert re.match(r"postgresql://fleetscope:.*@postgres:5432/fleetscope", url)
    assert fs["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert all(p.startswith("127.0.0.1:") for p in fs["ports"])  # loopback unless told otherwise
    from fleetscope.server.settings import Settings

    known = {f"FLEETSCOPE_{name.upper()}" for name in Settings.model_fields}
    assert set(fs["environment"]) <= known, set(fs["environment"]) - known
    # Prometheus scrapes the server by its service name: the Host check must accept it
    hosts = fs["environment"]["FLEETSCOPE_ALLOWED_HOSTS"].split(",")
    assert "fleetscope" in hosts
    prom = svc["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    prom_cfg = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    scrape = prom_cfg["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == ["fleetscope:8000"]
    # the rules are loaded, and what fires goes to the Alertmanager service (tests/prometheus checks both
    # configs with promtool / amtool and runs them for real)
    assert "./docs/prometheus-rules.yml:/etc/prometheus/rules/fleetscope.yml:ro" in prom["volumes"]
    assert prom_cfg["rule_files"] == ["/etc/prometheus/rules/fleetscope.yml"]
    (am_target,) = prom_cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    am = svc["alertmanager"]
    assert am_target == "alertmanager:9093" and "alertmanager" in prom["depends_on"]
    assert am["profiles"] == ["monitoring"] and am["image"].startswith("prom/alertmanager:")
    mount = "./docker/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro"
    assert mount in am["volumes"] and "--config.file=/etc/alertmanager/alertmanager.yml" in am["command"]
    assert (ROOT / "docker" / "alertmanager.yml").is_file()
    assert all(p.startswith("127.0.0.1:") for p in am["ports"] + prom["ports"])


def test_compose_and_dockerfile_commands_are_accepted_by_the_cli() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    cmd = [c.replace("${FLEETSCOPE_DB_PASSWORD:-fleetscope}", "pw") for c in doc["services"]["fleetscope"]["command"]]
    # --help after the options: typer parses every option given (an unknown one fails) and exits 0
    out = subprocess.run([sys.executable, "-m", "fleetscope.cli", *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    entry = re.search(r'CMD \[(.*)\]', dockerfile).group(1)  # type: ignore[union-attr]
    args = [a.strip().strip('"') for a in entry.split(",")]
    out = subprocess.run([sys.executable, "-m", "fleetscope.cli", *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for folder in ("fleetscope", "agent", "server", "dashboard", "migrations"):
        assert f"COPY {folder} ./{folder}" in dockerfile


def test_scale_out_compose_runs_two_instances_behind_a_proxy_on_one_postgres() -> None:
    doc = yaml.safe_load((ROOT / "docker" / "compose.scale.yml").read_text())
    svc = doc["services"]
    instances = [k for k in svc if k.startswith("fleetscope-")]
    assert len(instances) == 2
    from fleetscope.server.settings import Settings

    known = {f"FLEETSCOPE_{name.upper()}" for name in Settings.model_fields}
    for k in instances:
        s = svc[k]
        assert s["command"][0] == "serve" and "--database-url" in s["command"]
        url = s["command"][s["command"].index("--database-url") + 1]
        assert re.match(r"postgresql://fleetscope:.*@postgres:5432/fleetscope", url)  # one Postgres for both
        assert (ROOT / "docker" / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
        assert set(s["environment"]) <= known, set(s["environment"]) - known
        assert "ports" not in s  # only the proxy is published
        # the proxy forwards with Host: proxy, which each instance must accept
        assert "proxy" in s["environment"]["FLEETSCOPE_ALLOWED_HOSTS"].split(",")
    proxy = svc["proxy"]
    assert all(p.startswith("127.0.0.1:") for p in proxy["ports"])
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    for k in instances:
        assert f"server {k}:8000" in conf
    assert "proxy_set_header Host proxy;" in conf
