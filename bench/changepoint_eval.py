"""Change-point detector evaluation: F1 with a 5-point margin (TCPD, van den Burg & Williams 2020) on a
labelled synthetic set, and false alerts per 1,000 points on stationary CV-5 % series.

    python bench/changepoint_eval.py [--tcpd DIR]

The detector is ``fleetscope.changepoint`` with its one default configuration (the
one that raises alerts and that ``fleetscope detect`` uses); nothing here tunes it. The "zero"
baseline (no change point) is scored side by side. ``--tcpd DIR`` also scores the univariate series of
the TCPD data set (github.com/alan-turing-institute/TCPD: ``annotations.json`` and the dataset
``*.json`` files in DIR) — an external check, never used to choose the configuration.
Prints ``name: value unit`` lines last (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpeval import f1_margin, labelled_set, stationary_set  # noqa: E402  (bench/cpeval.py, next to this script)

from fleetscope.changepoint import DEFAULT, change_points  # noqa: E402


def _tcpd(directory: Path) -> list[tuple[str, np.ndarray, dict]]:
    ann = json.loads((directory / "annotations.json").read_text())
    out = []
    for name, a in sorted(ann.items()):
        f = directory / f"{name}.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        if d.get("n_dim") != 1:
            continue
        x = np.array([np.nan if v is None else v for v in d["series"][0]["raw"]], dtype=np.float64)
        out.append((name, x, a))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tcpd", type=Path, default=None, help="directory with TCPD annotations.json + datasets")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    figures: list[tuple[str, float, str]] = []

    t0 = time.perf_counter()
    series = labelled_set()
    by_shape: dict[str, list[float]] = defaultdict(list)
    zero: list[float] = []
    n_points = 0
    for s in series:
        pred = change_points(s.values)
        by_shape[s.shape].append(f1_margin(s.cps, pred))
        zero.append(f1_margin(s.cps, []))
        n_points += len(s.values)
        if args.verbose:
            print(f"{s.name}: truth {list(s.cps)} predicted {pred}", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    for shape, v in by_shape.items():
        print(f"  {shape:14s} F1 {np.mean(v):.3f} ({len(v)} series)", file=sys.stderr)
    f1 = float(np.mean([v for vs in by_shape.values() for v in vs]))
    figures.append(("changepoint_f1_margin5", f1, "F1"))
    figures.append(("changepoint_f1_zero_baseline", float(np.mean(zero)), "F1"))
    figures.append(("changepoint_labelled_series", float(len(series)), "series"))
    figures.append(("changepoint_time_per_1000_points", elapsed / n_points * 1000 * 1e3, "ms"))

    stat = stationary_set()
    false = sum(len(change_points(x)) for x in stat)
    pts = sum(len(x) for x in stat)
    figures.append(("false_alerts_per_1000_points_cv5", false / pts * 1000, "alerts"))
    long = stationary_set(seed=12, n_series=10, length=2000)
    false_long = sum(len(change_points(x)) for x in long)
    figures.append(("false_alerts_per_1000_points_cv5_len2000", false_long / (10 * 2000) * 1000, "alerts"))

    if args.tcpd is not None:
        rows = _tcpd(args.tcpd)
        f = [f1_margin(a, change_points(x)) for _, x, a in rows]
        z = [f1_margin(a, []) for _, x, a in rows]
        if args.verbose:
            for (name, _, _), fi, zi in zip(rows, f, z, strict=True):
                print(f"  tcpd {name:22s} F1 {fi:.3f} zero {zi:.3f}", file=sys.stderr)
        figures.append(("tcpd_univariate_f1_default", float(np.mean(f)), "F1"))
        figures.append(("tcpd_univariate_f1_zero_baseline", float(np.mean(z)), "F1"))
        figures.append(("tcpd_univariate_series", float(len(rows)), "series"))

    print(f"detector: {DEFAULT}", file=sys.stderr)
    for name, value, unit in figures:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
