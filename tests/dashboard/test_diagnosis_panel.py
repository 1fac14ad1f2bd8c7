"""The run page's "Diagnosis" panel (id ``run-diagnosis``) and the token balance / sequence-length /
network panel (id ``run-balance``) through Dash's own callback endpoint on the real server: a job whose
exposed comm is an 8-byte broadcast waiting for a rank that gets more tokens shows the ranked parts with
their sum equal to the median step, the token advice (not a device one) and no bucketing advice; the token
balance and the sequence-length histogram appear; a run without steps shows the
empty diagnosis and no balance panel."""

from __future__ import annotations

from typing import Any

import httpx
from dash_util import find as _find
from dash_util import texts as _texts

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
STEPS = 16


def _row(rank: int, step: int) -> tuple:
    slow = 0.030 if rank == 3 else 0.0  # rank 3 gets 1.5x the tokens and computes 30 ms longer
    bc = 0.0005 + 0.030 - slow  # the others wait for it in the broadcast
    vals = {"rank": rank, "step": step, "ts": T0 + step, "data_s": 0.005, "forward_s": 0.030, "backward_s": 0.060 + slow,
            "optimizer_s": 0.010, "compute_s": 0.100 + slow, "comm_exposed_s": bc, "comm_total_s": bc,
            "other_s": 0.002, "step_s": 0.107 + slow + bc, "tokens": 6000 if rank == 3 else 4000,
            "padded_tokens": 6000 if rank == 3 else 4000}
    row: list[Any] = [None] * len(NAMES)
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _run(srv: Any) -> int:
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s))
            bc = 0.0005 + (0.0 if r == 3 else 0.030)
            colls.append((r, s, 0, "broadcast", 4, 8, 1, bc, bc, T0 + s + 0.107, None))
    events = [{"rank": r, "seq": 0, "kind": "seq_lens", "ts": T0, "step": 0, "data": {"bins": {"9": 30, "11": 10}, "steps": 1}}
              for r in range(4)]
    with srv.client() as c:
        rid = c.register_run({"name": "skewed-broadcast", "world_size": 4})
        c.ingest_rows(rid, steps, colls, events=events)
    srv.compact()
    return rid


def _panels(srv: Any, rid: int) -> tuple[Any, Any]:
    outs = [{"id": "run-diagnosis", "property": "children"}, {"id": "run-balance", "property": "children"}]
    body = {"output": "..run-diagnosis.children...run-balance.children..", "outputs": outs,
            "inputs": [{"id": "run-id", "property": "data", "value": rid}], "changedPropIds": ["run-id.data"], "state": []}
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    resp = r.json()["response"]
    return resp["run-diagnosis"]["children"], resp["run-balance"]["children"]


def test_diagnosis_panel_ranks_the_wait_sums_to_the_step_and_gives_only_its_advice(live_server: Any) -> None:
    rid = _run(live_server)
    with live_server.client() as c:
        d = c.summary(rid)["diagnosis"]
    diag, balance = _panels(live_server, rid)

    # the parts, ranked, one row each; the wait before the broadcast's own latency
    rows = [" | ".join(_texts(_find(diag, f"run-diagnosis-part-{p['cause']}"))) for p in d["parts"]]
    assert rows[0].startswith("compute | ") and rows[1].startswith("waiting for the slowest rank | 30.0 ms | 21.8 %")
    assert any(r.startswith("small synchronisation collectives | ") and "broadcast in world (8 B per call)" in r
               for r in rows), rows
    assert _find(diag, "run-diagnosis-part-comm_bandwidth") is None  # nothing of it is bandwidth-bound
    # the sum row: the parts add up to the median step
    total = " | ".join(_texts(_find(diag, "run-diagnosis-sum")))
    assert total == "sum | = median step 137.5 ms | 137.5 ms | 100.0 %", total

    advice = " ".join(_texts(_find(diag, "run-diagnosis-advice")))
    assert "Balance tokens across ranks: rank 3 gets 1.50× the tokens of the median rank" in advice
    assert "Fix or replace rank 3" not in advice  # slow because of its tokens, not its device
    for bad in ("bucket", "prefetch", "NCCL"):
        assert bad not in advice, bad
    notes = " ".join(_texts(_find(diag, "run-diagnosis-notes")))
    assert "the parts sum to 137.5 ms of a 137.5 ms median step" in notes and "64 KiB" in notes

    # token balance and the sequence-length histogram
    kpis = " | ".join(_texts(_find(balance, "run-balance-kpis")))
    assert "heaviest rank | rank 3 | 1.50× the median rank's tokens" in kpis, kpis
    assert "balance by tokens, not samples" in " ".join(_texts(_find(balance, "run-balance-finding")))
    hist = " | ".join(_texts(_find(balance, "run-balance-seq-len")))
    assert "160 sequences" in hist and "512–1,024 | 120 | 75.0 %" in hist and "2,048–4,096 | 40 | 25.0 %" in hist, hist


def test_a_run_without_steps_has_an_empty_diagnosis_and_no_balance_panel(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "empty", "world_size": 2})
    diag, balance = _panels(live_server, rid)
    assert _find(diag, "run-diagnosis-empty") is not None
    assert balance is None
