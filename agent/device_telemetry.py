"""Device telemetry: the rank's own GPU read through NVML on the sender thread, one ``device`` event per window.

Nothing here runs on the training thread and nothing synchronises the device: NVML reads the driver's
counters (clocks, power, temperature, the clock-event "throttle" reasons, utilisation, memory, ECC and
XID events) without touching the CUDA stream. ``Sampler.tick`` is called by the transport's sender
thread once per cycle (chained after the position watch of health.py, see :func:`install`); it samples
at most every ``sample_s`` seconds and, once ``window_s`` seconds have passed, returns one aggregated
``device`` event: min / mean / max of each figure, the union of throttle reasons with the seconds each
was active, ECC error deltas, XID codes, PCIe throughput, processes on the device. Field names are the
contract's (docs/agent.md, "Device telemetry").

Providers (``NvmlReader`` works on either, both have NVML's function surface):

* ``pynvml`` from the optional extra ``nvidia-ml-py`` (``pip install fleetscope[nvml]``), imported only
  when this process uses a CUDA device (``torch.cuda.is_initialized()``). Without it, or without a
  driver, there is no telemetry, no error and no log line above DEBUG.
* :class:`FakeNvml` (fake_nvml.py), driven by a JSON script named by ``FLEETSCOPE_FAKE_NVML`` (tests,
  demos, CPU-only machines): per device index a timeline of states, each applying from ``t`` seconds after start.

AMD: ``amdsmi`` exposes the same figures (``amdsmi_get_clock_info``, ``amdsmi_get_power_info``,
``amdsmi_get_temp_metric``, ``amdsmi_get_gpu_activity``, ``amdsmi_get_gpu_vram_usage``, throttle status
in ``amdsmi_get_gpu_metrics_info``); a reader for it would fill the same ``_Sample`` — not built yet.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .fake_nvml import (
    CLOCK_MEM,
    CLOCK_SM,
    PCIE_RX,
    PCIE_TX,
    THROTTLE_REASONS,
    XID_EVENT,
    FakeNvml,
    FakeNvmlError,
)

__all__ = ["Sampler", "NvmlReader", "FakeNvml", "Window", "install", "open_reader", "reason_names",
           "THROTTLE_REASONS", "THROTTLING", "DEVICE_KIND", "FIGURES", "flush_window", "FakeNvmlError"]

log = logging.getLogger(__name__)

DEVICE_KIND = "device"

THROTTLING = frozenset({"power", "thermal", "hw_slowdown", "power_brake", "sync_boost"})
"""Reasons that slow a busy GPU down (``idle`` and clock settings are not throttling)."""
FIGURES = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "power_limit_w", "temp_c", "util", "mem_used_bytes")
"""Figures aggregated per window as {"min", "mean", "max"}."""
MAX_XIDS = 16  # XID codes one window lists at most (a storm is counted in ``xid_count``)
STEPS_PER_WINDOW = 100
"""A window spans at least this many of the rank's steps (median step time; the straggler analysis' window
is 100 steps too): at ~160 stored bytes per window against ≥ 47 per rank-step, telemetry stays under 5 %
of the step records' bytes at any step rate (bench/device_telemetry.py)."""
MAX_WINDOW_S = 900.0  # ... but a window is closed after 15 minutes whatever the step time
_XID_EVENT, _CLOCK_SM, _CLOCK_MEM = XID_EVENT, CLOCK_SM, CLOCK_MEM
_TEMP_GPU = 0  # NVML_TEMPERATURE_GPU
_ECC_UNCORRECTED, _ECC_VOLATILE = 1, 0  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
_PCIE_TX, _PCIE_RX = PCIE_TX, PCIE_RX


def reason_names(mask: int) -> list[str]:
    """The reason names of an NVML clock-event bit mask, sorted, once each."""
    return sorted({name for bit, name in THROTTLE_REASONS.items() if mask & bit})


# --------------------------------------------------------------------------- the reader


@dataclass
class _Sample:
    t: float  # monotonic
    figures: dict[str, float]
    mask: int
    ecc: int | None
    pcie: tuple[float, float] | None
    processes: int | None


