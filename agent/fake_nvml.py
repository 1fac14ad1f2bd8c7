"""A fake NVML for tests, demos and CPU-only machines (``FLEETSCOPE_FAKE_NVML=<script.json>``): the
function surface and units of ``pynvml`` (milliwatts, percent, KB/s, NVMLError on what a device does not
support), driven by a script of states per device index, so that ``device_telemetry.NvmlReader`` runs
the same code on it as on a GPU. Script format: docs/agent.md, "Device telemetry"."""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["FakeNvml", "FakeNvmlError", "THROTTLE_REASONS", "XID_EVENT", "CLOCK_SM", "CLOCK_MEM", "PCIE_TX", "PCIE_RX"]

# NVML clocksEventReasons bits (nvml.h, nvmlClocksEventReason* / nvmlClocksThrottleReason*) -> names
THROTTLE_REASONS: dict[int, str] = {
    0x001: "idle",  # GpuIdle: nothing to run, clocks drop
    0x002: "applications_clocks",  # ApplicationsClocksSetting: clocks held by an application-clocks setting
    0x004: "power",  # SwPowerCap: the power cap (power_limit_w) holds the clocks down
    0x008: "hw_slowdown",  # HwSlowdown: the hardware slows down (temperature, power brake, supply)
    0x010: "sync_boost",  # SyncBoost: held to the slowest GPU of a sync-boost group
    0x020: "thermal",  # SwThermalSlowdown: driver thermal slowdown
    0x040: "thermal",  # HwThermalSlowdown: hardware thermal slowdown
    0x080: "power_brake",  # HwPowerBrakeSlowdown: an external power brake
    0x100: "display_clocks",  # DisplayClockSetting
}
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
CLOCK_SM, CLOCK_MEM = 1, 2  # NVML_CLOCK_SM, NVML_CLOCK_MEM
PCIE_TX, PCIE_RX = 0, 1  # NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES (KB/s)


class FakeNvmlError(Exception):
    """Raised like ``pynvml.NVMLError`` (a call the scripted device does not support, an empty event set)."""


class FakeNvml:
    """NVML's function surface over a script: ``{"devices": {"<index>": [state, ...]}, "default": [state, ...]}``;
    a state is ``{"t": seconds since start, "sm_clock_mhz", "mem_clock_mhz", "power_w", "power_limit_w",
    "temp_c", "util", "mem_used_bytes", "throttle": [names], "ecc_errors": cumulative count, "xid": [codes
    raised when the state begins], "pcie_tx_bytes_s", "pcie_rx_bytes_s", "processes": n}``; the last state
    whose ``t`` has passed applies (missing keys keep the previous state's value)."""

    NVMLError = FakeNvmlError

    def __init__(self, script: dict[str, Any], *, clock: Any = time.monotonic) -> None:
        self._script = script
        self._clock = clock
        self._t0 = clock()
        self._xid_seen: dict[int, int] = {}  # device index -> states whose xids were all delivered
        self._xid_next: dict[tuple[int, int], int] = {}  # (device index, state) -> its xids delivered

    @classmethod
    def from_file(cls, path: str) -> FakeNvml:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def _timeline(self, index: int) -> list[dict[str, Any]]:
        devs = self._script.get("devices") or {}
        tl = devs.get(str(index), self._script.get("default") or [])
        return tl if isinstance(tl, list) else [tl]

    def _state(self, index: int) -> tuple[dict[str, Any], int]:
        now = self._clock() - self._t0
        state: dict[str, Any] = {}
        n = 0
        for i, s in enumerate(self._timeline(index)):
            if float(s.get("t", 0.0)) <= now:
                state.update(s)
                n = i + 1
        return state, n

    def _get(self, handle: int, key: str) -> Any:
        v = self._state(handle)[0].get(key)
        if v is None:
            raise FakeNvmlError(f"not supported: {key}")
        return v

    # the NVML calls NvmlReader makes
    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        return None

    def nvmlShutdown(self) -> None:  # noqa: N802
        return None

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return int(index)

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return str(self._state(handle)[0].get("name", "Fake GPU"))

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:  # noqa: N802
        return int(self._get(handle, "sm_clock_mhz" if clock == CLOCK_SM else "mem_clock_mhz"))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802 - milliwatts
        return int(float(self._get(handle, "power_w")) * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:  # noqa: N802 - milliwatts
        return int(float(self._get(handle, "power_limit_w")) * 1000)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802
        return int(self._get(handle, "temp_c"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:  # noqa: N802
        names = set(self._state(handle)[0].get("throttle") or [])
        mask = 0
        for bit, name in THROTTLE_REASONS.items():
            if name in names and not mask & bit:
                mask |= bit
                names.discard(name)  # one bit per name ("thermal": the software bit)
        return mask

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802 - percent, like NVML
        from types import SimpleNamespace

        u = float(self._get(handle, "util"))
        return SimpleNamespace(gpu=int(round(u * 100)) if u <= 1 else int(u), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        from types import SimpleNamespace

        return SimpleNamespace(used=int(self._get(handle, "mem_used_bytes")), total=0, free=0)

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:  # noqa: N802
        return int(self._state(handle)[0].get("ecc_errors", 0))

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:  # noqa: N802 - KB/s
        return int(float(self._get(handle, "pcie_tx_bytes_s" if counter == PCIE_TX else "pcie_rx_bytes_s")) / 1024)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        return [object()] * int(self._state(handle)[0].get("processes", 1))

    def nvmlEventSetCreate(self) -> dict[str, Any]:  # noqa: N802
        return {"handles": []}

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: dict[str, Any]) -> None:  # noqa: N802
        event_set["handles"].append(handle)

    def nvmlEventSetWait_v2(self, event_set: dict[str, Any], timeout_ms: int) -> Any:  # noqa: N802
        """The next XID of a state that began since the last call; ``FakeNvmlError`` (NVML's timeout) when none."""
        from types import SimpleNamespace

        for h in event_set["handles"]:
            n = self._state(h)[1]
            tl = self._timeline(h)
            while self._xid_seen.get(h, 0) < n:
                i = self._xid_seen.get(h, 0)
                xids = list(tl[i].get("xid") or [])
                k = self._xid_next.get((h, i), 0)
                if k < len(xids):
                    self._xid_next[(h, i)] = k + 1
                    return SimpleNamespace(device=h, eventType=XID_EVENT, eventData=int(xids[k]))
                self._xid_seen[h] = i + 1
        raise FakeNvmlError("timeout")
