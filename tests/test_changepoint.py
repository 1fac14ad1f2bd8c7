"""The change-point detector on series with known answers, the TCPD F1 metric, and `fleetscope detect`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetscope.changepoint import DEFAULT, DetectorConfig, change_points, detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cpeval import f1_margin, stationary_set  # noqa: E402  (bench/cpeval.py: the evaluation harness)


def _series(levels: list[tuple[int, float]], cv: float = 0.03, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.full(n, lvl) for n, lvl in levels])
    return x + rng.normal(0, cv * 100, len(x))


def test_f1_follows_the_tcpd_definition() -> None:
    # the worked examples of van den Burg & Williams (2020), index 0 counted in both sets
    assert f1_margin({1: [10, 20], 2: [11, 20], 3: [10], 4: [0, 5]}, [10, 20]) == 1.0
    assert f1_margin({1: [], 2: [10], 3: [50]}, [10]) == pytest.approx(0.9090909090909091)
    assert f1_margin({1: [], 2: [10], 3: [50]}, []) == pytest.approx(0.8)
    assert f1_margin([], []) == 1.0 and f1_margin([30], [33]) == 1.0 and f1_margin([30], [36]) < 1.0


def _hits(cps: list[int], expected: list[int]) -> bool:
    return len(cps) == len(expected) and all(abs(a - b) <= 5 for a, b in zip(cps, expected, strict=True))


@pytest.mark.parametrize(
    ("levels", "expected"),
    [
        ([(60, 100), (60, 115)], [60]),  # step up (a slower step time), 5 noise σ
        ([(80, 100), (40, 88)], [80]),  # step down
        ([(50, 100), (50, 120), (50, 100), (50, 135)], [50, 100, 150]),  # several changes
    ],
)
def test_known_change_points_are_found_within_the_margin(levels: list[tuple[int, float]], expected: list[int]) -> None:
    # noise is random: over 10 independent series, nearly all are exactly right (none missed, none extra)
    exact = sum(_hits(change_points(_series(levels, seed=s)), expected) for s in range(10))
    assert exact >= 9


def test_outliers_and_a_slow_trend_are_not_change_points() -> None:
    for seed in range(10):
        x = _series([(200, 100)], seed=seed)
        x[[20, 77, 78, 150]] += 60  # 20 σ spikes, two of them adjacent
        assert change_points(x) == []
    # a drift of 2 noise σ over the series is hard to tell from a small step; most series stay quiet
    quiet = sum(change_points(_series([(200, 100)], seed=s) + np.linspace(0, 6, 200)) == [] for s in range(10))
    assert quiet >= 6
    # a step inside a steady trend is found at its own place
    found = sum(100 in range(*(lambda c: (c - 5, c + 6))(c)) for s in range(10)
                for c in change_points(_series([(100, 100), (100, 115)], cv=0.02, seed=s) + np.linspace(0, 4, 200)))
    assert found >= 9


def test_stationary_cv5_series_raise_at_most_one_false_alert_per_1000_points() -> None:
    series = stationary_set(seed=99, n_series=60, length=100)
    false = sum(len(change_points(x)) for x in series)
    assert false / (60 * 100) * 1000 <= 1.0


def test_change_points_carry_levels_and_significance_and_degenerate_inputs_are_safe() -> None:
    (cp,) = detect(_series([(50, 100), (50, 120)], cv=0.01, seed=1))
    assert cp.index == 50 and cp.before == pytest.approx(100, rel=0.02) and cp.after == pytest.approx(120, rel=0.02)
    assert cp.p_value <= DEFAULT.alpha and cp.change == pytest.approx(0.2, abs=0.02) and cp.effect > 5
    assert change_points([]) == [] and change_points([1.0, 2.0]) == [] and change_points([3.0] * 50) == []
    with_nan = [1.0] * 20 + [float("nan")] + [2.0] * 20
    assert change_points(with_nan) == [21]  # indices refer to the input, NaN included
    assert change_points([1.0] * 10 + [2.0] * 10) == [10]
    with pytest.raises(ValueError, match="alpha"):
        DetectorConfig(alpha=2.0)


def test_detector_is_deterministic() -> None:
    x = _series([(40, 100), (40, 104)], seed=8)
    assert change_points(x) == change_points(x.copy())


def _detect_cli(stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetscope", "detect", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_detect_command_prints_change_points_from_a_file_or_stdin(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = _series([(40, 100), (30, 130), (40, 100)], seed=2).round(3).tolist()
    f = tmp_path / "series.json"
    f.write_text(json.dumps(x))
    out = _detect_cli("", str(f))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["change_points"]
    assert got == change_points(x) and len(got) == 2 and abs(got[0] - 40) <= 5 and abs(got[1] - 70) <= 5
    assert json.loads(_detect_cli(json.dumps(x)).stdout) == {"change_points": got}
    bad = _detect_cli('{"not": "a list"}')
    assert bad.returncode == 2 and "JSON array" in bad.stderr
    # the same command in-process for the remaining cases (no interpreter start-up each)
    from typer.testing import CliRunner

    from fleetscope.cli import app

    runner = CliRunner()
    assert json.loads(runner.invoke(app, ["detect", "-"], input="[1, 2, null, 3]").stdout) == {"change_points": []}
    assert runner.invoke(app, ["detect", str(tmp_path / "missing.json")]).exit_code == 2
    assert runner.invoke(app, ["detect", "-"], input='[1, "a"]').exit_code == 2


def test_detect_needs_nothing_of_the_server() -> None:
    """The detector and `fleetscope detect` / `check` / `bench` live outside the server package."""
    code = ("import sys, fleetscope.changepoint, fleetscope.analysis_cli; "
            "bad = sorted(m for m in sys.modules if m.startswith(('fleetscope.server', 'sqlalchemy', 'psycopg'))); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
