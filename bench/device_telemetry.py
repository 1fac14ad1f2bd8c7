"""Device telemetry (agent/device_telemetry.py): what it costs the job and what it costs the store.

    python bench/device_telemetry.py [--samples 20000] [--steps 1500] [--reps 3] [--ranks 16] [--hours 1]

1. **Sender-thread cost per sample**: a ``Sampler`` over the fake NVML provider (the same ``NvmlReader``
   code as with ``pynvml``: 11 NVML calls, the XID poll, the fold into the window, a ``device`` event per
   window), ``--samples`` samples one after the other. With real NVML each call also enters the driver
   (``bench/gpu_check.py`` measures that on a GPU).
2. **Training-thread step time, telemetry off vs on** (same run): a real agent job
   (``fleetscope.agent.init``, offline spool in a temp dir) of ``--steps`` steps of ~2 ms host work, its
   sender cycling every 50 ms (40× more often than the default, so that sampling — every cycle — is as
   frequent as it can get), in blocks of 50 steps with sampling off (the sampler's tick returns at once)
   and on (the fake provider sampled every cycle, a window per second) in turn, so that load on the
   machine hits both alike; ``--reps`` jobs. Reported: the median step time of each, their ratio (target
   1.00), and the sender thread's sampling time per step while on.
3. **Stored bytes per rank-hour**: a real server (``fleetscope serve``, embedded Postgres) receives
   ``--ranks`` ranks × ``--hours`` hours of 1 s steps (``fleetscope simulate``'s rows and collectives,
   through the agent transport) and the same ranks' ``device`` windows at the agent's window length for
   1 s steps (100 steps: ``STEPS_PER_WINDOW``); after compaction: ``pg_total_relation_size`` of ``steps`` (and of its blocks
   without the collectives) against ``run_devices`` (target ≤ 5 %).

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCRIPT = {"devices": {"0": [{"t": 0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_w": 520, "power_limit_w": 700,
                              "temp_c": 62, "util": 0.97, "mem_used_bytes": 60 << 30, "throttle": [], "ecc_errors": 0,
                              "pcie_tx_bytes_s": 1 << 20, "pcie_rx_bytes_s": 1 << 20, "processes": 1},
                             {"t": 1, "throttle": ["power"], "sm_clock_mhz": 1410}]}}

JOB = r'''
import statistics, sys, time
import fleetscope.agent as fs
from fleetscope.agent import device_telemetry as dt
run = fs.init("bench-device", offline=True, spool_dir=sys.argv[1], flush_interval_s=0.05,
              device_sample_s=0.05, device_window_s=1.0)
s = dt._SAMPLERS.get(run)
def work():
    t = time.perf_counter() + 0.002
    x = 0
    while time.perf_counter() < t:
        x += 1
times = {"off": [], "on": []}
block = int(sys.argv[3])
for b in range(int(sys.argv[2]) // block):
    mode = "on" if b % 2 else "off"
    s.sample_s = 0.05 if mode == "on" else 1e9  # off: the tick returns at its first test
    before = s.cost_ns
    for i in range(block):
        t0 = time.perf_counter()
        with run.step():
            work()
        times[mode].append(time.perf_counter() - t0)
s.sample_s = 0.05
run.finish()
print("median_off_us", statistics.median(times["off"]) * 1e6)
print("median_on_us", statistics.median(times["on"]) * 1e6)
print("steps_on", len(times["on"]))
print("samples", s.samples)
print("windows", s.windows)
print("sampling_ns", s.cost_ns)
'''


def per_sample(n: int) -> tuple[float, int]:
    """µs of sender-thread time per sample (fake provider), and the windows produced."""
    from fleetscope.agent import device_telemetry as dt

    now = [0.0]
    nv = dt.FakeNvml(SCRIPT, clock=lambda: now[0])
    s = dt.Sampler(None, sample_s=1.0, window_s=30.0, reader=dt.NvmlReader(nv, 0), clock=lambda: now[0])
    for i in range(n):
        now[0] = float(i)
        s.tick(now_mono=float(i))
    return s.cost_ns / 1e3 / max(s.samples, 1), s.windows


def job(steps: int, block: int, script: Path) -> dict[str, float]:
    """One agent job with the fake provider: blocks of ``block`` steps, telemetry off and on in turn."""
    tmp = tempfile.mkdtemp(prefix="fs-devb-")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
        env.update(OMP_NUM_THREADS="1", FLEETSCOPE_FAKE_NVML=str(script))
        out = subprocess.run([sys.executable, "-c", JOB, tmp, str(steps), str(block)], capture_output=True, text=True,
                             env=env, timeout=600, check=True).stdout
        return {k: float(v) for k, v in (line.split() for line in out.splitlines() if line.strip())}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored_bytes(ranks: int, hours: float) -> dict[str, float]:
    """Bytes per rank-hour of the step records and of the device windows, in one server."""
    import httpx
    import psycopg
    from fleetscope.server.auth import create_token
    from fleetscope.server.db import EmbeddedPostgres, libpq_url, make_engine, upgrade

    from fleetscope.simulate import _Events, device_events, run_simulation

    steps = int(3600 * hours)
    tmp = Path(tempfile.mkdtemp(prefix="fs-devb-db-", dir="/tmp"))
    pg = EmbeddedPostgres(tmp)
    url = pg.start()
    server = None
    try:
        upgrade(url)
        eng = make_engine(url, pool_size=1)
        token = create_token(eng, "bench", scope="admin", replace=True)
        eng.dispose()
        port = _free_port()
        env = {**os.environ, "FLEETSCOPE_COMPACT_GRACE_S": "1", "FLEETSCOPE_COMPACT_INTERVAL_S": "0.5"}
        server = subprocess.Popen([sys.executable, "-m", "fleetscope.cli", "serve", "--database-url", url, "--port",
                                   str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        t0 = time.time() - steps
        run_simulation(server=base, token=token, run="bench-device", family="llm-70b", ranks=ranks, steps=steps,
                       step_ms=1000.0, flush_timeout_s=600)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            rid, ts0 = c.execute("SELECT id, extract(epoch FROM started_at) FROM runs WHERE name = 'bench-device'").fetchone()
        t0 = float(ts0) if ts0 else t0
        evs = device_events(ranks, {3: "power"}, t0, t0 + steps, _Events(), max_windows=10**6, window_s=100.0)
        for i in range(0, len(evs), 2000):
            r = httpx.post(f"{base}/api/v1/ingest", json={"v": 1, "run_id": rid, "events": evs[i:i + 2000]},
                           headers={"Authorization": f"Bearer {token}"}, timeout=120)
            r.raise_for_status()
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            while c.execute("SELECT count(*) FROM ingest_fragments").fetchone()[0] > 0:
                time.sleep(0.2)
            c.execute("VACUUM ANALYZE steps, run_devices")
            steps_b = c.execute("SELECT pg_total_relation_size('steps')").fetchone()[0]
            coll_b = c.execute("SELECT coalesce(sum(octet_length(coll_block)), 0) FROM steps").fetchone()[0]
            dev_b = c.execute("SELECT pg_total_relation_size('run_devices')").fetchone()[0]
            n_dev = c.execute("SELECT count(*) FROM run_devices").fetchone()[0]
        # bytes per window at fleet scale: 1,024 ranks' windows of the same hour in a second run
        r = httpx.post(f"{base}/api/v1/runs", json={"name": "bench-device-1024", "world_size": 1024},
                       headers={"Authorization": f"Bearer {token}"}, timeout=60)
        r.raise_for_status()
        rid2 = r.json()["id"]
        evs = device_events(1024, {3: "power"}, t0, t0 + steps, _Events(), max_windows=10**6, window_s=100.0)
        for i in range(0, len(evs), 4000):
            httpx.post(f"{base}/api/v1/ingest", json={"v": 1, "run_id": rid2, "events": evs[i:i + 4000]},
                       headers={"Authorization": f"Bearer {token}"}, timeout=300).raise_for_status()
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute("VACUUM ANALYZE run_devices")
            dev_all = c.execute("SELECT pg_total_relation_size('run_devices')").fetchone()[0]
            n_all = c.execute("SELECT count(*) FROM run_devices").fetchone()[0]
        rank_hours = ranks * hours
        return {"steps_b": steps_b / rank_hours, "steps_no_coll_b": (steps_b - coll_b) / rank_hours,
                "device_b": dev_b / rank_hours, "device_rows": float(n_dev), "bytes_per_window": dev_b / max(n_dev, 1),
                "bytes_per_window_1024": (dev_all - dev_b) / max(n_all - n_dev, 1),
                "device_b_1024": (dev_all - dev_b) / (1024 * hours)}
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--skip-db", action="store_true", help="leave out part 3 (no server, no Postgres)")
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)

    us, windows = per_sample(args.samples)
    print(f"per sample: {us:.1f} µs over {args.samples} samples ({windows} windows)", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="fs-devb-s-"))
    script = tmp / "nvml.json"
    script.write_text(json.dumps(SCRIPT))
    off: list[float] = []
    on: list[float] = []
    per_step_ns: list[float] = []
    samples = 0.0
    for _ in range(args.reps):
        b = job(args.steps, 50, script)
        off.append(b["median_off_us"])
        on.append(b["median_on_us"])
        per_step_ns.append(b["sampling_ns"] / b["steps_on"])
        samples += b["samples"]
        print(f"  off {b['median_off_us']:.1f} µs/step, on {b['median_on_us']:.1f} µs/step "
              f"({int(b['samples'])} samples, {int(b['windows'])} windows)", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median([b / a for a, b in zip(off, on, strict=True)])

    db: dict[str, float] = {}
    if not args.skip_db:
        db = stored_bytes(args.ranks, args.hours)
    print(f"load after: {os.getloadavg()}")
    print(f"device_sample_sender_us: {us:.1f} us")
    print(f"train_step_median_off_us: {statistics.median(off):.1f} us")
    print(f"train_step_median_on_us: {statistics.median(on):.1f} us")
    print(f"train_step_ratio_on_over_off: {ratio:.3f} x")
    print(f"sender_sampling_per_step_us: {statistics.median(per_step_ns) / 1e3:.2f} us "
          f"({samples / args.reps:.0f} samples per job of {args.steps} steps, half of them sampled)")
    if db:
        print(f"step_records_bytes_per_rank_hour: {db['steps_b']:.0f} B (without collectives: {db['steps_no_coll_b']:.0f} B)")
        print(f"device_bytes_per_rank_hour: {db['device_b']:.0f} B ({db['bytes_per_window']:.0f} B per window, "
              f"{int(db['device_rows'])} windows)")
        print(f"device_bytes_per_rank_hour_1024_ranks: {db['device_b_1024']:.0f} B "
              f"({db['bytes_per_window_1024']:.0f} B per window); against 47 B per rank-step (docs/benchmarks.md, "
              f"1,024 ranks) at 1 s steps: {100 * db['device_b_1024'] / (47 * 3600):.2f} %")
        print(f"device_share_of_step_records: {100 * db['device_b'] / db['steps_b']:.2f} % "
              f"(of the blocks without collectives: {100 * db['device_b'] / db['steps_no_coll_b']:.2f} %)")


if __name__ == "__main__":
    main()
