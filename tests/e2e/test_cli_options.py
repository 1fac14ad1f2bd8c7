"""CLI options as a user types them (real subprocesses): a bad value is one clear error naming the option
and its range (exit 2), never a traceback; `token create --team` makes tokens that share their runs."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

FS = [sys.executable, "-m", "fleetscope.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FS, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, option, allowed", [
    (["--blocks-days", "-1"], "--blocks-days", "0 to 36,500"),
    (["--rollups-days", "nan"], "--rollups-days", "0 to 36,500"),
    (["--runs-days", "1e9"], "--runs-days", "0 to 36,500"),
    (["--runs-days", "inf"], "--runs-days", "0 to 36,500"),
    (["--blocks-days", "soon"], "--blocks-days", "valid number"),
    (["--blocks-days", "1", "--limit", "0"], "--limit", "1 to 1,000,000"),
    (["--blocks-days", "1", "--limit", "-5"], "--limit", "1 to 1,000,000"),
])
def test_retention_refuses_a_bad_option_naming_it_and_its_range(args: list[str], option: str, allowed: str) -> None:
    out = _cli("retention", *args)
    err = " ".join(out.stderr.replace("│", " ").split())  # typer boxes and wraps its error
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and option in err and allowed in err, err


def test_retention_refuses_a_bad_setting_from_the_environment_naming_it() -> None:
    out = _cli("retention", env={"FLEETSCOPE_RETENTION_BLOCKS_DAYS": "-1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--blocks-days (FLEETSCOPE_RETENTION_BLOCKS_DAYS)" in out.stderr and "0 to 36,500 days" in out.stderr
    out = _cli("retention", env={"FLEETSCOPE_RETENTION_OVERRIDES": '{"llm": {"runs_days": -2}}'})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "retention_overrides['llm'].runs_days" in out.stderr


def test_serve_refuses_a_forwarded_allow_ips_that_is_not_an_address() -> None:
    out = _cli("serve", "--forwarded-allow-ips", "proxy.example.com", "--port", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--forwarded-allow-ips" in out.stderr and "not an IP address or network" in out.stderr


def test_token_create_with_a_team_lists_it_and_its_tokens_share_runs(live_server: Any) -> None:
    url = live_server.db_url
    secrets = []
    for name in ("vision-ci-a", "vision-ci-b"):
        out = _cli("token", "create", "--name", name, "--team", "vision", "--database-url", url)
        assert out.returncode == 0, out.stderr
        assert "of team 'vision'" in out.stderr
        secrets.append(out.stdout.strip().splitlines()[-1])
    listed = _cli("token", "list", "--database-url", url)
    assert listed.returncode == 0 and "TEAM" in listed.stdout
    rows = [line.split() for line in listed.stdout.splitlines() if line.startswith("vision-ci-")]
    assert len(rows) == 2 and all(r[1] == "ingest" and r[2] == "vision" for r in rows), listed.stdout
    for bad in ("", "x" * 65, "tab\there"):
        out = _cli("token", "create", "--name", "bad-team", "--team", bad, "--database-url", url)
        assert out.returncode == 2 and "team must be 1..64 printable characters" in out.stderr, out.stderr

    # the two tokens of the team write one run; a token of no team has its own namespace
    reg = {"name": "team-run", "world_size": 1}
    ids = [httpx.post(f"{live_server.url}/api/v1/runs", json=reg, headers={"Authorization": f"Bearer {s}"},
                      timeout=30).json()["id"] for s in secrets]
    assert ids[0] == ids[1]
    r = httpx.post(f"{live_server.url}/api/v1/runs/{ids[0]}/finish", json={"status": "finished"},
                   headers={"Authorization": f"Bearer {secrets[1]}"}, timeout=30)
    assert r.status_code == 200, r.text
