"""Custom phases (``run.phase(name)``) are kept by name, bounded in number, and shown in the run
summary's ``phases`` beside forward / backward / optimizer — a real agent in a real process against
the real server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx

SCRIPT = """
import time, sys
import fleetscope.agent as fs
from fleetscope.agent.run import MAX_CUSTOM_PHASES

run = fs.init("phases-run", model_family="f", flops_per_step=1e9, server=sys.argv[1], token=sys.argv[2],
              spool_dir=sys.argv[3])
for i in range(6):
    with run.step(tokens=100):
        with run.phase("vision_encoder"):
            time.sleep(0.03)
        with run.phase("forward"):
            time.sleep(0.01)
        with run.phase("loss"):
            time.sleep(0.01)
        if i == 0:  # many distinct names once: past the bound they share one phase
            for k in range(MAX_CUSTOM_PHASES + 5):
                with run.phase(f"p{k}"):
                    pass
stats = run.stats()
run.finish()
print(stats["phase_names_overflow"])
"""


def test_custom_phases_are_kept_and_bounded(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([sys.executable, "job.py", live_server.url, live_server.token, str(tmp_path / "spool")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    overflow = int(res.stdout.strip().splitlines()[-1])
    assert overflow >= 5  # the names past the bound were counted

    live_server.compact()
    c = httpx.Client(base_url=live_server.url, timeout=10)
    (run,) = c.get("/api/v1/runs", params={"name": "phases-run"}).json()["runs"]
    summary = c.get(f"/api/v1/runs/{run['id']}/summary").json()
    phases = summary["phases"]
    assert 0.025 <= phases["vision_encoder"] <= 0.5, phases
    assert 0.008 <= phases["loss"] <= 0.5 and 0.008 <= phases["forward"] <= 0.5, phases
    assert phases["vision_encoder"] > phases["loss"]
    # a custom phase's time is compute: the decomposition still sums to the step
    dec = summary["decomposition"]
    assert dec["compute_s"] >= phases["vision_encoder"] + phases["loss"] + phases["forward"] - 1e-3
    # bounded: at most MAX_CUSTOM_PHASES custom names, then one shared name (only in step 0: its
    # median over steps is 0, so it may be absent)
    custom = set(phases) - {"forward", "backward", "optimizer"}
    assert len(custom) <= 32 + 1 and {"vision_encoder", "loss"} <= custom
    c.close()


SEQ_SCRIPT = """
import sys, types
import torch
import fleetscope.agent as fs

run = fs.init("seqlen-run", model_family="f", flops_per_step=1e9, server=sys.argv[1], token=sys.argv[2],
              spool_dir=sys.argv[3])
for i in range(5):
    with run.step() as s:
        lens = [1, 3, 100, 1000] if i % 2 == 0 else torch.tensor([5, 6, 7])
        s.count(tokens=int(sum(int(x) for x in lens)), seq_lens=lens)
        s.count(seq_lens=types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), tolist=lambda: [1 / 0]))
print(run.stats()["seq_lens_on_device"])
run.finish()
"""


def test_sequence_length_histogram_per_run(live_server: Any, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SEQ_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([sys.executable, "job.py", live_server.url, live_server.token, str(tmp_path / "spool")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "5"  # a device tensor is never read (it would synchronise)
    live_server.compact()
    c = httpx.Client(base_url=live_server.url, timeout=10)
    (run,) = c.get("/api/v1/runs", params={"name": "seqlen-run"}).json()["runs"]
    h = c.get(f"/api/v1/runs/{run['id']}/summary").json()["seq_len_hist"]
    c.close()
    # 3 steps of [1, 3, 100, 1000] and 2 of [5, 6, 7]: log2 bins [1,2) [2,4) [4,8) [64,128) [512,1024)
    assert h["bins"] == [{"lo": 0, "hi": 2, "count": 3}, {"lo": 2, "hi": 4, "count": 3}, {"lo": 4, "hi": 8, "count": 6},
                         {"lo": 64, "hi": 128, "count": 3}, {"lo": 512, "hi": 1024, "count": 3}]
    assert h["sequences"] == 18 and h["p50_bin_lo"] == 4 and h["max_bin_lo"] == 512
