"""Real `torchrun` CPU jobs (gloo, DDP, variable-length packed batches; 4 ranks, 2 where only what
arrives is counted) instrumented by `instrument()`, streaming into a real `fleetscope serve` over
HTTP — including the server being killed mid-run, offline mode + `fleetscope upload`, and a
misbehaving server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import free_port

FS = [sys.executable, "-m", "fleetscope.cli"]
SHAPE = {"batch": 2, "seq": 32, "vocab": 128, "dim": 32, "layers": 2, "heads": 4}
PEAK = 1e12


def _job(run: str, steps: int, env: dict[str, str], sleep_ms: float = 0.0, timeout: float = 300,
         ranks: int = 4) -> subprocess.CompletedProcess:
    """``ranks`` processes: 4 where the data of several ranks is checked (decomposition, all-reduce bytes);
    2 where what is checked is that nothing is lost or duplicated (as many processes as the 2 cores)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "fleetscope.demo_train", "--run-name", run, "--steps", str(steps), "--peak-flops", str(PEAK),
           "--sleep-ms", str(sleep_ms), *[f"--{k}={v}" for k, v in SHAPE.items()]]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def _finished_steps(out: str) -> list[int]:
    import re

    found = dict(re.findall(r"fleetscope-demo-train: rank (\d+) finished (\d+) steps", out))
    return sorted(int(v) for v in found.values())


