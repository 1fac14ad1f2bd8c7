"""Several `fleetscope serve` on one --data-dir share its embedded Postgres: stopping one never stops the
others' database; the last one to leave stops the postmaster, whoever started it. A process that died
without leaving (kill -9) does not keep the postmaster alive."""

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
ENV = {**os.environ, "FLEETSCOPE_DATABASE_URL": ""}


def _postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "pg" / "postmaster.pid").read_text().split("\n", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def _serve(data_dir: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([*FS, "serve", "--port", str(port), "--data-dir", str(data_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    rc = proc.wait(60)
    return rc, proc.stdout.read() if proc.stdout else ""


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _cleanup(procs: list[subprocess.Popen[str]], data_dir: Path) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
    try:  # never leave a postmaster behind, whatever failed
        pm = _postmaster_pid(data_dir)
    except (OSError, ValueError):
        return
    if _alive(pm):
        os.kill(pm, signal.SIGQUIT)
        _gone(pm, 10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stopping_one_of_two_servers_leaves_the_others_database_running(tmp_data_dir: Path, sig: int) -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        first_port, second_port = free_port(), free_port()
        first = _serve(tmp_data_dir, first_port)
        procs.append(first)
        wait_healthy(f"http://127.0.0.1:{first_port}", first)
        pm = _postmaster_pid(tmp_data_dir)
        second = _serve(tmp_data_dir, second_port)  # attaches to the postmaster the first one started
        procs.append(second)
        second_url = f"http://127.0.0.1:{second_port}"
        wait_healthy(second_url, second)
        assert _postmaster_pid(tmp_data_dir) == pm
        assert httpx.get(f"{second_url}/api/v1/runs", timeout=30).status_code == 200

        # the first one (which started the postmaster) leaves: the second keeps its database
        rc, log = _stop(first, sig)
        assert rc == 0, log
        assert "other fleetscope process" in log, log
        assert _alive(pm), "stopping the first server stopped the postmaster the second one uses"
        for _ in range(3):
            r = httpx.get(f"{second_url}/api/v1/runs", timeout=30)
            assert r.status_code == 200, r.text[:300]
        assert httpx.get(f"{second_url}/healthz", timeout=30).status_code == 200

        # the last one leaving stops the postmaster, though it did not start it
        rc, log = _stop(second, sig)
        assert rc == 0, log
        assert _gone(pm), "the last server left the postmaster running"
        assert not list((tmp_data_dir / ".pg-users").iterdir()), "registrations left behind"
    finally:
        _cleanup(procs, tmp_data_dir)


def test_a_server_killed_without_leaving_does_not_keep_the_postmaster_alive(tmp_data_dir: Path) -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        first_port, second_port = free_port(), free_port()
        first = _serve(tmp_data_dir, first_port)
        procs.append(first)
        wait_healthy(f"http://127.0.0.1:{first_port}", first)
        pm = _postmaster_pid(tmp_data_dir)
        second = _serve(tmp_data_dir, second_port)
        procs.append(second)
        wait_healthy(f"http://127.0.0.1:{second_port}", second)
        # the first dies without cleaning up: its registration stays on disk, but nobody holds it
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        assert len(list((tmp_data_dir / ".pg-users").iterdir())) == 2
        assert _alive(pm)
        rc, log = _stop(second)
        assert rc == 0, log
        assert _gone(pm), "a dead server's stale registration kept the postmaster running"
        assert not list((tmp_data_dir / ".pg-users").iterdir())
    finally:
        _cleanup(procs, tmp_data_dir)


def test_two_handles_in_one_process_and_a_restart_after_the_last_one_left(tmp_data_dir: Path) -> None:
    """The registration is per handle, not per process: two ``EmbeddedPostgres`` on one data dir in one
    process keep the postmaster until both left; a handle started after that starts a fresh one."""
    import psycopg
    from fleetscope.server.db import EmbeddedPostgres

    a, b = EmbeddedPostgres(tmp_data_dir), EmbeddedPostgres(tmp_data_dir)
    try:
        url = a.start()
        pm = _postmaster_pid(tmp_data_dir)
        assert b.start() == url and not b.owner and a.owner
        assert a.stop() is False  # b still uses it
        with psycopg.connect(url) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        assert b.stop() is True and _gone(pm)
        c2 = EmbeddedPostgres(tmp_data_dir)
        try:
            url2 = c2.start()
            assert _postmaster_pid(tmp_data_dir) != pm and c2.owner
            with psycopg.connect(url2) as c:
                assert c.execute("SELECT 1").fetchone() == (1,)
        finally:
            c2.stop()
    finally:
        a.stop()
        b.stop()
        _cleanup([], tmp_data_dir)
