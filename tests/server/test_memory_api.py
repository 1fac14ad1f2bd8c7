"""Memory per module and the checkpointing advice: the advice algorithm (server/analysis/checkpointing.py)
against brute force on small module trees, its price and its reverse, and ``GET /api/v1/runs/{id}/memory``
(the shape outside checks rely on) from stored ``memory_modules`` events through the real server."""

from __future__ import annotations

import itertools
import random
from typing import Any

import httpx
import pytest
from fleetscope.server.analysis import checkpointing as ck

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
MB = 1 << 20


def _row(name: str, act: float = 0.0, flops: float | None = 0.0, inp: float | None = 0.0, checkpointed: bool = False,
         ckpt_saved: float = 0.0, params: float = 0.0) -> ck.ModuleRow:
    return ck.ModuleRow(name, "M", act, params, params, 2 * params, 0.0, ckpt_saved, inp, flops, checkpointed)


def _random_tree(rng: random.Random, n_blocks: int) -> list[ck.ModuleRow]:
    rows = [_row(ck.ROOT, flops=None)]
    for b in range(n_blocks):
        kids = rng.randint(0, 3)
        kid_rows = [_row(f"blocks.{b}.k{j}", act=rng.randint(1, 40) * MB, flops=rng.randint(1, 50) * 1e9,
                         inp=rng.randint(0, 10) * MB) for j in range(kids)]
        act_own = rng.randint(0, 20) * MB
        flops = sum(r.flops or 0 for r in kid_rows) + rng.randint(1, 30) * 1e9
        rows.append(_row(f"blocks.{b}", act=act_own, flops=flops, inp=rng.randint(0, 10) * MB))
        rows.extend(kid_rows)
    return rows


def _brute(cands: list[ck.Candidate], need: float) -> float | None:
    best = None
    for k in range(len(cands) + 1):
        for sub in itertools.combinations(cands, k):
            names = [c.name for c in sub]
            if any(a != b and (b.startswith(a + ".")) for a in names for b in names):
                continue
            if sum(c.saves for c in sub) >= need:
                cost = sum(c.flops for c in sub)
                best = cost if best is None or cost < best else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_advised_set_fits_and_is_the_cheapest_by_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    rows = _random_tree(rng, rng.randint(2, 5))
    cands = ck.candidates(rows)
    assert len(cands) <= 16
    total = ck._max_saving(sorted(cands, key=lambda c: -c.saves))
    for frac in (0.2, 0.5, 0.9, 1.0):
        need = frac * total
        got = ck.cheapest_set(cands, need)
        brute = _brute(cands, need)
        if brute is None:
            assert got is None
            continue
        assert got is not None
        chosen, method = got
        assert method == "exact"
        assert sum(c.saves for c in chosen) >= need  # it fits the target
        assert sum(c.flops for c in chosen) == pytest.approx(brute)  # and nothing cheaper does
    assert ck.cheapest_set(cands, total * 1.01 + 1) is None  # beyond what checkpointing can free


def test_savings_keep_the_inputs_and_skip_checkpointed_and_unmeasured_modules() -> None:
    rows = [_row(ck.ROOT, flops=None), _row("a", act=10 * MB, flops=5e9, inp=4 * MB),
            _row("a.x", act=6 * MB, flops=2e9, inp=0), _row("b", act=8 * MB, flops=1e9, inp=8 * MB),
            _row("c", act=3 * MB, flops=None, inp=0), _row("d", act=2 * MB, flops=1e9, inp=0, checkpointed=True),
            _row("d.y", act=0, flops=1e9, inp=0, checkpointed=True)]
    cands = {c.name: c for c in ck.candidates(rows)}
    assert set(cands) == {"a", "a.x"}  # b saves nothing (its input is all it saves), c has no FLOPs, d is checkpointed
    assert cands["a"].saves == 16 * MB - 4 * MB and cands["a.x"].saves == 6 * MB


def test_greedy_on_a_thousand_modules_fits_the_target() -> None:
    rows = [_row(ck.ROOT, flops=None)]
    for b in range(250):
        rows.append(_row(f"layers.{b}", act=2 * MB, flops=30e9, inp=1 * MB))
        for part, (a, f) in {"attn": (6 * MB, 10e9), "mlp": (8 * MB, 16e9), "norm": (1 * MB, 0.1e9)}.items():
            rows.append(_row(f"layers.{b}.{part}", act=a, flops=f, inp=1 * MB))
    cands = ck.candidates(rows)
    need = 500 * MB
    chosen, method = ck.cheapest_set(cands, need) or ([], "")
    assert method == "greedy" and sum(c.saves for c in chosen) >= need
    names = [c.name for c in chosen]
    assert not any(b.startswith(a + ".") for a in names for b in names)  # never a module with its ancestor
    # bytes per recompute FLOP: whole layers (16 MiB for 30 GFLOP) beat attn (5 MiB / 10) and mlp (7 / 16)
    assert all(n.count(".") == 1 for n in names)


