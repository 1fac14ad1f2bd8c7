"""Regenerate ``hta_expected.json`` from HTA's printed tables (not a test; run by hand).

    python tests/traces/make_hta_expected.py shared/data/kineto/HTA_REFERENCE.md [HTA_OUTPUT.txt ...]

The first argument is HTA_REFERENCE.md (HTA 0.5.0 = 0.6.1 output, default mode for all three tables,
temporal + overlap for include_last_profiler_step=True). Further arguments are outputs of the same
``run_hta.py`` driver (printed in HTA_REFERENCE.md) run with ``last``: they add the idle-time table
for include_last_profiler_step=True, which HTA_REFERENCE.md does not print.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

HEADER = re.compile(r"trace_dir \S*?(hta_[a-z0-9_]+) include_last_profiler_step (True|False)")


def _tables(block: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## get_temporal_breakdown"):
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip():
                f = lines[i].split()
                rows.append({
                    "rank": int(f[1]), "idle_time_us": float(f[2]), "compute_time_us": float(f[3]),
                    "non_compute_time_us": float(f[4]), "kernel_time_us": float(f[5]), "idle_pct": float(f[6]),
                    "compute_pct": float(f[7]), "non_compute_pct": float(f[8]),
                })  # fmt: skip
                i += 1
            out["temporal"] = rows
        elif line.startswith("## get_comm_comp_overlap"):
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip():
                f = lines[i].split()
                rows.append({"rank": int(f[1]), "comm_overlap_pct": None if f[2] == "NaN" else float(f[2])})
                i += 1
            out["overlap"] = rows
        elif line.startswith("## get_idle_time_breakdown"):
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip():
                f = lines[i].split()
                rows.append({
                    "rank": int(f[1]), "stream": int(f[2]), "idle_category": f[3], "idle_time_us": float(f[4]),
                    "idle_time_ratio": None if f[5] == "NaN" else float(f[5]),
                })  # fmt: skip
                i += 1
            out["idle"] = rows
        elif line.startswith("### idle interval stats"):
            rows = []
            i += 3
            while i < len(lines) and lines[i].strip() and not lines[i].startswith("#"):
                f = lines[i].split()
                nums = [None if x == "NaN" else float(x) for x in f[4:]]
                rows.append({
                    "rank": int(f[1]), "stream": int(f[2]), "idle_category": f[0], "count": int(float(f[3])),
                    **dict(zip(["mean", "std", "min", "p25", "p50", "p75", "max"], nums, strict=True)),
                })  # fmt: skip
                i += 1
            out["idle_stats"] = rows
        elif line.startswith("## get_gpu_kernel_breakdown"):
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip():
                m = re.match(r"^\s*\d+\s+(.*?)\s+(\d+)\s+([\d.]+)$", lines[i])
                if m:
                    rows.append(
                        {
                            "kernel_type": m.group(1),
                            "time_us": float(m.group(2)),
                            "percentage": float(m.group(3)),
                        }
                    )
                i += 1
            out["kernel_types"] = rows
        elif line.startswith("### per-kernel"):
            rows = []
            i += 2
            num = r"([-\d.e+]+)"
            pat = re.compile(
                rf"^\s*\d+\s+(.*?)\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s+(COMPUTATION|COMMUNICATION|MEMORY)\s+(\d+)$"
            )
            while i < len(lines) and lines[i].strip():
                m = pat.match(lines[i])
                if m:
                    rows.append(
                        {
                            "name70": m.group(1),
                            "sum_us": float(m.group(2)),
                            "kernel_type": m.group(7),
                            "rank": int(m.group(8)),
                        }
                    )
                i += 1
            out["top_kernels_5"] = rows
        i += 1
    return out


def parse(text: str) -> dict[str, dict[str, Any]]:
    """{"<set>/<default|last>": tables} from every ```text block that starts with HTA's header line."""
    found: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.S) or [text]:
        m = HEADER.search(block)
        if not m:
            continue
        key = f"{m.group(1)}/{'last' if m.group(2) == 'True' else 'default'}"
        found.setdefault(key, {}).update(_tables(block))
    return found


def main(argv: list[str]) -> None:
    ref = Path(argv[0])
    data = parse(ref.read_text())
    extra_keys = []
    for extra in argv[1:]:
        for key, tables in parse(Path(extra).read_text()).items():
            for name, rows in tables.items():
                if name not in data.setdefault(key, {}):
                    data[key][name] = rows
                    extra_keys.append(f"{key}:{name}")
    out = {
        "_source": (
            "Parsed from shared/data/kineto/HTA_REFERENCE.md (HTA 0.5.0 and 0.6.1 print identical tables) by "
            "tests/traces/make_hta_expected.py. Units: µs and percentage points as HTA prints them."
        ),
        "_supplement": (
            "Tables not printed in HTA_REFERENCE.md, produced with the same run_hta.py driver and traceinsight 0.6.1 "
            f"(HTA 0.6.1, pandas 3.1.1, numpy 2.4.6) on the same files: {sorted(extra_keys)}"
        ),
        "sets": data,
    }
    Path(__file__).with_name("hta_expected.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
