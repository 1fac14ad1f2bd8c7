"""The notebook client (``fleetscope.client.Client``) against a live server: ``.runs`` is a DataFrame
with one ``config.KEY`` column per config key and the figures the summary shows, filtered and paged
by the server; ``.steps`` is one row per step (every page) with the same step times as the run page's
series; ``.scalars``, ``.collectives``, ``.alerts``, ``.nodes``, ``.run_groups``; without pandas a clear
ImportError; the dict methods the CLI uses keep working."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pandas as pd
import pytest
from fleetscope.server import reports

from fleetscope.wire import RANK_STEP_FIELDS

_NAMES = [f.name for f in RANK_STEP_FIELDS]


def _rows(ranks: int, steps: int, step_s: float) -> list[tuple]:
    out = []
    for s in range(steps):
        for r in range(ranks):
            row: list[Any] = [None] * len(_NAMES)
            vals = {"rank": r, "step": s, "step_s": step_s * (1 + 0.01 * s), "ts": 1.7e9 + s, "compute_s": step_s * 0.7,
                    "data_s": step_s * 0.1, "comm_exposed_s": step_s * 0.2, "other_s": step_s * 0.01 * s,
                    "tokens": 512, "flops": 1e11, "flags": 0}
            for k, v in vals.items():
                row[_NAMES.index(k)] = v
            out.append(tuple(row))
    return out


def test_client_dataframes_match_the_api_and_the_pages(live_server: Any) -> None:
    with live_server.client() as c:
        ids = []
        for i in range(5):
            ids.append(c.register_run({"name": f"nb-{i}", "model_family": "gpt", "world_size": 2, "peak_flops": 1e12,
                                       "config": {"tp": 1 + i % 2, "lr": 1e-4 * (i + 1), "opt": {"beta1": 0.9}},
                                       "meta": {"tags": ["nb"] + (["odd"] if i % 2 else [])}}))
        c.ingest_rows(ids[0], _rows(2, 1_205, 0.25))  # more steps than one page
        c.ingest_rows(ids[1], _rows(2, 10, 0.5))
        c.ingest({"v": 1, "run_id": ids[0], "events": [
            {"rank": 0, "seq": i, "kind": "scalars", "ts": 1.7e9, "step": i, "data": {"loss": 5.0 - i / 100, "lr": 1e-4}}
            for i in range(300)]})
        live_server.compact()

        df = c.runs(page_size=2)  # three pages
        assert isinstance(df, pd.DataFrame) and len(df) == 5
        assert {"config.tp", "config.lr", "config.opt.beta1", "mfu", "step_s", "tokens_per_s", "tags"} <= set(df.columns)
        row = df.set_index("name").loc["nb-0"]
        summary = c.summary(ids[0])
        assert row["mfu"] == pytest.approx(summary["mfu"]) and row["step_s"] == pytest.approx(summary["step_s_p50"])
        assert row["config.tp"] == 1 and row["config.opt.beta1"] == 0.9 and row["tags"] == ["nb"]

        odd = c.runs({"config.tp": 2, "config.lr>": 1e-4}, tag="odd", sort="-config.lr")
        assert list(odd["name"]) == ["nb-3", "nb-1"]
        assert list(c.runs({"config.lr": ("in", [1e-4, 5e-4])}, sort="name")["name"]) == ["nb-0", "nb-4"]
        with_loss = c.runs(columns=["scalar.loss.last", "scalar.loss.min"], sort="name", limit=2)
        assert list(with_loss["scalar.loss.last"])[0] == pytest.approx(5.0 - 299 / 100) and len(with_loss) == 2
        groups = c.run_groups("config.tp")
        assert sorted(zip(groups["config.tp"], groups["count"], strict=True)) == [(1, 3), (2, 2)]

        steps = c.steps(ids[0], page_size=500)
        assert list(steps["step"]) == list(range(1_205))
        assert {"step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "straggler_wait_s", "mfu",
                "tokens_per_s"} <= set(steps.columns)
        series = reports.run_series(live_server.state.engine, ids[0], max_points=5_000)  # what the run page draws
        page = dict(zip(series["step_s"].x.tolist(), series["step_s"].y.tolist(), strict=True))
        assert steps.set_index("step")["step_s"].loc[list(page)].tolist() == pytest.approx(list(page.values()))
        assert steps["tokens_per_s"].iloc[0] == pytest.approx(1024 / 0.25)

        sc = c.scalars(ids[0])
        assert list(sc.columns) == ["name", "step", "value"] and len(sc) == 600
        assert sc[sc.name == "loss"]["value"].iloc[-1] == pytest.approx(5.0 - 299 / 100)
        assert c.collectives(ids[0]).empty
        assert isinstance(c.alerts(), pd.DataFrame) and isinstance(c.nodes(), pd.DataFrame)

        # the dict method the CLI uses keeps working
        assert [r["name"] for r in c.run_list(name="nb-2")] == ["nb-2"]


def test_without_pandas_the_dataframe_reads_say_what_to_install(live_server: Any) -> None:
    code = (
        "import sys; sys.modules['pandas'] = None\n"
        "from fleetscope.client import Client\n"
        f"c = Client({live_server.url!r}, {live_server.token!r})\n"
        "print(len(c.run_list()))\n"
        "try:\n    c.runs()\nexcept ImportError as e:\n    print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "pip install 'fleetscope[client]'" in p.stdout and p.stdout.startswith("0\n")