def test_advice_prices_the_recompute_and_the_reverse_gives_room_back() -> None:
    rows = [_row(ck.ROOT, flops=None)]
    for b in range(12):  # blocks 0-5 checkpointed (they keep 1 MiB input, drop 9 MiB), 6-11 not
        ckd = b < 6
        rows.append(_row(f"blocks.{b}", act=(1 if ckd else 10) * MB, flops=4e9, inp=1 * MB, checkpointed=ckd,
                         ckpt_saved=9 * MB if ckd else 0))
    peak = 1000 * MB
    advice, note = ck.checkpoint_advice(rows, peak=peak, target=peak - 20 * MB, target_basis="given", forwards=2,
                                        flops_per_s=1e12, step_s=0.5)
    (a,) = advice
    assert a["action"] == "checkpoint" and len(a["modules"]) == 3 and a["saves_bytes"] == 27 * MB
    assert a["recompute_flops"] == 3 * 4e9 * 2  # two micro-batches each re-run the forward
    assert a["step_s_cost"] == pytest.approx(24e9 / 1e12) and a["step_fraction"] == pytest.approx(0.024 / 0.5)
    assert a["label"] == note and note.startswith("checkpoint blocks.")
    # room under the target: un-checkpoint what fits (four blocks' 9 MiB each in 40 MiB)
    advice, note = ck.checkpoint_advice(rows, peak=peak, target=peak + 40 * MB, target_basis="given", forwards=2,
                                        flops_per_s=1e12, step_s=0.5)
    (r,) = advice
    assert r["action"] == "uncheckpoint" and r["modules"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert r["saves_bytes"] == -36 * MB and r["step_s_cost"] == pytest.approx(-4 * 4e9 * 2 / 1e12)
    assert note == "un-checkpoint blocks.0–3: +36.0 MiB, −6% step time"
    assert ck.label_modules(["layers.0", "layers.1", "layers.2", "layers.5", "head"]) == "layers.0–2, layers.5, head"


def _rank_row(rank: int, step: int, peak: int) -> tuple:
    v = {"rank": rank, "step": step, "step_s": 1.0, "ts": 1.7e9 + step, "compute_s": 0.8, "other_s": 0.2,
         "forward_s": 0.3, "backward_s": 0.5, "mem_peak_bytes": peak, "flops": 4e11, "hw_flops": 4e11}
    return tuple(v.get(n) for n in NAMES)


def _modules_event(rank: int, scale: float) -> dict[str, Any]:
    names = [ck.ROOT, "embed", "blocks", "blocks.0", "blocks.1", "head"]
    cols = {"name": names, "type": ["Net", "Embedding", "ModuleList", "Block", "Block", "Linear"],
            "activation_bytes": [0, 4 * MB, 0, 40 * MB * scale, 40 * MB * scale, 8 * MB],
            "param_bytes": [0, 100 * MB, 0, 50 * MB, 50 * MB, 10 * MB],
            "grad_bytes": [0, 100 * MB, 0, 50 * MB, 50 * MB, 10 * MB],
            "optim_bytes": [0, 200 * MB, 0, 100 * MB, 100 * MB, 20 * MB],
            "param_saved_bytes": [0] * 6, "ckpt_saved_bytes": [0] * 6,
            "input_bytes": [None, 0, None, 4 * MB, 4 * MB, 4 * MB],
            "flops": [2e11, 1e9, None, 9e10, 9e10, 1e10], "checkpointed": [False] * 6}
    data = {"modules": cols, "totals": {k: sum(v for v in cols[k] if v) for k in (
        "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes")}, "forwards": 1, "micro_batch": 4,
        "forward_flops": 2e11, "device_total_bytes": None, "cost_s": 0.01, "method": "saved_tensors_hooks"}
    return {"rank": rank, "seq": 7, "kind": "memory_modules", "ts": 1.7e9, "step": 0, "data": data}


def test_memory_endpoint_shape_breakdown_imbalance_and_advice(live_server: Any) -> None:
    peaks = [1200 * MB, 1300 * MB]
    with live_server.client() as c:
        rid = c.register_run({"name": "mem-modules", "model_family": "f", "world_size": 2, "device_type": "cpu"})
        c.ingest_rows(rid, [_rank_row(r, s, peaks[r]) for s in range(4) for r in range(2)])
        evs = [_modules_event(0, 1.0), _modules_event(1, 1.5)]
        evs += [{"rank": r, "seq": 8, "kind": "memory", "ts": 1.7e9, "step": 3,
                 "data": {"source": "rss", "samples": 4, "peak_allocated_bytes": peaks[r], "peak_exact": True}}
                for r in range(2)]
        assert c.ingest({"v": 1, "run_id": rid, "events": evs})["accepted"]["events"] == 4
        other = c.register_run({"name": "mem-none", "model_family": "f", "world_size": 1, "device_type": "cpu"})
    live_server.compact()
    with live_server.client() as c:
        m = c.memory(rid)
        given = c.memory(rid, target_bytes=peaks[1] - 50 * MB)
        plain = c.memory(other)
    assert m["modules_rank"] == 1  # the rank with the larger peak
    assert m["peak_allocated_max"] == peaks[1] and m["source"] == "rss"  # the summary's memory section
    names = [x["name"] for x in m["modules"]]
    assert names[0] == "embed" and {"blocks.0", "blocks.1", "head", ck.ROOT} <= set(names)
    b0 = next(x for x in m["modules"] if x["name"] == "blocks.0")
    for k in ("name", "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes", "checkpointed", "flops"):
        assert k in b0
    assert b0["activation_bytes"] == 60 * MB and b0["flops"] == 9e10
    bd = m["breakdown"]
    assert bd["peak_bytes"] == peaks[1] and bd["params_bytes"] == 210 * MB and bd["optimizer_bytes"] == 420 * MB
    assert bd["activations_bytes"] == 132 * MB and bd["temporaries_estimated"] is True
    assert bd["temporaries_bytes"] == peaks[1] - (210 + 210 + 420 + 132) * MB
    assert m["module_imbalance"]["activation_bytes"] == pytest.approx(132 / 112)
    assert [r["rank"] for r in m["ranks"]] == [0, 1]
    # default target on a CPU run: room for one more sample per micro-batch (activations / 4)
    assert m["target_bytes"] == pytest.approx(peaks[1] - 132 * MB / 4)
    (a,) = m["checkpoint_advice"]
    assert a["modules"] == ["blocks.0"] and a["saves_bytes"] == 56 * MB  # one block frees 33 MiB+
    # achieved FLOP/s: hardware FLOPs per rank-step over compute seconds
    assert a["step_s_cost"] == pytest.approx(9e10 / (4e11 / 0.8))
    (g,) = given["checkpoint_advice"]
    assert g["modules"] == ["blocks.0"] and g["target_bytes"] == peaks[1] - 50 * MB
    assert plain["modules"] == [] and plain["checkpoint_advice"] == []
    r = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/memory", params={"target_bytes": -1}, timeout=10)
    assert r.status_code == 422 and "target_bytes" in r.text
    assert httpx.get(f"{live_server.url}/api/v1/runs/999999/memory", timeout=10).status_code == 404


def test_a_memory_modules_event_beyond_its_bound_is_refused(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "mem-big", "model_family": "f", "world_size": 1, "device_type": "cpu"})
        ev = _modules_event(0, 1.0)
        ev["data"]["modules"]["name"] = [f"m{i}" for i in range(5000)]
        r = httpx.post(f"{live_server.url}/api/v1/ingest", json={"v": 1, "run_id": rid, "events": [ev]},
                       headers={"Authorization": f"Bearer {live_server.token}"}, timeout=10)
    assert r.status_code == 422 and "MAX_MEMORY_MODULES_VALUES" in r.text


def test_reentrant_blocks_whose_dropped_bytes_are_unknown_are_never_advised_as_free() -> None:
    rows = [_row(ck.ROOT, flops=None)] + [_row(f"blocks.{b}", act=1 * MB, flops=4e9, inp=1 * MB, checkpointed=True)
                                          for b in range(4)]
    advice, note = ck.checkpoint_advice(rows, peak=100 * MB, target=200 * MB, target_basis="given", forwards=1,
                                        flops_per_s=1e12, step_s=1.0)
    assert advice == [] and "not measured for blocks.0–3 (reentrant checkpointing)" in note
