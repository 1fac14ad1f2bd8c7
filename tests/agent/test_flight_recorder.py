"""agent/flight_recorder.py: reading torch's Flight Recorder — op names, bytes, dimensions, the
per-step count of collectives only the recorder saw, and a real 1-rank gloo process group's trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from fleetscope.agent import flight_recorder as fr


@pytest.mark.parametrize("name, op", [
    ("nccl:all_reduce", "all_reduce"), ("gloo:all_reduce", "all_reduce"), ("nccl:allreduce_coalesced", "all_reduce"),
    ("nccl:_allgather_base", "all_gather"), ("nccl:all_gather_into_tensor_coalesced", "all_gather"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"), ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"),
    ("nccl:all_to_all", "all_to_all"), ("nccl:alltoall_base", "all_to_all"), ("nccl:send 0->1", "send"),
    ("nccl:recv 1<-0", "recv"), ("gloo:broadcast", "broadcast"), ("nccl:reduce", "reduce"), ("gloo:barrier", "barrier"),
    ("nccl:gather", "gather"), ("nccl:scatter", "scatter"), ("nccl:mystery", "other"),
])  # fmt: skip
def test_op_names_map_to_the_wire_ops(name: str, op: str) -> None:
    assert fr.normalize_op(name) == op


def test_bytes_follow_the_wire_rule() -> None:
    e = {"input_sizes": [[4, 8]], "input_dtypes": ["BFloat16"], "output_sizes": [[16, 8]], "output_dtypes": ["BFloat16"]}
    assert fr.entry_bytes("all_reduce", e) == 4 * 8 * 2
    assert fr.entry_bytes("all_gather", e) == 16 * 8 * 2  # the gathered output
    assert fr.entry_bytes("reduce_scatter", e) == 4 * 8 * 2  # the full per-rank input
    assert fr.entry_bytes("barrier", e) == 0


def test_dimensions_are_named_as_the_agent_names_them() -> None:
    assert fr.dim_of("0", "default_pg", "[0, 1, 2, 3]", {}, 4) == "world"
    assert fr.dim_of("3", "mesh_tp", "[0, 1]", {}, 4) == "tp"
    assert fr.dim_of("5", "", "[1, 3]", {}, 4) == "g2s2"
    assert fr.dim_of("5", "", "[0, 1, 3]", {}, 4) == "g3"
    assert fr.dim_of("7", "", "[0, 1]", {"7": "dp"}, 4) == "dp"  # a DeviceMesh dim the agent registered


def _entry(rid: int, created: float, op: str = "nccl:all_reduce", numel: int = 256, seq: int | None = None) -> dict[str, Any]:
    return {"record_id": rid, "process_group": ("0", "default_pg"), "collective_seq_id": rid + 1 if seq is None else seq,
            "p2p_seq_id": 0, "is_p2p": False, "profiling_name": op, "time_created_ns": int(created * 1e9),
            "input_sizes": [[numel]], "input_dtypes": ["Float"], "output_sizes": [[numel]], "output_dtypes": ["Float"],
            "state": "completed", "time_discovered_completed_ns": None}


def _step(step: int, ts: float, step_s: float) -> tuple[str, tuple[Any, ...]]:
    return ("rank_step", (0, step, step_s, ts))


def _coll(step: int, op: str, nbytes: int, calls: int = 1, dim: str = "world") -> tuple[str, tuple[Any, ...]]:
    return ("collective", (0, step, 0, op, 2, nbytes, calls, 0.001, 0.001, 0.0, dim))


def test_only_the_collectives_the_agent_did_not_record_are_counted() -> None:
    t0 = time.time() - 100.0  # steps that ended before the recorder is read
    entries = [
        _entry(0, t0 + 0.1),  # step 0: seen by the agent too
        _entry(1, t0 + 0.2), _entry(2, t0 + 0.3),  # step 0: graph collectives
        _entry(3, t0 + 1.1, op="nccl:_allgather_base", numel=512),  # step 1: a graph all_gather
        _entry(4, t0 + 1.2),  # step 1: seen by the agent (as 1 of an aggregated record of 2)
        _entry(5, t0 + 1.3),
        _entry(6, t0 + 5.0),  # after the last step: kept for the step it belongs to
    ]
    trace: dict[str, Any] = {"entries": entries[:6], "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}}}
    gc = fr.GraphCollectives(world_size=2, dump_fn=lambda: trace)
    gc.observe([_step(0, t0, 1.0), _coll(0, "all_reduce", 1024), _step(1, t0 + 1.0, 1.0),
                _coll(1, "all_reduce", 1024, calls=2)])
    out = gc.poll(now=0.0)
    assert out == {"steps": [0, 1], "calls": 3,
                   "by": [{"op": "all_gather", "dim": "world", "calls": 1, "bytes": 2048},
                          {"op": "all_reduce", "dim": "world", "calls": 2, "bytes": 2048}]}
    # read again: nothing new is counted twice; an entry past the last step waits for its step
    trace["entries"] = entries
    assert gc.poll(now=0.5) is None  # not due (interval)
    assert gc.poll(now=10.0) is None  # due: no step was seen since
    gc.observe([_step(2, t0 + 4.5, 1.0)])
    assert gc.poll(now=20.0) == {"steps": [2, 2], "calls": 1,
                                 "by": [{"op": "all_reduce", "dim": "world", "calls": 1, "bytes": 1024}]}
    assert gc.entries_seen == 7 and gc.reads == 3


def test_no_recorder_means_nothing_and_no_error() -> None:
    gc = fr.GraphCollectives(dump_fn=lambda: None)
    gc.observe([_step(0, 1.0, 1.0)])
    assert gc.poll(force=True) is None and not gc.off

    def broken() -> dict[str, Any]:
        raise RuntimeError("recorder unreadable")

    gc = fr.GraphCollectives(dump_fn=broken)
    gc.observe([_step(0, 1.0, 1.0)])
    assert gc.poll(force=True) is None and gc.off  # switched off, the agent's own records stay


def test_enable_respects_the_job_and_the_switch() -> None:
    env: dict[str, str] = {}
    assert fr.enable(env) and env == {fr.BUFFER_ENV: str(fr.DEFAULT_BUFFER)}
    env = {fr.BUFFER_ENV: "0"}
    assert not fr.enable(env) and env == {fr.BUFFER_ENV: "0"}  # the job's own choice stands
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    assert fr.enable(env) and fr.BUFFER_ENV not in env
    env = {"FLEETSCOPE_FLIGHT_RECORDER": "0"}
    assert not fr.enable(env) and fr.BUFFER_ENV not in env


PROBE = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
from fleetscope.agent import flight_recorder as fr
fr.enable()
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
for _ in range(3):
    dist.all_reduce(torch.ones(256))
dist.broadcast(torch.ones(8, dtype=torch.bfloat16), 0)
entries = fr.parse(fr.dump())
pos = fr.position_collective()
print(json.dumps({"entries": [[e.op, e.seq, e.nbytes, e.group] for e in entries], "pos": pos}))
dist.destroy_process_group()
"""


