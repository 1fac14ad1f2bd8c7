"""The server's edge under hostile load (issue #10): RSS and /healthz latency while unauthenticated
100 MB bodies and decode-heavy (gzip-bomb) batches arrive. Loopback only, bounded in count and time.

    python bench/edge.py [--fleetscope PATH] [--bodies 12] [--bombs 12] [--seconds 20]

``--fleetscope`` picks the `fleetscope` executable to serve (e.g. another checkout's venv, to compare
before/after in the same run). Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def _send_unauthenticated_body(port: int, size: int, stop: threading.Event, codes: list[int]) -> None:
    """POST a ``size``-byte body with no token, streamed; record the status (or -1 if cut off)."""
    head = (f"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    chunk = b"a" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head)
            s.settimeout(0.0)
            sent = 0
            while sent < size and not stop.is_set():
                try:
                    data = s.recv(4096)
                    if data:
                        codes.append(int(data.split(b" ", 2)[1]))
                        return
                except BlockingIOError:
                    pass
                try:
                    s.settimeout(5)
                    s.sendall(chunk)
                    s.settimeout(0.0)
                    sent += len(chunk)
                except OSError:
                    break
            s.settimeout(10)
            data = s.recv(4096)
            codes.append(int(data.split(b" ", 2)[1]) if data else -1)
    except OSError:
        codes.append(-1)


def _bomb() -> bytes:
    """A valid-looking ingest batch whose gzip body (~65 KB) decodes to 64 MiB of JSON whitespace."""
    doc = json.dumps({"v": 1, "run_id": 1, "rank_steps": {}}).encode()
    return gzip.compress(doc[:-1] + b" " * (64 * 2**20) + doc[-1:], 9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleetscope", default=shutil.which("fleetscope") or str(Path(sys.executable).parent / "fleetscope"))
    ap.add_argument("--bodies", type=int, default=12, help="unauthenticated 100 MB bodies (4 at a time)")
    ap.add_argument("--bombs", type=int, default=12, help="gzip-bomb batches with a valid token (4 at a time)")
    ap.add_argument("--seconds", type=float, default=20.0, help="upper bound on each phase")
    ap.add_argument("--bounds", action="store_true", help="instead: every stored quantity at its bound "
                    "(bench/edge_bounds.py): peak memory, slowest read and page")
    ap.add_argument("--before", help="with --bounds: an older build's `fleetscope` to compare the group-event case")
    ap.add_argument("--ranks", type=int, default=16_384, help="with --bounds: ranks of the group-event job")
    ap.add_argument("--no-browser", action="store_true", help="with --bounds: skip the page timings")
    args = ap.parse_args()
    if args.bounds:
        sys.path.insert(0, str(Path(__file__).parent))
        import edge_bounds

        edge_bounds.main(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="fs-edge-", dir="/tmp"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLEETSCOPE_DATABASE_URL": ""}
    tok = subprocess.run([args.fleetscope, "token", "create", "--name", "edge-bench", "--data-dir", str(tmp)],
                         capture_output=True, text=True, env=env, timeout=120)
    if tok.returncode != 0 and "active token" in tok.stderr:  # older builds have no --scope/unique names
        tok = subprocess.run([args.fleetscope, "token", "create", "--name", "edge-bench-2", "--data-dir", str(tmp)],
                             capture_output=True, text=True, env=env, timeout=120)
    token = tok.stdout.strip().splitlines()[-1]
    srv = subprocess.Popen([args.fleetscope, "serve", "--port", str(port), "--data-dir", str(tmp)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    figures: list[tuple[str, float, str]] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        time.sleep(1.0)
        idle = _rss_mib(srv.pid)
        figures.append(("server_rss_idle", idle, "MiB"))

        def phase(name: str, work: list[threading.Thread], stop: threading.Event) -> None:
            lat: list[float] = []
            peak = idle
            t_end = time.monotonic() + args.seconds
            pending = list(work)
            running: list[threading.Thread] = []
            while (pending or any(t.is_alive() for t in running)) and time.monotonic() < t_end:
                running = [t for t in running if t.is_alive()]
                while pending and len(running) < 4:
                    t = pending.pop()
                    t.start()
                    running.append(t)
                t0 = time.perf_counter()
                try:
                    httpx.get(f"{url}/healthz", timeout=10)
                    lat.append((time.perf_counter() - t0) * 1e3)
                except httpx.TransportError:
                    lat.append(10_000.0)
                peak = max(peak, _rss_mib(srv.pid))
                time.sleep(0.02)
            stop.set()
            for t in work:
                if t.is_alive() or t.ident:
                    t.join(15)
            lat.sort()
            figures.append((f"{name}_healthz_p50", statistics.median(lat), "ms"))
            figures.append((f"{name}_healthz_p99", lat[min(len(lat) - 1, int(0.99 * len(lat)))], "ms"))
            figures.append((f"{name}_rss_peak_above_idle", peak - idle, "MiB"))

        codes: list[int] = []
        stop = threading.Event()
        phase("unauth_100MB_bodies", [threading.Thread(target=_send_unauthenticated_body,
                                                       args=(port, 100 * 2**20, stop, codes)) for _ in range(args.bodies)],
              stop)
        figures.append(("unauth_100MB_bodies_refused", sum(c in (401, 413) for c in codes), f"of {args.bodies}"))

        body = _bomb()
        bomb_codes: list[int] = []

        def bomb() -> None:
            try:
                r = httpx.post(f"{url}/api/v1/ingest", content=body, timeout=60,
                               headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                                        "Content-Encoding": "gzip"})
                bomb_codes.append(r.status_code)
            except httpx.TransportError:
                bomb_codes.append(-1)

        phase("gzip_bombs", [threading.Thread(target=bomb) for _ in range(args.bombs)], threading.Event())
        figures.append(("gzip_bombs_refused_4xx", sum(400 <= c < 500 for c in bomb_codes), f"of {args.bombs} "
                        f"({len(body) // 1024} KB → 64 MiB each)"))
        figures.append(("server_rss_end", _rss_mib(srv.pid), "MiB"))
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for name, v, unit in figures:
        print(f"{name}: {v:.1f} {unit}")


if __name__ == "__main__":
    main()
