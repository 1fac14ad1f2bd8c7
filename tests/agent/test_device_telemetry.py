"""Device telemetry in the agent (agent/device_telemetry.py), with the fake NVML provider: the reason
names of NVML's clock-event bits, the aggregation of samples into one window (min/mean/max, reasons with
the seconds each was active, ECC deltas, XID codes), the sampler chained on the transport's sender
thread, and no telemetry, no error and no log line on a machine without NVML."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fleetscope.agent import device_telemetry as dt


def _script(tmp_path: Path, devices: dict[str, Any]) -> Path:
    p = tmp_path / "nvml.json"
    p.write_text(json.dumps({"devices": devices}))
    return p


BASE = {"t": 0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_w": 500, "power_limit_w": 700, "temp_c": 60,
        "util": 0.95, "mem_used_bytes": 40 << 30, "throttle": [], "ecc_errors": 3, "pcie_tx_bytes_s": 2048,
        "pcie_rx_bytes_s": 4096, "processes": 1}


def test_clock_event_bits_map_to_reason_names() -> None:
    assert dt.reason_names(0x4) == ["power"]
    assert dt.reason_names(0x20 | 0x40) == ["thermal"]  # software and hardware thermal slowdown: one name
    assert dt.reason_names(0x8 | 0x1) == ["hw_slowdown", "idle"]
    assert dt.reason_names(0x10 | 0x80) == ["power_brake", "sync_boost"]
    assert dt.reason_names(0) == []
    assert {"power", "thermal", "hw_slowdown"} <= dt.THROTTLING and "idle" not in dt.THROTTLING


def test_fake_nvml_mirrors_nvml_units_and_timeline() -> None:
    now = [0.0]
    nv = dt.FakeNvml({"devices": {"1": [BASE, {"t": 5, "throttle": ["power"], "sm_clock_mhz": 1410, "xid": [79]}]}},
                     clock=lambda: now[0])
    h = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetPowerUsage(h) == 500_000  # milliwatts, like NVML
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0
    assert nv.nvmlDeviceGetUtilizationRates(h).gpu == 95  # percent
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h, 0x8, es)
    with pytest.raises(dt.FakeNvmlError):
        nv.nvmlEventSetWait_v2(es, 0)
    now[0] = 6.0
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x4
    assert nv.nvmlDeviceGetClockInfo(h, 1) == 1410 and nv.nvmlDeviceGetClockInfo(h, 2) == 2619  # kept from before
    assert nv.nvmlEventSetWait_v2(es, 0).eventData == 79
    with pytest.raises(dt.FakeNvmlError):  # delivered once
        nv.nvmlEventSetWait_v2(es, 0)
    with pytest.raises(dt.FakeNvmlError):  # device 0 is not in the script and there is no default
        nv.nvmlDeviceGetPowerUsage(nv.nvmlDeviceGetHandleByIndex(0))


def test_a_window_aggregates_samples_reasons_ecc_and_xid() -> None:
    now = [0.0]
    nv = dt.FakeNvml({"devices": {"0": [BASE, {"t": 4, "throttle": ["power"], "sm_clock_mhz": 1400, "power_w": 700},
                                        {"t": 8, "throttle": [], "sm_clock_mhz": 1980, "ecc_errors": 5, "xid": [48, 79]}]}},
                     clock=lambda: now[0])
    s = dt.Sampler(None, sample_s=1.0, window_s=10.0, reader=dt.NvmlReader(nv, 0), clock=lambda: now[0])
    events = []
    for t in range(0, 12):  # one sample per second; the window closes at 10 s
        now[0] = float(t)
        ev = s.tick(now_mono=float(t))
        if ev is not None:
            events.append(ev)
    assert len(events) == 1
    d = events[0]["data"]
    assert events[0]["kind"] == "device"
    assert d["samples"] == 11 and d["window_s"] == pytest.approx(10.0)
    assert d["sm_clock_mhz"] == {"min": 1400.0, "mean": pytest.approx((4 * 1980 + 4 * 1400 + 3 * 1980) / 11, abs=1e-3),
                                 "max": 1980.0}
    assert d["power_w"]["max"] == 700.0 and d["power_limit_w"]["mean"] == 700.0
    assert d["util"]["mean"] == pytest.approx(0.95) and d["mem_used_bytes"]["max"] == 40 << 30
    assert d["throttle"] == ["power"]
    assert d["throttle_s"] == {"power": pytest.approx(4.0)}  # samples at 4..7 s, each charged 1 s
    assert d["ecc_errors"] == 2  # 3 -> 5 within the window
    assert d["xid"] == [48, 79]
    assert d["pcie_tx_bytes_s"] == pytest.approx(2048.0) and d["processes"] == 1
    # the next window starts from the last ECC count: no new errors
    for t in range(12, 23):
        now[0] = float(t)
        ev = s.tick(now_mono=float(t))
        if ev is not None:
            events.append(ev)
    assert len(events) == 2 and events[1]["data"]["ecc_errors"] == 0 and events[1]["data"]["xid"] == []
    assert events[1]["data"]["throttle"] == [] and s.errors == 0


def test_the_final_window_is_sent_at_finish_and_unsupported_calls_are_skipped() -> None:
    now = [0.0]
    state = {"t": 0, "sm_clock_mhz": 1000, "throttle": ["thermal"], "temp_c": 90}  # no power, util, memory …
    nv = dt.FakeNvml({"default": [state]}, clock=lambda: now[0])
    s = dt.Sampler(None, sample_s=1.0, window_s=60.0, reader=dt.NvmlReader(nv, 3), clock=lambda: now[0])
    assert s.tick(now_mono=0.0) is None and s.tick(now_mono=1.0) is None
    ev = s.tick(now_mono=2.0, final=True)
    assert ev is not None
    d = ev["data"]
    assert d["samples"] == 3 and d["throttle"] == ["thermal"] and d["temp_c"]["max"] == 90.0
    assert "power_w" not in d and "util" not in d and d["device_index"] == 3
    assert s.errors == 0 and {"power", "util", "memory"} <= s.reader._off  # type: ignore[union-attr]


def test_device_index_follows_local_rank_through_cuda_visible_devices() -> None:
    assert dt._device_index({"LOCAL_RANK": "1"}) == 1
    assert dt._device_index({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert dt._device_index({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == "GPU-abc"
    assert dt._device_index({}) == 0


def test_no_nvml_means_no_reader_and_no_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    env = {k: v for k, v in os.environ.items() if k != "FLEETSCOPE_FAKE_NVML"}
    assert dt.open_reader(env) is None  # CPU torch: CUDA never initialised, pynvml never imported
    assert "pynvml" not in sys.modules
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert dt.open_reader({"FLEETSCOPE_FAKE_NVML": "/nonexistent/script.json"}) is None  # unreadable: quietly none


JOB = r'''
import logging, sys
import fleetscope.agent as fs
from fleetscope.agent import device_telemetry as dt
run = fs.init("dev-unit", model_family="toy")
for i in range(5):
    with run.step():
        pass
run.finish()
print("events", sum(1 for k, v in getattr(run._tx, "sent_items", []) if k == "event"))
print("sampler", dt._SAMPLERS.get(run).samples if dt._SAMPLERS.get(run) else None)
'''


def test_an_agent_job_without_nvml_sends_no_device_events_and_logs_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_OFFLINE="1", FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"), OMP_NUM_THREADS="1",
               FLEETSCOPE_DEVICE_WINDOW_S="0.1", FLEETSCOPE_DEVICE_SAMPLE_S="0.05")
    p = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "sampler 0" in p.stdout  # installed, never sampled: no device
    assert "nvml" not in p.stderr.lower() and "device" not in p.stderr.lower(), p.stderr[-2000:]
    from fleetscope.agent.spool import read_segment  # the spool holds what was sent: no device event
    kinds = set()
    for seg in (tmp_path / "spool").rglob("*"):
        if not seg.is_file() or seg.name.startswith("."):
            continue
        for fr in read_segment(seg).frames:
            for ev in (fr.payload().get("batch") or {}).get("events") or []:
                kinds.add(ev["kind"])
    assert kinds and "device" not in kinds


def test_a_window_spans_at_least_100_steps_so_telemetry_stays_small() -> None:
    s = dt.Sampler(None, sample_s=1.0, window_s=30.0, reader=dt.NvmlReader(dt.FakeNvml({"default": [BASE]}), 0))
    assert s.current_window_s() == 30.0  # no step seen yet
    s.observe([("rank_step", (0, 0, 0.1)), ("collective", (1,))])
    assert s.current_window_s() == 30.0  # 100 × 0.1 s is shorter than the configured window
    s.observe([("rank_step", (0, i, 2.0)) for i in range(40)])
    assert s.current_window_s() == pytest.approx(dt.STEPS_PER_WINDOW * 2.0) == 200.0
    s.observe([("rank_step", (0, i, 60.0)) for i in range(40)])
    assert s.current_window_s() == dt.MAX_WINDOW_S