class NvmlReader:
    """Reads one device through an NVML-like module (``pynvml`` or :class:`FakeNvml`); calls that the
    device does not support are skipped from then on (no retry per sample)."""

    def __init__(self, nvml: Any, index: int | str) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        if isinstance(index, str):
            self.handle = nvml.nvmlDeviceGetHandleByUUID(index)
        else:
            self.handle = nvml.nvmlDeviceGetHandleByIndex(int(index))
        self.index = index
        self._off: set[str] = set()
        self._events: Any = None
        try:
            es = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self.handle, _XID_EVENT, es)
            self._events = es
        except Exception:  # noqa: BLE001 - no XID events on this device / driver
            self._events = None

    def _call(self, key: str, fn: str, *args: Any) -> Any:
        if key in self._off:
            return None
        try:
            return getattr(self.nvml, fn)(self.handle, *args)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: never asked again
            self._off.add(key)
            return None

    def sample(self) -> _Sample:
        """One reading of the device (host calls into the driver; no CUDA synchronisation)."""
        figs: dict[str, float] = {}
        v = self._call("sm", "nvmlDeviceGetClockInfo", _CLOCK_SM)
        if v is not None:
            figs["sm_clock_mhz"] = float(v)
        v = self._call("mem", "nvmlDeviceGetClockInfo", _CLOCK_MEM)
        if v is not None:
            figs["mem_clock_mhz"] = float(v)
        v = self._call("power", "nvmlDeviceGetPowerUsage")
        if v is not None:
            figs["power_w"] = float(v) / 1000.0
        v = self._call("limit", "nvmlDeviceGetEnforcedPowerLimit")
        if v is not None:
            figs["power_limit_w"] = float(v) / 1000.0
        v = self._call("temp", "nvmlDeviceGetTemperature", _TEMP_GPU)
        if v is not None:
            figs["temp_c"] = float(v)
        u = self._call("util", "nvmlDeviceGetUtilizationRates")
        if u is not None:
            figs["util"] = float(u.gpu) / 100.0
        m = self._call("memory", "nvmlDeviceGetMemoryInfo")
        if m is not None:
            figs["mem_used_bytes"] = float(m.used)
        mask = self._call("reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None and "reasons_old" not in self._off:  # drivers before 535 name it "throttle"
            mask = self._call("reasons_old", "nvmlDeviceGetCurrentClocksThrottleReasons")
        ecc = self._call("ecc", "nvmlDeviceGetTotalEccErrors", _ECC_UNCORRECTED, _ECC_VOLATILE)
        tx = self._call("pcie", "nvmlDeviceGetPcieThroughput", _PCIE_TX)
        rx = self._call("pcie", "nvmlDeviceGetPcieThroughput", _PCIE_RX) if tx is not None else None
        procs = self._call("procs", "nvmlDeviceGetComputeRunningProcesses")
        return _Sample(
            t=time.monotonic(), figures=figs, mask=int(mask or 0), ecc=int(ecc) if ecc is not None else None,
            pcie=(float(tx) * 1024.0, float(rx) * 1024.0) if tx is not None and rx is not None else None,
            processes=len(procs) if procs is not None else None,
        )

    def xids(self, limit: int = 64) -> list[int]:
        """XID codes raised since the last call (non-blocking: a zero timeout)."""
        out: list[int] = []
        if self._events is None:
            return out
        for _ in range(limit):
            try:
                ev = self.nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # noqa: BLE001 - NVML's timeout: nothing pending
                break
            if int(getattr(ev, "eventType", _XID_EVENT)) & _XID_EVENT:
                out.append(int(getattr(ev, "eventData", 0)))
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- aggregation


@dataclass
class Window:
    """The samples of one window, folded as they come (O(1) memory)."""

    start_wall: float
    start_mono: float
    samples: int = 0
    lo: dict[str, float] = field(default_factory=dict)
    hi: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    throttle_s: dict[str, float] = field(default_factory=dict)
    reasons: set[str] = field(default_factory=set)
    ecc_first: int | None = None
    ecc_last: int | None = None
    xid: list[int] = field(default_factory=list)
    xid_count: int = 0
    pcie_tx: float = 0.0
    pcie_rx: float = 0.0
    pcie_n: int = 0
    processes: int | None = None
    last_mono: float | None = None

    def add(self, s: _Sample, max_dt: float) -> None:
        """Fold one sample: figures to min/mean/max; each reason active in it is charged the time since
        the previous sample (at most ``max_dt``: a gap in sampling is not charged)."""
        self.samples += 1
        for k, v in s.figures.items():
            self.lo[k] = min(self.lo.get(k, v), v)
            self.hi[k] = max(self.hi.get(k, v), v)
            self.total[k] = self.total.get(k, 0.0) + v
            self.count[k] = self.count.get(k, 0) + 1
        names = reason_names(s.mask)
        self.reasons.update(names)
        dt = min(max(0.0, s.t - (self.last_mono if self.last_mono is not None else self.start_mono)), max_dt)
        for n in names:
            self.throttle_s[n] = self.throttle_s.get(n, 0.0) + dt
        self.last_mono = s.t
        if s.ecc is not None:
            self.ecc_first = s.ecc if self.ecc_first is None else self.ecc_first
            self.ecc_last = s.ecc
        if s.pcie is not None:
            self.pcie_tx += s.pcie[0]
            self.pcie_rx += s.pcie[1]
            self.pcie_n += 1
        if s.processes is not None:
            self.processes = max(self.processes or 0, s.processes)

    def add_xids(self, codes: list[int]) -> None:
        self.xid_count += len(codes)
        for c in codes:
            if c not in self.xid and len(self.xid) < MAX_XIDS:
                self.xid.append(c)

    def data(self, ecc_base: int | None, end_mono: float) -> dict[str, Any]:
        """The ``device`` event's data (docs/agent.md, "Device telemetry")."""
        out: dict[str, Any] = {"window_s": round(max(0.0, end_mono - self.start_mono), 3), "samples": self.samples}
        for k in FIGURES:
            if self.count.get(k):
                r = 0 if k == "mem_used_bytes" else 3
                out[k] = {"min": round(self.lo[k], r), "mean": round(self.total[k] / self.count[k], r),
                          "max": round(self.hi[k], r)}
        out["throttle"] = sorted(self.reasons)
        out["throttle_s"] = {k: round(v, 3) for k, v in sorted(self.throttle_s.items())}
        base = ecc_base if ecc_base is not None else self.ecc_first
        out["ecc_errors"] = max(0, (self.ecc_last or 0) - (base or 0)) if self.ecc_last is not None else None
        out["xid"] = list(self.xid)
        if self.xid_count > len(self.xid):
            out["xid_count"] = self.xid_count
        if self.pcie_n:
            out["pcie_tx_bytes_s"] = round(self.pcie_tx / self.pcie_n, 1)
            out["pcie_rx_bytes_s"] = round(self.pcie_rx / self.pcie_n, 1)
        if self.processes is not None:
            out["processes"] = self.processes
        return out


# --------------------------------------------------------------------------- the sampler


def _device_index(environ: Any = None) -> int | str:
    """The NVML device of this process: LOCAL_RANK through CUDA_VISIBLE_DEVICES (an index, or a UUID
    string when the list names devices by UUID), else 0. NVML ignores CUDA_VISIBLE_DEVICES, hence the mapping."""
    env = os.environ if environ is None else environ
    try:
        local = int(env.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        local = 0
    vis = [v.strip() for v in str(env.get("CUDA_VISIBLE_DEVICES", "")).split(",") if v.strip()]
    if not vis:
        return local
    pick = vis[local] if local < len(vis) else vis[0]
    return int(pick) if pick.isdigit() else pick


def open_reader(environ: Any = None) -> NvmlReader | None:
    """The reader of this process's device: the fake provider when ``FLEETSCOPE_FAKE_NVML`` names a
    script; else ``pynvml`` once this process uses CUDA; else None (quietly: no telemetry)."""
    env = os.environ if environ is None else environ
    idx = _device_index(env)
    fake = str(env.get("FLEETSCOPE_FAKE_NVML") or "").strip()
    try:
        if fake:
            return NvmlReader(FakeNvml.from_file(fake), idx)
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if cuda is None or not cuda.is_initialized():
            return None
        import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]  # the `nvml` extra

        return NvmlReader(pynvml, idx)
    except Exception as e:  # noqa: BLE001 - no extra, no driver, no such device: no telemetry
        log.debug("fleetscope: no device telemetry (%r)", e)
        return None


class Sampler:
    """Samples one device from the sender thread and returns a ``device`` event per window."""

    def __init__(self, run: Any, *, sample_s: float, window_s: float, reader: NvmlReader | None = None,
                 environ: Any = None, clock: Any = time.monotonic) -> None:
        self._run = weakref.ref(run) if run is not None else None
        self.sample_s = max(0.05, float(sample_s))
        self.window_s = max(self.sample_s, float(window_s))
        self._steps: deque[float] = deque(maxlen=32)  # the rank's recent step times (``observe``)
        self._env = environ
        self.reader = reader
        self._given = reader is not None
        self._pid = os.getpid()
        self._tries = 0
        self._next_try = 0.0
        self._last = -1e18
        self._clock = clock
        self._mark = clock()  # where the next window starts: install time, then the last window's end
        self._mark_wall = time.time()
        self._win: Window | None = None
        self._ecc_base: int | None = None
        self.samples = 0
        self.windows = 0
        self.errors = 0
        self.cost_ns = 0  # time spent sampling and folding (bench/device_telemetry.py)
        self._lock = threading.Lock()  # the sender thread vs the last window at finish

    def observe(self, items: list[tuple[str, Any]]) -> None:
        """Learn the rank's step times from the records the sender is about to send (``rank_step``: step_s at 2)."""
        for kind, rec in items:
            if kind == "rank_step":
                try:
                    self._steps.append(float(rec[2]))
                except (TypeError, ValueError, IndexError):
                    pass

    def current_window_s(self) -> float:
        """The window length now: ``window_s``, or ``STEPS_PER_WINDOW`` median steps when longer (≤ MAX_WINDOW_S)."""
        if not self._steps:
            return self.window_s
        st = sorted(self._steps)[len(self._steps) // 2]
        return max(self.window_s, min(MAX_WINDOW_S, STEPS_PER_WINDOW * st))

    def _open(self, mono: float) -> bool:
        """Open the reader when CUDA is in use (checked at most every 10 s, 60 times: a CPU job stops asking)."""
        if self.reader is not None:
            return True
        if self._given or self._tries >= 60 or mono < self._next_try:
            return False
        self._tries += 1
        self._next_try = mono + 10.0
        self.reader = open_reader(self._env)
        if self.reader is not None and self._tries > 1:  # a device seen late: its first window starts now
            self._mark, self._mark_wall = mono, time.time()
        return self.reader is not None

    def tick(self, now_mono: float | None = None, *, final: bool = False) -> dict[str, Any] | None:
        """Sample when due; the window's event once it is complete (or at ``final``, what it holds)."""
        run = self._run() if self._run is not None else None
        if os.getpid() != self._pid or (self._run is not None and run is None):
            return None
        mono = self._clock() if now_mono is None else now_mono
        if not self._open(mono):
            return None
        t0 = time.perf_counter_ns()
        try:
            with self._lock:
                ev = self._tick(run, mono, final)
        except Exception as e:  # noqa: BLE001 - the sender thread goes on
            self.errors += 1
            log.debug("fleetscope: device sample failed (%r)", e)
            ev = None
        self.cost_ns += time.perf_counter_ns() - t0
        return ev

    def _tick(self, run: Any, mono: float, final: bool) -> dict[str, Any] | None:
        reader = self.reader
        assert reader is not None
        if mono - self._last >= self.sample_s or final:
            s = reader.sample()
            s.t = mono
            if self._win is None:  # windows tile time: each starts where the last one ended
                self._win = Window(start_wall=self._mark_wall, start_mono=min(self._mark, mono))
            self._win.add(s, max_dt=3.0 * max(self.sample_s, _flush_s(run)))
            self._win.add_xids(reader.xids())
            self._last = mono
            self.samples += 1
        w = self._win
        if w is None or w.samples == 0 or (not final and mono - w.start_mono < self.current_window_s()):
            return None
        data = w.data(self._ecc_base, mono)
        data["device_index"] = reader.index if isinstance(reader.index, int) else str(reader.index)[:64]
        if w.ecc_last is not None:
            self._ecc_base = w.ecc_last
        self._win = None
        self._mark, self._mark_wall = mono, time.time()
        self.windows += 1
        step = None
        if run is not None:
            step = int(run._next_index - 1) if getattr(run, "_nsteps", 0) else None
        from .health import event

        ev = event(run, DEVICE_KIND, step, data, ts=w.start_wall) if run is not None else {
            "kind": DEVICE_KIND, "ts": w.start_wall, "step": step, "data": data}
        return ev


def _flush_s(run: Any) -> float:
    try:
        return float(run.config.flush_interval_s)
    except Exception:  # noqa: BLE001
        return 2.0


_SAMPLERS: weakref.WeakKeyDictionary[Any, Sampler] = weakref.WeakKeyDictionary()  # run -> its sampler


def install(run: Any, transport: Any) -> Sampler | None:
    """Chain a device sampler of ``run`` after whatever watches ``transport``'s sender thread (health.py's
    position watch): each cycle it may queue one ``device`` event; at close, the open window is sent."""
    if not hasattr(transport, "watch"):
        return None
    cfg = run.config
    if cfg.device_sample_s <= 0:
        return None
    s = Sampler(run, sample_s=cfg.device_sample_s, window_s=cfg.device_window_s)
    prev = transport.watch

    def watch() -> dict[str, Any] | None:
        ev = prev() if prev is not None else None
        dev = s.tick()
        if dev is not None:
            transport.submit("event", dev)  # on the sender thread: drained with the position, or next cycle
        return ev

    transport.watch = watch
    prev_obs = getattr(transport, "observe", None)

    def observe(items: list[tuple[str, Any]]) -> None:
        if prev_obs is not None:
            prev_obs(items)
        if s.reader is not None:
            s.observe(items)

    transport.observe = observe
    _SAMPLERS[run] = s
    return s


def flush_window(run: Any) -> None:
    """At finish (``Run.finish``, before the transport's last flush): queue the open window's event."""
    s = _SAMPLERS.get(run)
    if s is None or s.reader is None:
        return
    ev = s.tick(final=True)
    if ev is not None:
        run._tx.submit("event", ev)
