"""`fleetscope serve` / `token create` / `db upgrade` / `demo` as a user runs them: real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_healthy

FS = [sys.executable, "-m", "fleetscope.cli"]


def _postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "pg" / "postmaster.pid").read_text().split("\n", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive for our purpose
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_serve_without_url_runs_embedded_postgres_and_stops_it(tmp_data_dir: Path, sig: int) -> None:
    port = free_port()
    env = {**os.environ, "FLEETSCOPE_DATABASE_URL": ""}
    proc = subprocess.Popen([*FS, "serve", "--port", str(port), "--data-dir", str(tmp_data_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        pm = _postmaster_pid(tmp_data_dir)
        assert _alive(pm)
        # a token made while serve runs attaches to the same postmaster and leaves it running
        out = subprocess.run([*FS, "token", "create", "--name", "ci", "--data-dir", str(tmp_data_dir)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        token = out.stdout.strip().splitlines()[-1]
        assert token.startswith("fs_") and _alive(pm)
        r = httpx.post(f"{url}/api/v1/runs", json={"name": "cli-run", "world_size": 2},
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
        # the token never appears in the server's logs
        proc.send_signal(sig)
        rc = proc.wait(60)
        log = proc.stdout.read() if proc.stdout else ""
        assert rc == 0, log
        assert token not in log
        deadline = time.monotonic() + 20
        while _alive(pm) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pm), "orphan postgres left running"
    finally:
        if proc.poll() is None:
            proc.kill()
    # data survives a restart
    proc = subprocess.Popen([*FS, "serve", "--port", str(port), "--data-dir", str(tmp_data_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        runs = httpx.get(f"http://127.0.0.1:{port}/api/v1/runs").json()["runs"]
        assert [r["name"] for r in runs] == ["cli-run"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_db_upgrade_and_token_create_with_a_database_url(empty_db_url: str) -> None:
    db_url = empty_db_url  # `db upgrade` migrates a new, empty database from nothing
    out = subprocess.run([*FS, "db", "upgrade", "--database-url", db_url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*FS, "token", "create", "--name", "x", "--database-url", db_url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("fs_")


def test_demo_loads_a_fleet_through_the_api_and_reloading_never_duplicates(tmp_data_dir: Path) -> None:
    port = free_port()
    cmd = [*FS, "demo", "--port", str(port), "--data-dir", str(tmp_data_dir), "--no-job", "--small", "--exit-when-loaded"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"http://127.0.0.1:{port}/" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    proc = subprocess.Popen([*FS, "serve", "--port", str(port), "--data-dir", str(tmp_data_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        runs = httpx.get(f"http://127.0.0.1:{port}/api/v1/runs", params={"limit": 1000}).json()["runs"]
        from fleetscope.demo import fleet_history

        specs = {s.name: s for s in fleet_history(small=True)}
        assert {r["name"] for r in runs} == set(specs)
        for r in runs:
            s = specs[r["name"]]
            assert r["rank_steps"] == s.world_size * s.steps, r["name"]
        fams = {r["model_family"] for r in runs}
        assert len(fams) >= 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_demo_streams_a_live_four_rank_job_and_stops_everything_on_ctrl_c(tmp_data_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([*FS, "demo", "--port", str(port), "--data-dir", str(tmp_data_dir), "--small"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=120)
        deadline = time.monotonic() + 240
        live: dict = {}
        while time.monotonic() < deadline:
            runs = httpx.get(f"{url}/api/v1/runs", params={"limit": 5}).json()["runs"]
            live = next((r for r in runs if r["name"].startswith("demo-live-")), {})
            if live.get("rank_steps", 0) >= 8:
                break
            time.sleep(1)
        assert live.get("world_size") == 4 and live["rank_steps"] >= 8, live
        pm = _postmaster_pid(tmp_data_dir)
        children = subprocess.run(["pgrep", "-f", "fleetscope.demo_train"], capture_output=True, text=True).stdout.split()
        assert len(children) >= 4  # torchrun's 4 ranks
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", "fleetscope.demo_train"], capture_output=True, text=True).stdout.split()
        assert not left, "demo left training processes running"
        assert not _alive(pm), "demo left postgres running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
