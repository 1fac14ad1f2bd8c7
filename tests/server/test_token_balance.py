"""Token balance end to end: ``fleetscope simulate --token-skew RANK=FACTOR --skew-modality vision`` (the real
agent transport) into the real server; per-rank modality tokens are folded once at compaction
(``run_rank_modalities``) and the summary's ``token_balance`` names the rank, its modality ratio, that it
is the straggler and what to do. Expected numbers come from the synthetic generator itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fleetscope.server.db import make_engine
from sqlalchemy import text

from fleetscope.synthetic import RunSpec, modality_rows, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

RANKS, STEPS, SKEWED, FACTOR, FAMILY = 8, 12, 5, 1.6, "vla-7b"
I_TOK = [f.name for f in RANK_STEP_FIELDS].index("tokens")


def _stored(db_url: str, rid: int) -> dict[tuple[int, str], tuple[int, int]]:
    eng = make_engine(db_url, pool_size=1)
    try:
        with eng.connect() as c:
            return {(r, m): (t, s) for r, m, t, s in c.execute(
                text("SELECT rank, modality, tokens, steps FROM run_rank_modalities WHERE run_id = :r"), {"r": rid})}
    finally:
        eng.dispose()


def test_simulated_token_skew_is_found_and_named(live_server: Any) -> None:
    from typer.testing import CliRunner

    from fleetscope.cli import app

    out = CliRunner().invoke(app, ["simulate", "--server", live_server.url, "--token", live_server.token, "--run", "skew",
                                   "--family", FAMILY, "--ranks", str(RANKS), "--steps", str(STEPS), "--seed", "3",
                                   "--token-skew", f"{SKEWED}={FACTOR}", "--skew-modality", "vision"])
    assert out.exit_code == 0, out.output
    live_server.compact()
    with live_server.client() as c:
        (run,) = c.run_list(name="skew")
        tb = c.summary(run["id"])["token_balance"]

    # what was sent, from the generator (simulate's default: the realistic model)
    spec = RunSpec(name="skew", family=FAMILY, world_size=RANKS, steps=STEPS, seed=3, token_skew={SKEWED: FACTOR},
                   token_skew_modality="vision", realistic=True)
    sent: dict[tuple[int, str], list[int]] = {}
    rel = []
    for step, rows in rank_step_rows(spec):
        t = np.array([r[I_TOK] for r in rows], dtype=float)
        rel.append(t / np.median(t))
        for r, _s, m, v in modality_rows(spec, step, rows):
            acc = sent.setdefault((r, m), [0, 0])
            acc[0] += v
            acc[1] += 1
    # folded once per rank, step and modality
    assert _stored(live_server.db_url, run["id"]) == {k: tuple(v) for k, v in sent.items()}

    assert tb is not None and tb["steps"] == STEPS and tb["ranks"] == RANKS
    vision = tb["modalities"]["vision"]
    per_rank = np.array([sent[(r, "vision")][0] / STEPS for r in range(RANKS)])
    assert vision["max_rank"] == SKEWED and vision["ratio"] == pytest.approx(per_rank.max() / np.median(per_rank))
    assert vision["ratio"] == pytest.approx(FACTOR, rel=0.1)  # the sample-length noise of the generator
    assert tb["modalities"]["text"]["ratio"] == pytest.approx(1.0, rel=0.1)
    heavy = tb["heaviest_rank"]
    assert heavy["rank"] == SKEWED and heavy["tokens_ratio"] == pytest.approx(float(np.mean([x[SKEWED] for x in rel])))
    assert heavy["slowest_share"] == 1.0  # its work grew with its tokens: the straggler on every step
    assert tb["work_correlation"] > 0.5
    assert tb["finding"].startswith(f"rank {SKEWED} gets {vision['ratio']:.2f}× the vision tokens of the median rank; "
                                    "it is the slowest rank on 100 % of steps")
    assert tb["finding"].endswith("balance by tokens, not samples")


def test_resent_modality_tokens_are_folded_once(live_server: Any) -> None:
    spec = RunSpec(name="resend", family=FAMILY, world_size=2, steps=3, seed=1)
    with live_server.client() as c:
        rid = c.register_run(spec.run_info())
        step_rows = [row for _, rows in rank_step_rows(spec) for row in rows]
        mods = [m for step, rows in rank_step_rows(spec) for m in modality_rows(spec, step, rows)]
        cols = {k: [m[i] for m in mods] for i, k in enumerate(("rank", "step", "modality", "tokens"))}
        c.ingest_rows(rid, step_rows, modality_tokens=cols)
        live_server.compact()
        c.ingest({"v": 1, "run_id": rid, "modality_tokens": cols})  # a retried batch, after compaction
        live_server.compact()
    got = _stored(live_server.db_url, rid)
    want: dict[tuple[int, str], tuple[int, int]] = {}
    for r, _s, m, v in mods:
        t, n = want.get((r, m), (0, 0))
        want[(r, m)] = (t + v, n + 1)
    assert got == want


def test_simulate_refuses_bad_token_skew_naming_the_option() -> None:
    from typer.testing import CliRunner

    from fleetscope.cli import app

    base = ["simulate", "--server", "http://127.0.0.1:9", "--run", "x", "--family", FAMILY, "--ranks", "4", "--steps", "1"]
    for args, says in ((["--token-skew", "3"], "--token-skew expects RANK=FACTOR"),
                       (["--token-skew", "3=-1"], "--token-skew expects"),
                       (["--token-skew", "9=1.2"], "--token-skew rank 9 is not < --ranks 4"),
                       (["--token-skew", "1=1.2", "--skew-modality", "audio"], "--skew-modality 'audio' is not a modality")):
        r = CliRunner().invoke(app, [*base, *args])
        assert r.exit_code == 2 and says in r.output, (args, r.output)
    with pytest.raises(ValueError, match="token_skew_modality"):
        list(rank_step_rows(RunSpec(name="x", family=FAMILY, world_size=2, steps=1, token_skew={1: 1.2},
                                    token_skew_modality="audio")))