def test_a_real_gloo_trace_is_read(tmp_path: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in (fr.BUFFER_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    res = subprocess.run([sys.executable, "-c", PROBE, str(port)], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["entries"] == [["all_reduce", 1, 1024, "0"], ["all_reduce", 2, 1024, "0"], ["all_reduce", 3, 1024, "0"],
                              ["broadcast", 4, 16, "0"]]
    pos = out["pos"]
    assert {k: pos[k] for k in ("op", "dim", "seq", "bytes", "done")} == {
        "op": "broadcast", "dim": "world", "seq": 4, "bytes": 16, "done": True}
    assert 0 <= pos["since_s"] < 60


def test_a_destroyed_groups_status_does_not_make_a_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder keys ``pg_status`` by a uid that a re-created group does not reuse, while the new
    group's entries reuse the name ("0"): a destroyed group's last status (enqueued past completed) must
    not be read as the live group being blocked in that old collective."""
    import types

    old = [_entry(i, 100.0 + i, seq=i + 1) for i in range(37)]  # seq 1..37 of the first incarnation
    new = [_entry(37 + i, 200.0 + i, seq=i + 1) for i in range(14)]  # seq 1..14 of the re-created group
    trace = {"entries": old + new, "pg_config": {"0": {"desc": "default_pg", "ranks": "[0]"}},
             "pg_status": {"0": {"last_enqueued_collective": 37, "last_completed_collective": 36},
                           "1": {"last_enqueued_collective": 14, "last_completed_collective": 14}}}
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(fr, "dump", lambda: trace)
    pos = fr.position_collective()
    assert pos is not None and (pos["seq"], pos["done"]) == (14, True)
    # the live group blocked in its 15th: that one is named, not done
    trace["entries"] = old + new + [_entry(51, 215.0, seq=15)]
    trace["pg_status"]["0"] = {"last_enqueued_collective": 15, "last_completed_collective": 14}
    pos = fr.position_collective()
    assert pos is not None and (pos["seq"], pos["done"]) == (15, False)


def test_nccl_and_generic_recorders_are_read_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL groups record into NCCL's own recorder (``_dump_nccl_trace``), gloo groups into the generic one
    (``_dump_fr_trace``): the agent reads both. Each numbers its records from 0 and keys its group status by
    its own uid, so entries are told apart by recorder and ordered by creation time."""
    import pickle
    import types

    nccl = {"entries": [_entry(i, 10.0 + i, op="nccl:all_reduce", seq=i + 1) for i in range(3)],
            "pg_config": {"0": {"desc": "default_pg", "ranks": "[0]"}},
            "pg_status": {"0": {"last_enqueued_collective": 4, "last_completed_collective": 3}}}
    nccl["entries"].append(_entry(3, 20.0, op="nccl:all_gather", seq=4))  # in flight: blocked here
    gloo = {"entries": [_entry(i, 11.5 + i, op="gloo:broadcast", seq=i + 1) for i in range(5)],
            "pg_config": {"0": {"desc": "default_pg", "ranks": "[0]"}},
            "pg_status": {"0": {"last_enqueued_collective": 5, "last_completed_collective": 5}}}
    calls: list[str] = []

    def dumper(name: str, trace: dict[str, Any]) -> Any:
        def fn(**kw: Any) -> bytes:
            calls.append(name)
            assert kw == {"includeCollectives": True, "includeStackTraces": False, "onlyActive": False}
            return pickle.dumps(trace)
        return fn

    c10d = types.SimpleNamespace(_dump_nccl_trace=dumper("nccl", nccl), _dump_fr_trace=dumper("fr", gloo))
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", c10d)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or types.ModuleType("torch"))
    trace = fr.dump()
    assert trace is not None and sorted(calls) == ["fr", "nccl"]
    entries = fr.parse(trace)
    assert len(entries) == 9 and [e.created for e in entries] == sorted(e.created for e in entries)
    assert {e.src for e in entries} == {"nccl", "fr"}
    assert sorted(trace["pg_status"]) == ["fr:0", "nccl:0"]
    # every entry of both is counted once across reads, though both recorders reuse record ids 0..4
    gc = fr.GraphCollectives(1, interval_s=0.0, dump_fn=lambda: trace)
    gc._read()
    gc._read()
    assert gc.entries_seen == 9
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    pos = fr.position_collective()
    assert pos is not None and (pos["op"], pos["seq"], pos["done"]) == ("all_gather", 4, False)
