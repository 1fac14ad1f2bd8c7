"""Declared pauses (``run.pause``) and checkpoints recognised automatically (agent/checkpoint_watch.py):
torch.save / torch.load of large state and torch.distributed.checkpoint, read back at a receiver."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fleetscope.agent as fs
import pytest
from fleetscope.agent.config import AgentConfig

try:
    from ._receiver import Receiver
except ImportError:  # tests/agent is not a package
    from _receiver import Receiver

pytestmark = pytest.mark.timeout(120)


def _init(r: Receiver, tmp_path: Path, name: str) -> Any:
    return fs.init(name, agent_config=AgentConfig(server=r.url, token=r.token, spool_dir=str(tmp_path / "spool"),
                                                  flush_interval_s=0.1))


def _kinds(r: Receiver, *kinds: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] in kinds]


def test_declared_pause_sends_begin_and_end_with_duration(tmp_path: Path) -> None:
    with Receiver() as r:
        run = _init(r, tmp_path, "pause-declared")
        with run.step():
            pass
        with run.pause("eval", expected_s=3) as p:
            assert p.reason == "eval"
            time.sleep(0.3)
        with pytest.raises(KeyError):
            with run.pause("eval"):
                raise KeyError("the job's own error is not swallowed")
        run.finish()
    ev = _kinds(r, "pause")
    assert [e["data"]["state"] for e in ev] == ["begin", "end", "begin", "end"]
    b, e = ev[0], ev[1]
    assert b["data"] == {"reason": "eval", "state": "begin", "expected_s": 3.0}
    assert e["data"]["reason"] == "eval" and e["data"]["expected_s"] == 3.0
    assert 0.3 <= e["data"]["duration_s"] < 2.0 and e["ts"] - b["ts"] >= 0.29
    assert b["step"] == 1  # the next step
    assert ev[3]["data"]["error"] == "KeyError" and ev[3]["data"]["expected_s"] is None
    assert not _kinds(r, "checkpoint_save", "checkpoint_load")  # a declared pause is not a checkpoint


def test_noop_run_pause_is_a_context_manager() -> None:
    run = fs.init("off", disabled=True)
    with run.pause("eval", expected_s=1.0):
        pass


def test_large_torch_save_and_load_are_checkpoint_pauses_small_ones_are_not(tmp_path: Path) -> None:
    import torch

    with Receiver() as r:
        run = _init(r, tmp_path, "pause-ckpt")
        with run.step():
            pass
        big = {"model": {"w": torch.zeros(17 * 1024 * 1024)}, "step": 1}  # 68 MiB of float32
        torch.save({"w": torch.zeros(10)}, tmp_path / "small.pt")
        torch.load(tmp_path / "small.pt")
        assert not _kinds(r, "pause")
        torch.save(big, tmp_path / "big.pt")
        loaded = torch.load(tmp_path / "big.pt")
        assert loaded["model"]["w"].numel() == 17 * 1024 * 1024
        run.finish()
    ev = _kinds(r, "pause")
    assert [(e["data"]["reason"], e["data"]["state"]) for e in ev] == [
        ("checkpoint_save", "begin"), ("checkpoint_save", "end"), ("checkpoint_load", "begin"), ("checkpoint_load", "end")]
    assert all(e["data"]["duration_s"] > 0 for e in ev if e["data"]["state"] == "end")
    ck = _kinds(r, "checkpoint_save", "checkpoint_load")
    assert [c["kind"] for c in ck] == ["checkpoint_save", "checkpoint_load"]
    assert ck[0]["data"]["duration_s"] == ev[1]["data"]["duration_s"] and ck[0]["ts"] == ev[0]["ts"]


def test_dcp_save_and_load_are_checkpoint_pauses(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with Receiver() as r:
        run = _init(r, tmp_path, "pause-dcp")
        with run.step():
            pass
        state = {"w": torch.ones(8)}
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))  # small, but every dcp call is a checkpoint
        target = {"w": torch.zeros(8)}
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
        assert torch.equal(target["w"], torch.ones(8))
        run.finish()
    ev = _kinds(r, "pause")
    assert [(e["data"]["reason"], e["data"]["state"]) for e in ev] == [
        ("checkpoint_save", "begin"), ("checkpoint_save", "end"), ("checkpoint_load", "begin"), ("checkpoint_load", "end")]
    assert [c["kind"] for c in _kinds(r, "checkpoint_save", "checkpoint_load")] == ["checkpoint_save", "checkpoint_load"]
