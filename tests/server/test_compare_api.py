"""Normalised comparison (`GET /api/v1/compare`, `Client.compare`): per (active) parameter, per sample and per
modality throughput from what the runs recorded, Δ judged only within the first run's family; bad input
is a 422 naming `runs`. Real server over HTTP, real Postgres, data through the real ingest."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from dash_util import load

from fleetscope.synthetic import RunSpec, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS


def _samples_per_token(spec: RunSpec) -> float:
    names = [f.name for f in RANK_STEP_FIELDS]
    i_tok, i_smp = names.index("tokens"), names.index("samples")
    tok = smp = 0
    for _step, rows in rank_step_rows(spec):
        tok += sum(r[i_tok] for r in rows)
        smp += sum(r[i_smp] for r in rows)
    return smp / tok


def test_compare_gives_per_parameter_per_sample_and_per_modality_throughput(live_server: Any) -> None:
    vla = RunSpec(name="vla", family="vla-7b", world_size=4, steps=6, seed=1)
    a = load(live_server, vla, modalities=True)
    b = load(live_server, RunSpec(name="vit", family="vit-h", world_size=4, steps=6, seed=2))
    # a mixture of experts: 47B parameters, 13B active per token (as fs.init(params=, active_params=) records them)
    moe = RunSpec(name="moe", family="vla-7b", world_size=4, steps=6, seed=3)
    c = load(live_server, moe, meta={"params": 47e9, "active_params": 13e9, "params_source": "given"})

    r = httpx.get(f"{live_server.url}/api/v1/compare", params={"runs": f"{a},{b},{c},999999"}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    runs = {x["name"]: x for x in doc["runs"]}
    assert [x["name"] for x in doc["runs"]] == ["vla", "vit", "moe"] and doc["missing"] == [999999]

    v = runs["vla"]
    assert v["params"] == v["active_params"] == 7e9
    assert v["param_tokens_per_s_per_gpu"] == pytest.approx(v["tokens_per_s_per_gpu"] * 7e9, rel=1e-9)
    assert v["samples_per_s_per_gpu"] == pytest.approx(v["tokens_per_s_per_gpu"] * _samples_per_token(vla), rel=1e-6)
    # per modality: 1000 / 2000 / 3000 tokens of vision / text / action per rank-step
    mods = v["modality_tokens_per_s"]
    assert set(mods) == {"vision", "text", "action"}
    assert mods["action"] == pytest.approx(3 * mods["vision"], rel=1e-9)
    assert sum(mods.values()) == pytest.approx(v["tokens_per_s"], rel=1e-9)
    assert runs["vit"]["modality_tokens_per_s"] is None  # it recorded no per-modality counts

    # MoE: the per-parameter figure counts the active parameters, not all 47B
    m = runs["moe"]
    assert m["params"] == 47e9 and m["active_params"] == 13e9
    assert m["param_tokens_per_s_per_gpu"] == pytest.approx(m["tokens_per_s_per_gpu"] * 13e9, rel=1e-9)
    assert [x["same_family"] for x in doc["runs"]] == [True, False, True]
    rel = doc["relative_to_first"]["param_tokens_per_s_per_gpu"]
    assert rel[0] == 1.0 and rel[1] == pytest.approx(runs["vit"]["param_tokens_per_s_per_gpu"]
                                                     / v["param_tokens_per_s_per_gpu"])

    with live_server.client() as cl:
        assert [x["id"] for x in cl.compare([a, c])["runs"]] == [a, c]
    for bad, word in (("abc", "'abc' is not a run id"), (",", "at least one run id"),
                      (",".join(str(i) for i in range(1, 40)), "at most")):
        r = httpx.get(f"{live_server.url}/api/v1/compare", params={"runs": bad}, timeout=30)
        assert r.status_code == 422 and "runs" in r.text and word in r.text, r.text
