"""Training scalars (``run.log``): loss, learning rate, grad norm, user metrics, at the cost of a step.

``log_scalars(run, metrics, step)`` runs on the training thread: it copies the finite numbers of
``metrics`` into a new dict and submits it as one ``scalars`` event (the transport's queue: no I/O,
no device work). Bounded: at most ``MAX_SCALAR_NAMES`` distinct names per run (later new names are
dropped and counted), names of 1..``MAX_SCALAR_NAME_CHARS`` characters. Values that are not finite
real numbers (NaN, inf, strings, None, device tensors, booleans) are dropped and counted — never
raised into the loop, never synchronised (a CUDA tensor would need ``.item()``: dropped, counted as
``scalars_on_device``; a CPU tensor of one element and numpy scalars are read).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["log_scalars", "MAX_SCALAR_NAMES", "MAX_SCALAR_NAME_CHARS", "SCALARS_KIND"]

#: distinct scalar names one run keeps (the server's MAX_SCALAR_NAMES_PER_RUN is the same)
MAX_SCALAR_NAMES = 256
#: characters of one scalar name
MAX_SCALAR_NAME_CHARS = 128
SCALARS_KIND = "scalars"

_INF = math.inf


def _coerce(v: Any, counters: dict[str, int]) -> float | None:
    """A value that is not a plain int/float: a finite float, or None (dropped)."""
    t = type(v)
    if t is bool or v is None or t is str:
        return None
    mod = t.__module__
    if mod == "torch":  # a tensor: read it only when that costs no device sync
        try:
            if v.numel() != 1 or v.device.type != "cpu" or v.is_complex():
                if v.device.type != "cpu":
                    counters["scalars_on_device"] = counters.get("scalars_on_device", 0) + 1
                return None
            f = float(v.item())
        except Exception:  # noqa: BLE001
            return None
    elif mod == "numpy":
        try:
            if getattr(v, "size", 1) != 1 or v.dtype.kind not in "iuf":
                return None
            f = float(v)
        except Exception:  # noqa: BLE001
            return None
    else:
        return None
    return f if -_INF < f < _INF else None


def log_scalars(run: Any, metrics: Any, step: int | None) -> None:
    """``Run.log``: submit the finite numbers of ``metrics`` as one ``scalars`` event of ``step`` (None:
    the step in progress, else the last finished one). Never raises."""
    try:
        if run._closed:
            return
        counters = run.counters
        names: set[str] = run._scalar_names
        data: dict[str, float] = {}
        bad = 0
        for k, v in metrics.items():
            t = type(v)
            if t is float:
                if not -_INF < v < _INF:
                    bad += 1
                    continue
            elif t is int:
                try:
                    v = float(v)
                except OverflowError:
                    bad += 1
                    continue
            else:
                v = _coerce(v, counters)
                if v is None:
                    bad += 1
                    continue
            if k not in names:
                if type(k) is not str or not 0 < len(k) <= MAX_SCALAR_NAME_CHARS or len(names) >= MAX_SCALAR_NAMES:
                    counters["scalars_dropped_names"] = counters.get("scalars_dropped_names", 0) + 1
                    continue
                names.add(k)
            data[k] = v
        if bad:
            counters["scalars_dropped_values"] = counters.get("scalars_dropped_values", 0) + bad
        if not data:
            return
        if step is None:
            st = run._step
            if st is not None:
                step = st.index
            else:
                step = run._next_index - 1 if run._nsteps else run._next_index
        elif type(step) is not int or step < 0:
            counters["scalars_dropped_values"] = counters.get("scalars_dropped_values", 0) + len(data)
            return
        counters["scalars_logged"] = counters.get("scalars_logged", 0) + len(data)
        run._event(SCALARS_KIND, step, data)
    except Exception as e:  # noqa: BLE001 - never into the training loop
        try:
            run._error("log", e)
        except Exception:  # noqa: BLE001
            pass
