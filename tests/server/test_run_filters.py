"""Run filters through the real server (``GET /api/v1/runs``): config / meta keys with = != < > <= >= in,
tags (``init(tags=…)`` / FLEETSCOPE_TAGS and ``fleetscope run --tag``), commit prefix, time range,
figures and training scalars, sorting (``-mfu``), paging with a total, grouping with medians — all in
SQL — and a 422 naming a bad filter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleetscope.wire import RANK_STEP_FIELDS

_NAMES = [f.name for f in RANK_STEP_FIELDS]


def _steps(rank: int, n: int, step_s: float, flops: float) -> list[tuple]:
    rows = []
    for s in range(n):
        row: list[Any] = [None] * len(_NAMES)
        vals = {"rank": rank, "step": s, "step_s": step_s, "ts": 1.7e9 + s, "compute_s": step_s, "data_s": 0.0,
                "comm_exposed_s": 0.0, "other_s": 0.0, "tokens": 1000, "flops": flops, "flags": 0}
        for k, v in vals.items():
            row[_NAMES.index(k)] = v
        rows.append(tuple(row))
    return rows


def _ids(runs: list[dict[str, Any]]) -> list[str]:
    return [r["name"] for r in runs]


@pytest.fixture
def fleet(live_server: Any) -> dict[str, int]:
    """12 runs: tp × lr × seq_len configs, tags, commits, start times; three of them with steps."""
    ids: dict[str, int] = {}
    with live_server.client() as c:
        i = 0
        for tp in (1, 2, 4):
            for lr in (1e-4, 3e-4, 1e-3, 3e-3):
                name = f"r-tp{tp}-lr{lr}"
                tags = ["ablation"] if lr >= 1e-3 else ["baseline"]
                if tp == 4:
                    tags.append("big")
                ids[name] = c.register_run({
                    "name": name, "model_family": "llama" if tp < 4 else "vla", "world_size": 1, "peak_flops": 1e12,
                    "config": {"tp": tp, "lr": lr, "optim": {"name": "adam" if tp != 2 else "sgd"},
                               "seq_len": str(2048 * tp)},
                    "meta": {"tags": tags, "owner": "ana" if i % 2 else "bo"},
                    "git_commit": f"{'abc' if i < 6 else 'def'}{i:04d}ffff", "started_at": 1.7e9 + 3600 * i,
                })
                i += 1
        # figures: step time 0.5 / 1.0 / 2.0 s at the same FLOPs → MFU 0.8 / 0.4 / 0.2
        for name, step_s in (("r-tp1-lr0.0001", 0.5), ("r-tp2-lr0.0001", 1.0), ("r-tp4-lr0.0001", 2.0)):
            c.ingest_rows(ids[name], _steps(0, 6, step_s, 0.4e12))
        c.ingest({"v": 1, "run_id": ids["r-tp1-lr0.0001"], "events": [
            {"rank": 0, "seq": i, "kind": "scalars", "ts": 1.7e9, "step": i, "data": {"loss": 3.0 - i}} for i in range(3)]},
            fmt="json")
        c.ingest({"v": 1, "run_id": ids["r-tp2-lr0.0001"], "events": [
            {"rank": 0, "seq": 0, "kind": "scalars", "ts": 1.7e9, "step": 0, "data": {"loss": 0.5}}]}, fmt="json")
    live_server.compact()
    return ids


def _get(live_server: Any, params: Any) -> dict[str, Any]:
    with live_server.client() as c:
        r = c.http.get("/api/v1/runs", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_config_filters_with_each_operator(live_server: Any, fleet: dict[str, int]) -> None:
    def names(qs: str) -> set[str]:
        with live_server.client() as c:
            r = c.http.get("/api/v1/runs?" + qs + "&limit=100")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["total"] == len(body["runs"])
        return set(_ids(body["runs"]))

    assert names("config.tp=4") == {f"r-tp4-lr{lr}" for lr in (1e-4, 3e-4, 1e-3, 3e-3)}
    assert names("config.tp!=4") == {n for n in fleet if not n.startswith("r-tp4")}
    assert names("config.lr>0.001") == {f"r-tp{t}-lr0.003" for t in (1, 2, 4)}
    assert names("config.lr>=0.001") == {f"r-tp{t}-lr{lr}" for t in (1, 2, 4) for lr in (0.001, 0.003)}
    assert names("config.lr<0.0002") == {f"r-tp{t}-lr0.0001" for t in (1, 2, 4)}
    assert names("config.lr=gt:0.001&config.tp=in:1,2") == {"r-tp1-lr0.003", "r-tp2-lr0.003"}
    assert names("config.tp=in:2,4&config.lr=le:0.0001") == {"r-tp2-lr0.0001", "r-tp4-lr0.0001"}
    # a nested key; a string value; "4096" matches the string config value, 4096 too
    assert names("config.optim.name=sgd") == {f"r-tp2-lr{lr}" for lr in (1e-4, 3e-4, 1e-3, 3e-3)}
    assert names("config.seq_len=4096") == names("config.seq_len=%224096%22") == names("config.tp=2")
    assert names("meta.owner=ana&config.tp=1") == {"r-tp1-lr0.0003", "r-tp1-lr0.003"}
    # tags (all of them), commit prefix, time range, family
    assert names("tag=big&tag=ablation") == {"r-tp4-lr0.001", "r-tp4-lr0.003"}
    assert names("tag=in:big,baseline") == {n for n in fleet if "tp4" in n or "lr0.0001" in n or "lr0.0003" in n}
    assert names("commit=abc") == set(list(fleet)[:6])
    assert names(f"since={1.7e9 + 3600 * 10}") == set(list(fleet)[10:])
    assert names("until=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1.7e9 + 3600 * 2)) + "Z") == set(list(fleet)[:2])
    assert names("family=vla") == names("config.tp=4")
    # a figure and a scalar
    assert names("mfu>0.3") == {"r-tp1-lr0.0001", "r-tp2-lr0.0001"}
    assert names("scalar.loss.min<0.8") == {"r-tp2-lr0.0001"}


def test_sort_by_a_figure_a_config_key_and_a_scalar_with_paging(live_server: Any, fleet: dict[str, int]) -> None:
    body = _get(live_server, {"sort": "-mfu", "limit": 3, "figures": "true", "columns": "config.tp,scalar.loss.last"})
    assert body["total"] == 12 and body["offset"] == 0 and body["limit"] == 3
    assert _ids(body["runs"]) == ["r-tp1-lr0.0001", "r-tp2-lr0.0001", "r-tp4-lr0.0001"]
    mfus = [r["figures"]["mfu"] for r in body["runs"]]
    assert mfus == pytest.approx([0.8, 0.4, 0.2])
    with live_server.client() as c:  # the same numbers as the summary
        assert [c.summary(r["id"])["mfu"] for r in body["runs"]] == pytest.approx(mfus)
    assert [r["columns"] for r in body["runs"]] == [{"config.tp": 1, "scalar.loss.last": 1.0},
                                                    {"config.tp": 2, "scalar.loss.last": 0.5},
                                                    {"config.tp": 4, "scalar.loss.last": None}]
    # by a config key (numbers as numbers), then pages of it
    first = _get(live_server, {"sort": "-config.lr,config.tp", "limit": 5})
    second = _get(live_server, {"sort": "-config.lr,config.tp", "limit": 5, "offset": 5})
    order = _ids(first["runs"]) + _ids(second["runs"])
    assert order[:4] == ["r-tp1-lr0.003", "r-tp2-lr0.003", "r-tp4-lr0.003", "r-tp1-lr0.001"]
    assert len(set(order)) == 10 and second["total"] == 12
    assert _ids(_get(live_server, {"sort": "scalar.loss.last", "limit": 2})["runs"]) == ["r-tp2-lr0.0001", "r-tp1-lr0.0001"]


def test_group_by_one_and_two_keys_with_count_and_medians(live_server: Any, fleet: dict[str, int]) -> None:
    body = _get(live_server, {"group_by": "config.tp"})
    groups = {g["config.tp"]: g for g in body["groups"]}
    assert set(groups) == {1, 2, 4} and all(g["count"] == 4 for g in groups.values())
    assert groups[1]["median_mfu"] == pytest.approx(0.8) and groups[4]["median_step_s"] == pytest.approx(2.0)
    two = _get(live_server, {"group_by": "config.tp,config.optim.name", "config.lr": "ge:0.001"})
    assert {(g["config.tp"], g["config.optim.name"], g["count"]) for g in two["groups"]} == {
        (1, "adam", 2), (2, "sgd", 2), (4, "adam", 2)}
    assert two["total"] == 6


@pytest.mark.parametrize(("qs", "says"), [
    ("config.=4", "bad key"),
    ("colour=red", "unknown field 'colour'"),
    ("mfu>high", "takes a number"),
    ("since=yesterday", "not a time"),
    ("sort=-nonsense", "unknown field"),
    ("group_by=config.a,config.b,config.c", "one or two keys"),
    ("group_by=mfu", "cannot group by"),
    ("offset=-1", "offset"),
])
def test_a_bad_filter_is_a_422_naming_it(live_server: Any, qs: str, says: str) -> None:
    with live_server.client() as c:
        r = c.http.get("/api/v1/runs?" + qs)
    assert r.status_code == 422, r.text
    assert says in r.text


def test_tags_from_init_the_environment_and_fleetscope_run(live_server: Any, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env.update(FLEETSCOPE_SERVER=live_server.url, FLEETSCOPE_TOKEN=live_server.token, OMP_NUM_THREADS="1",
               FLEETSCOPE_SPOOL_DIR=str(tmp_path / "spool"), FLEETSCOPE_TAGS="from-env")
    job = ("import fleetscope.agent as fs\nrun = fs.init('tagged', tags=['a', 'b', 'a'])\n"
           "with run.step(tokens=1):\n    pass\nrun.finish()\n")
    p = subprocess.run([sys.executable, "-c", job], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n    opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()\n")
    p = subprocess.run([sys.executable, "-m", "fleetscope", "run", "--name", "cli-tagged", "--tag", "sweep-7", "--tag",
                        "lr-scan", "--", sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    body = _get(live_server, {"tag": "from-env", "sort": "name"})
    assert _ids(body["runs"]) == ["cli-tagged", "tagged"]
    tags = {r["name"]: r["meta"]["tags"] for r in body["runs"]}
    assert tags == {"tagged": ["a", "b", "from-env"], "cli-tagged": ["from-env", "sweep-7", "lr-scan"]}
    assert _ids(_get(live_server, {"tag": "sweep-7"})["runs"]) == ["cli-tagged"]
