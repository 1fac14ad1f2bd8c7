"""GPU telemetry from outside the job: a dcgm-exporter page served by a local HTTP server (two GPUs on one node,
GPU 1 at its power cap with its SM clocks held low) is read by the server's background dcgm reader and joined
to the two ranks of a running run on that node that send no telemetry of their own: ``/devices`` shows both
ranks with ``source`` ``dcgm``, rank 1 throttled by ``power`` with its clocks against its peer's, and the
straggler report names the power cap as the cause of the slow rank. Prometheus' API as the source, the join
by local rank and short host name, and bad settings (a clear error) too."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text

# what dcgm-exporter 3.x serves (default counters), trimmed: the Hostname label is the exporter pod's name
# under Kubernetes, so the node comes from the target's configuration
PAGE = """# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="dcgm-exporter-x7k2p",DCGM_FI_DRIVER_VERSION="550.54.15"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-bbbb",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="dcgm-exporter-x7k2p",DCGM_FI_DRIVER_VERSION="550.54.15"} 1410
# HELP DCGM_FI_DEV_MEM_CLOCK Memory clock frequency (in MHz).
# TYPE DCGM_FI_DEV_MEM_CLOCK gauge
DCGM_FI_DEV_MEM_CLOCK{gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="dcgm-exporter-x7k2p"} 2619
DCGM_FI_DEV_MEM_CLOCK{gpu="1",UUID="GPU-bbbb",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="dcgm-exporter-x7k2p"} 2619
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 61
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 67
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 512.25
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 699.5
# HELP DCGM_FI_DEV_POWER_MGMT_LIMIT Power management limit (in W).
# TYPE DCGM_FI_DEV_POWER_MGMT_LIMIT gauge
DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 700
DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 700
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 97
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 100
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 40960
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 41000
# HELP DCGM_FI_DEV_CLOCKS_EVENT_REASONS Current clock event reasons (bitmask).
# TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge
DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 0
DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 4
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 0
DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 0
# HELP DCGM_FI_DEV_PCIE_REPLAY_COUNTER Total number of PCIe retries.
# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter
DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="0",UUID="GPU-aaaa",device="nvidia0",Hostname="dcgm-exporter-x7k2p"} 0
DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="1",UUID="GPU-bbbb",device="nvidia1",Hostname="dcgm-exporter-x7k2p"} 0
"""


class _Exporter(http.server.BaseHTTPRequestHandler):
    pages: dict[str, tuple[str, bytes]] = {}
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        self.hits.append(self.path)
        ctype, body = self.pages.get(path, ("text/plain", b""))
        self.send_response(200 if path in self.pages else 404)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def exporter() -> Iterator[str]:
    """A local HTTP server: /metrics serves the dcgm-exporter page; /api/v1/query what a test sets."""
    _Exporter.pages = {"/metrics": ("text/plain; version=0.0.4", PAGE.encode())}
    _Exporter.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def test_dcgm_exporter_page_joined_to_a_running_runs_ranks(db_url: str, exporter: str) -> None:
    from conftest import start_server

    from fleetscope.simulate import run_simulation

    srv = start_server(db_url, dcgm_targets=[f"node0000={exporter}/metrics"], dcgm_interval_s=1.0,
                       alerts_enabled=False)
    try:
        # 2 ranks on node0000 (local ranks 0, 1), rank 1 1.3× slower; left running (no agent telemetry)
        run_simulation(server=srv.url, token=srv.token, run="dcgm-run", family="llm-7b", ranks=2, steps=40,
                       straggler={1: 1.3}, hang=(0, 40), hold_s=0.0)
        srv.compact()
        rid = int(httpx.get(f"{srv.url}/api/v1/runs", params={"name": "dcgm-run"}).json()["runs"][0]["id"])
        reader = srv.app.state.dcgm
        assert reader is not None
        # the background pass reads the page within a few of its 1 s intervals; then one pass here too
        deadline = time.monotonic() + 60
        while not any(h.startswith("/metrics") for h in _Exporter.hits) and time.monotonic() < deadline:
            time.sleep(0.2)
        res = reader.collect_once()
        assert res["errors"] == [] and res["gpus"] == 2 and res["joined"] == 2, res
        dev = httpx.get(f"{srv.url}/api/v1/runs/{rid}/devices", timeout=60).json()
        ranks = {r["rank"]: r for r in dev["ranks"]}
        assert set(ranks) == {0, 1} and {r["source"] for r in ranks.values()} == {"dcgm"}
        assert dev["throttled_ranks"] == [1] and ranks[1]["reason"] == "power" and ranks[1]["throttle"] == ["power"]
        assert ranks[1]["sm_clock_mhz"] == pytest.approx(1410) and ranks[1]["peers_sm_clock_mhz"] == pytest.approx(1980)
        assert ranks[1]["power_limit_w"] == pytest.approx(700) and ranks[1]["node"] == "node0000"
        assert ranks[0]["util"] == pytest.approx(0.97) and ranks[0]["mem_used_bytes"] == 40960 << 20
        assert not ranks[0]["throttled"] and ranks[0]["temp_c_max"] == pytest.approx(61)
        with srv.state.engine.connect() as c:
            src = c.execute(text("SELECT DISTINCT source FROM run_devices WHERE run_id = :r"), {"r": rid}).fetchall()
        assert src == [("dcgm",)]
        # the straggler report: rank 1 is slow, its cause names the power cap and the clocks against its peer's
        summary = httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary", timeout=120).json()
        top = summary["stragglers"][0]
        assert top["rank"] == 1 and top["cause"]["reason"] == "power", summary["stragglers"]
        assert "power cap" in top["cause"]["text"] and "1.41 GHz vs 1.98 GHz" in top["cause"]["text"]
        # a rank that sends the agent's own telemetry is left to it
        now = time.time()
        data = {"window_s": 30.0, "samples": 30, "sm_clock_mhz": {"min": 1965, "mean": 1980, "max": 1995}}
        with srv.client() as c:
            c.ingest({"v": 1, "run_id": rid, "events": [{"rank": 0, "seq": 9001, "kind": "device", "ts": now - 30,
                                                         "step": 1, "data": data}]}, fmt="json")
        assert reader.collect_once(now=now)["ranks"] == 1
    finally:
        srv.stop()


def test_prometheus_api_source_join_by_local_rank_and_short_host_and_bad_settings(live_server: Any,
                                                                                   exporter: str) -> None:
    from fleetscope.server.dcgm import DcgmReader, GpuReading, join_ranks, parse_targets
    from fleetscope.server.settings import Settings

    answer = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"__name__": name, "gpu": str(g), "UUID": f"GPU-{g}", "kubernetes_node": "gpu-n7.cluster.local"},
         "value": [1.7e9, str(v)]}
        for g in (2, 3) for name, v in (("DCGM_FI_DEV_SM_CLOCK", 1980 if g == 2 else 1500),
                                         ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0 if g == 2 else 0x40),
                                         ("DCGM_FI_DEV_GPU_TEMP", 70 if g == 2 else 91),
                                         ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0))]}}
    _Exporter.pages["/api/v1/query"] = ("application/json", json.dumps(answer).encode())
    with live_server.client() as c:
        rid = c.register_run({"name": "prom-run", "world_size": 2})
        # the ranks say they are local ranks 2 and 3 of the node (GPUs 2 and 3), by its short name
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "host": "gpu-n7", "node": "gpu-n7", "local_rank": r + 2}
                                                   for r in range(2)]}, fmt="json")
    reader = DcgmReader(live_server.state.engine, prometheus_url=exporter, node_label="kubernetes_node",
                        interval_s=30.0)
    res = reader.collect_once()
    assert res["errors"] == [] and res["joined"] == 2, res
    assert any("DCGM_FI_DEV_SM_CLOCK" in h for h in _Exporter.hits)  # one instant query for every series
    dev = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/devices", timeout=60).json()
    ranks = {r["rank"]: r for r in dev["ranks"]}
    assert ranks[1]["reason"] == "thermal" and ranks[1]["temp_c_max"] == pytest.approx(91)
    assert ranks[0]["sm_clock_mhz"] == pytest.approx(1980) and ranks[0]["source"] == "dcgm"
    # no local ranks: the ranks on a node in rank order take GPUs 0, 1, …
    g = [GpuReading("n1", i, values={"sm_clock_mhz": 1000.0 + i}) for i in range(2)]
    joined = join_ranks(g, [(9, 5, "n1", None), (9, 4, "n1", None), (9, 6, "n2", None)])
    assert [(rank, r.gpu) for _, rank, r in joined] == [(4, 0), (5, 1)]
    # a bad target names itself; a Prometheus that is down is an error line, not an exception
    with pytest.raises(ValueError, match="NODE=URL"):
        parse_targets(["node1:http://x"])
    with pytest.raises(ValueError, match="NODE=URL"):
        Settings(dcgm_targets="node1=ftp://x")
    down = DcgmReader(live_server.state.engine, prometheus_url="http://127.0.0.1:9", timeout_s=2.0)
    out = down.collect_once()
    assert out["stored"] == 0 and out["errors"] and "prometheus" in out["errors"][0]