class Server:
    """`fleetscope serve --database-url` as a subprocess, killable and restartable on one port."""

    def __init__(self, db_url: str, port: int) -> None:
        self.db_url, self.port = db_url, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        env = {**os.environ, "FLEETSCOPE_COMPACT_GRACE_S": "1", "FLEETSCOPE_COMPACT_INTERVAL_S": "0.3"}
        self.proc = subprocess.Popen([*FS, "serve", "--database-url", self.db_url, "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def token(self) -> str:
        # a token name is held by one active token at a time: one name per token created here
        self._tokens = getattr(self, "_tokens", 0) + 1
        out = subprocess.run([*FS, "token", "create", "--name", f"job-{self._tokens}", "--database-url", self.db_url],
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip().splitlines()[-1]

    def run(self, name: str) -> dict[str, Any]:
        runs = httpx.get(f"{self.url}/api/v1/runs", params={"name": name}).json()["runs"]
        assert runs, f"run {name} not registered"
        return runs[0]

    def wait_rank_steps(self, name: str, n: int, timeout: float = 60, ranks: int = 4) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(name)
            summary = httpx.get(f"{self.url}/api/v1/runs/{run['id']}/summary").json()
            if summary["rank_steps"] >= n and summary["steps"] * ranks >= n or time.monotonic() > deadline:
                return summary
            time.sleep(0.3)


@pytest.fixture
def server(db_url: str):  # type: ignore[no-untyped-def]
    s = Server(db_url, free_port()).start()
    yield s
    s.stop()


def _param_bytes() -> int:
    from fleetscope.demo_train import build_model

    m = build_model(SHAPE["vocab"], SHAPE["dim"], SHAPE["layers"], SHAPE["heads"])
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_four_rank_job_streams_every_rank_step_with_exact_decomposition(server: Server, engine: Any, tmp_path: Path) -> None:
    from fleetscope.server.store.steps import rank_step_matrix

    from fleetscope.demo_train import analytic_flops

    steps = 10
    res = _job("job-a", steps, {"FLEETSCOPE_SERVER": server.url, "FLEETSCOPE_TOKEN": server.token(),
                                "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _finished_steps(res.stdout) == [steps] * 4
    s = server.wait_rank_steps("job-a", 4 * steps)
    assert s["rank_steps"] == 4 * steps and s["steps"] == steps
    run = s["run"]
    assert run["world_size"] == 4 and run["status"] == "finished" and run["model_family"] == "tiny-vla"

    # every rank-step: data + compute + exposed comm + other == step (float32 storage)
    cols = {f: rank_step_matrix(engine, run["id"], f)[2] for f in
            ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "flops", "padded_tokens", "tokens")}
    assert cols["step_s"].shape == (steps, 4) and not np.isnan(cols["step_s"]).any()
    parts = cols["data_s"] + cols["compute_s"] + cols["comm_exposed_s"] + cols["other_s"]
    np.testing.assert_allclose(parts, cols["step_s"], rtol=1e-5, atol=1e-6)
    assert (cols["compute_s"] > 0).all() and (cols["data_s"] > 0).all()
    assert (cols["tokens"] <= cols["padded_tokens"]).all() and cols["tokens"].sum() < cols["padded_tokens"].sum()

    # MFU counts model FLOPs of the real tokens: the analytic matmul FLOPs of the padded batch scaled by
    # tokens / padded tokens; HFU counts what the device computed, padding included (docs/metrics.md)
    analytic = analytic_flops(**SHAPE)
    np.testing.assert_allclose(cols["flops"], analytic * cols["tokens"] / cols["padded_tokens"], rtol=0.01)
    hw = rank_step_matrix(engine, run["id"], "hw_flops")[2]
    np.testing.assert_allclose(hw, analytic, rtol=0.01)
    # per step: Σ over ranks of flops / (n_ranks × step_s × peak), step_s the cross-rank median (the steps
    # table's); the summary is the median of that over steps (docs/metrics.md "MFU"). Ranks see different
    # token counts, so the cross-rank mean of flops (not their median) is what the definition divides.
    # Over the run's steady-state steps (summary.basis: a slow first step is set apart as warm-up).
    apart = {st for x in s["basis"]["set_apart"] for st in x["steps"]}
    steady = np.array([int(st) not in apart for st in rank_step_matrix(engine, run["id"], "step_s")[0]])
    expect_mfu = np.median((cols["flops"].sum(axis=1) / (4 * np.median(cols["step_s"], axis=1) * PEAK))[steady])
    assert s["mfu"] == pytest.approx(expect_mfu, rel=0.02)
    assert s["packing_efficiency"] == pytest.approx(cols["tokens"][steady].sum() / cols["padded_tokens"][steady].sum(),
                                                    rel=1e-6)

    # collectives: DDP's bucketed all-reduce moves exactly the parameter bytes per rank-step, n = 4
    colls = httpx.get(f"{server.url}/api/v1/runs/{run['id']}/collectives").json()["collectives"]
    ar = [c for c in colls if c["op"] == "all_reduce" and c["group_size"] == 4]
    assert ar
    assert sum(c["bytes"] for c in ar) == pytest.approx(_param_bytes() * 4 * steps, rel=1e-6)
    for c in ar:
        assert c["busbw_bytes_per_s"] == pytest.approx(c["algbw_bytes_per_s"] * 2 * 3 / 4)
        assert c["algbw_bytes_per_s"] == pytest.approx(c["bytes"] / c["total_s"])
    mods = httpx.get(f"{server.url}/api/v1/runs/{run['id']}").json()
    assert mods["id"] == run["id"]


def test_server_killed_mid_run_loses_and_duplicates_nothing(server: Server, tmp_path: Path) -> None:
    steps = 40
    token = server.token()
    env = {"FLEETSCOPE_SERVER": server.url, "FLEETSCOPE_TOKEN": token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("res", _job("job-kill", steps, env, sleep_ms=250, ranks=2)))
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until data flows, then kill the server hard
        try:
            if server.run("job-kill")["rank_steps"] > 0:
                break
        except (AssertionError, httpx.TransportError):
            pass
        time.sleep(0.2)
    server.kill()
    time.sleep(2)
    server.start()
    t.join(300)
    res = box["res"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _finished_steps(res.stdout) == [steps] * 2
    # the agents replayed what the outage spooled (while running or in their exit flush)
    s = server.wait_rank_steps("job-kill", 2 * steps, timeout=60, ranks=2)
    spool = tmp_path / "spool"
    assert not (spool.exists() and any(p.suffix == ".spool" for p in spool.iterdir())), list(spool.iterdir())
    assert s["rank_steps"] == 2 * steps and s["steps"] == steps, s["rank_steps"]  # 0 lost, 0 duplicated


def test_offline_job_then_upload_delivers_the_same_data(server: Server, tmp_path: Path) -> None:
    steps = 6
    spool = tmp_path / "spool"
    res = _job("job-offline", steps, {"FLEETSCOPE_OFFLINE": "1", "FLEETSCOPE_SPOOL_DIR": str(spool)}, ranks=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(spool.iterdir())
    token = server.token()
    out = subprocess.run([*FS, "upload", str(spool), "--server", server.url, "--token", token],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    s = server.wait_rank_steps("job-offline", 2 * steps, ranks=2)
    assert s["rank_steps"] == 2 * steps and s["steps"] == steps
    # uploading again changes nothing (idempotent)
    subprocess.run([*FS, "upload", str(spool), "--server", server.url, "--token", token],
                   capture_output=True, text=True, timeout=120)
    assert server.wait_rank_steps("job-offline", 2 * steps, ranks=2)["rank_steps"] == 2 * steps


class _BadServer:
    """Answers 500, then hangs 2 s, then garbage, then closes the connection, in turn."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.n = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        self.n += 1
        mode = self.n % 4
        try:
            conn.settimeout(5)
            conn.recv(65536)
            if mode == 0:
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\nConnection: close\r\n\r\noops!")
            elif mode == 1:
                time.sleep(2)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n")
            elif mode == 2:
                conn.sendall(b"\x00\xffgarbage not http\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()


def test_job_finishes_normally_when_the_server_misbehaves(tmp_path: Path) -> None:
    bad = _BadServer()
    try:
        steps = 8
        t0 = time.monotonic()
        res = _job("job-bad", steps, {"FLEETSCOPE_SERVER": f"http://127.0.0.1:{bad.port}", "FLEETSCOPE_TOKEN": "x",
                                      "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}, timeout=240, ranks=2)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert _finished_steps(res.stdout) == [steps] * 2
        assert bad.n > 0  # it did talk to the bad server
        assert any((tmp_path / "spool").iterdir())  # and kept the data for later
        del t0
    finally:
        bad.stop.set()
