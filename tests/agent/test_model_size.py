"""The model's size reaches the run's meta: counted by the agent from the model it instruments
(``sum(p.numel())``, "measured") or given to ``fs.init(params=, active_params=)`` (a mixture of experts),
through the real transport to the real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fleetscope.agent as fs
import httpx
import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "FLEETSCOPE_DISABLED", "FLEETSCOPE_JOB_ID",
                "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)


def _train(run: Any, model: torch.nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.instrument(model=model, optimizer=opt, dataloader=[torch.randn(4, 16) for _ in range(steps)])
    for x in loader:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    run.finish()


def _meta(srv: Any, name: str) -> dict[str, Any]:
    runs = httpx.get(f"{srv.url}/api/v1/runs", params={"name": f"eq:{name}"}, timeout=30).json()["runs"]
    assert len(runs) == 1, runs
    return runs[0]["meta"]


def test_the_agent_counts_the_model_and_keeps_a_given_size(live_server: Any, tmp_path: Path) -> None:
    kw = {"server": live_server.url, "token": live_server.token, "spool_dir": str(tmp_path / "spool"),
          "measure_flops": False}
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    _train(fs.init("counted", **kw), model)
    meta = _meta(live_server, "counted")
    assert meta["params"] == meta["active_params"] == 16 * 32 + 32 + 32 * 4 + 4
    assert meta["params_source"] == "measured"

    _train(fs.init("given", params=47e9, active_params=13e9, **kw), model)
    meta = _meta(live_server, "given")
    assert (meta["params"], meta["active_params"], meta["params_source"]) == (47e9, 13e9, "given")
