"""FLOPs that stay true under model parallelism, compilation and any dtype (docs/metrics.md, "Model
FLOPs per step"): the formula divided by the model-parallel degree (``mp_size`` or the DeviceMesh),
DTensor ops counted at their local shards, a compiled model measured on its eager module and fake
tensors without disturbing compilation, and the dtype and peak taken from the job, not a default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent import env as agent_env  # noqa: E402
from fleetscope.agent import mfu  # noqa: E402

SHAPE = {"params": 1e6, "layers": 2, "heads": 4, "head_dim": 16, "seq_len": 128}
PER_TOKEN = 6 * 1e6 + 12 * 2 * 4 * 16 * 128
TESTS = os.path.dirname(__file__)


def _script(tmp_path: Path, body: str) -> dict[str, Any]:
    """Run ``body`` in a fresh interpreter (process-wide state: a fake process group, torch.compile);
    it prints one JSON line last."""
    f = tmp_path / "job.py"
    f.write_text(f"import sys\nsys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for k in ("FLEETSCOPE_SERVER", "FLEETSCOPE_PEAK_FLOPS", "FLEETSCOPE_AUTO"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "internal error" not in res.stderr, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_formula_is_divided_by_the_given_model_parallel_size() -> None:
    run = fs.init("flops-mp", transport=FakeTransport, collectives=False, transformer=SHAPE, mp_size=4)
    tx = FakeTransport.instances[-1]
    for tokens in (256, 512):
        with run.step(tokens=tokens):
            pass
    run.finish()
    # every rank of a TP×PP group of 4 sees the replica's tokens and does a quarter of their FLOPs
    assert [s["flops"] for s in tx.steps()] == [256 * PER_TOKEN / 4, 512 * PER_TOKEN / 4]
    meta = tx.run_info["meta"]
    assert meta["flops_source"] == "estimated" and meta["flops_mp_degree"] == 4
    assert meta["flops_per_token"] == PER_TOKEN  # the whole model's, as given


# A 2-way tensor-parallel MLP (colwise up, rowwise down) on a fake process group (world size 2, this
# process is rank 0; collectives are no-ops): local matmuls [B, D] x [D, H/2] and [B, H/2] x [H/2, D].
_TP_JOB = """
import json
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.flop_counter import FlopCounterMode

import fleetscope.agent as fs
from agent_testutil import FakeTransport
from fleetscope.agent import mfu

B, D, H = 4, 16, 32
run = fs.init("flops-mesh", transport=FakeTransport, transformer=%(shape)r)
tx = FakeTransport.instances[-1]
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))  # after init: the agent sees it made


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, H, bias=False)
        self.down = torch.nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


model = MLP()
parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
x = torch.randn(B, D)
with FlopCounterMode(display=False) as stock:
    model(x).pow(2).mean().backward()
meter = mfu.FlopMeter()
meter.start()
model(x).pow(2).mean().backward()
local = meter.stop()

with run.step(tokens=100):
    pass
run.finish()
print(json.dumps({"stock": stock.get_total_flops(), "local": local, "info": meter.info(),
                  "fwd": meter.forward, "degree": mfu.model_parallel_degree(),
                  "flops": [s["flops"] for s in tx.steps()],
                  "events": [r["data"] for r in tx.of("event") if r["kind"] == "flops"]}))
dist.destroy_process_group()
"""


def test_dtensor_ops_count_local_shards_and_the_formula_divides_by_the_mesh(tmp_path: Path) -> None:
    out = _script(tmp_path, _TP_JOB % {"shape": SHAPE})
    b, d, h = 4, 16, 32
    mm = 2 * b * d * (h // 2)  # each local matmul: [4,16]x[16,16] or [4,16]x[16,16]
    # forward: up + down; backward: down's grad input and weight, up's weight (x needs no grad)
    local = 2 * mm + 3 * mm
    assert out["stock"] == 2 * local  # torch's counter: the global shapes, on every rank (×TP)
    assert out["local"] == local and out["fwd"] == 2 * mm
    assert out["info"]["scope"] == "local" and out["info"]["dtensor_ops"] > 0
    # the formula: the whole model's FLOPs per token, a TP rank does half
    assert out["degree"] == 2
    assert out["flops"] == [100 * PER_TOKEN / 2]
    assert {"source": "formula", "mp_degree": 2, "flops_per_token": PER_TOKEN / 2} in out["events"]


_COMPILED_JOB = """
import json
import torch
import fleetscope.agent as fs
from agent_testutil import FakeTransport

torch.set_num_threads(1)
B, LAYERS = 8, [(16, 32), (32, 8)]


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))


run = fs.init("flops-compiled", transport=FakeTransport, collectives=False)
tx = FakeTransport.instances[-1]
model, twin = mlp(), mlp()
compiled = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
run.instrument(model=compiled, optimizer=opt)
torch.manual_seed(1)
for _ in range(3):
    x = torch.randn(B, 16)
    for m, o in ((compiled, opt), (twin, opt_twin)):
        m(x).pow(2).sum().backward()
        o.step()
        o.zero_grad()
run.finish()
from torch._dynamo.utils import counters
from fleetscope.agent import mfu


class DataDependent(torch.nn.Module):  # a forward fake tensors cannot run: not measured, no error
    def forward(self, x):
        return x * float(x.sum().item())


same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
print(json.dumps({"flops": [s["flops"] for s in tx.steps()], "flags": [s["flags"] for s in tx.steps()],
                  "events": [r["data"] for r in tx.of("event") if r["kind"] == "flops"],
                  "source": tx.run_info["meta"]["flops_source"], "same": same,
                  "graphs": counters["stats"]["unique_graphs"], "counters": run.counters,
                  "refused": mfu.measure_uncompiled(DataDependent(), (torch.randn(2, 2),), {})}))
"""


def test_a_compiled_model_is_measured_once_on_its_eager_module_without_disturbing_it(tmp_path: Path) -> None:
    out = _script(tmp_path, _COMPILED_JOB)
    b = 8
    fwd = 2 * b * (16 * 32 + 32 * 8)
    want = fwd + 2 * 2 * b * 32 * 8 + 2 * b * 16 * 32  # backward: no grad input for the first layer
    assert out["flops"] == [want, want, want], out
    assert out["flags"][0] & fs.FLAG_FLOPS_MEASURED and not out["flags"][1] & fs.FLAG_FLOPS_MEASURED
    (ev,) = out["events"]
    assert ev["method"] == "uncompiled_fake" and ev["forwards"] == 1 and ev["forward_flops"] == fwd
    assert out["counters"]["flops_not_measured_compiled"] == 0 and out["counters"]["internal_errors"] == 0
    # the measurement touched nothing: the compiled model trained exactly like an eager twin, and Dynamo
    # compiled one graph (no frame skipped because of a dispatch mode)
    assert out["same"] and out["graphs"] == 1
    assert out["refused"].startswith("replay failed: ")


def test_dtype_is_detected_from_autocast_and_parameters() -> None:
    import torch

    m = torch.nn.Linear(4, 4)
    assert mfu.detect_dtype(m) == ("fp32", "parameters")
    assert mfu.detect_dtype(torch.nn.Linear(4, 4).to(torch.bfloat16)) == ("bf16", "parameters")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mfu.detect_dtype(m) == ("bf16", "autocast")
    assert mfu.detect_dtype() == ("fp32", "default")


def test_an_autocast_inside_forward_is_found_before_it_is_entered() -> None:
    """Accelerate (the HF Trainer with ``bf16=True``) enters autocast inside ``model.forward``: the
    forward is replaced by an autocast-decorated one, wrapped again to cast outputs to fp32, and DDP
    wraps the module afterwards. At the first forward's pre-hook autocast is still off; the dtype is
    read from the wrapper (found on a real H200 by bench/gpu_check.py: such jobs recorded fp32)."""
    import functools
    from types import MethodType

    import torch

    class ConvertOutputs:  # accelerate.utils.operations.ConvertOutputsToFp32, in shape
        def __init__(self, fwd: Any) -> None:
            self.model_forward = fwd
            functools.update_wrapper(self, fwd)

        def __call__(self, *a: Any, **k: Any) -> Any:
            return self.model_forward(*a, **k).float()

    m = torch.nn.Linear(4, 4)
    fwd = torch.autocast("cpu", dtype=torch.bfloat16)(m.forward.__func__)
    m.forward = MethodType(fwd, m)  # type: ignore[method-assign]
    m.forward = MethodType(ConvertOutputs(m.forward.__func__), m)  # type: ignore[method-assign]
    assert mfu.detect_dtype(m) == ("bf16", "autocast")

    class Wrapper(torch.nn.Module):  # DDP / FSDP(1): the patched module is ``.module``
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

        def forward(self, x: Any) -> Any:
            return self.module(x)

    assert mfu.detect_dtype(Wrapper(m)) == ("bf16", "autocast")
    plain = torch.nn.Linear(4, 4)
    plain.forward = MethodType(torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)(plain.forward.__func__), plain)  # type: ignore[method-assign]
    assert mfu.detect_dtype(plain) == ("fp32", "parameters")  # a disabled autocast is no autocast
    assert mfu.detect_dtype(Wrapper(torch.nn.Linear(4, 4))) == ("fp32", "parameters")


def _h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_env, "detect_device", lambda *a, **k: agent_env.DeviceEnv(
        device_type="H100", device_name="NVIDIA H100 80GB HBM3", device_count=1))


def test_an_fp32_job_gets_no_bf16_peak_and_the_env_var_sets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    _h100(monkeypatch)
    monkeypatch.delenv("FLEETSCOPE_PEAK_FLOPS", raising=False)
    fs.init("dtype-fp32", transport=FakeTransport, collectives=False).finish()
    info = FakeTransport.instances[-1].run_info
    # an fp32 job on an H100: the table has no fp32 peak, so no MFU rather than one against bf16's
    assert info["meta"]["dtype"] == "fp32" and info["meta"]["dtype_source"] == "default"
    assert info["peak_flops"] is None and info["meta"]["peak_flops_source"] is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fs.init("dtype-bf16", transport=FakeTransport, collectives=False).finish()
    info = FakeTransport.instances[-1].run_info
    assert info["meta"]["dtype"] == "bf16" and info["peak_flops"] == 989e12
    assert info["meta"]["peak_flops_source"] == "table"
    monkeypatch.setenv("FLEETSCOPE_PEAK_FLOPS", "67e12")
    fs.init("dtype-env", transport=FakeTransport, collectives=False).finish()
    info = FakeTransport.instances[-1].run_info
    assert info["peak_flops"] == 67e12 and info["meta"]["peak_flops_source"] == "env"
    fs.init("dtype-given", transport=FakeTransport, collectives=False, peak_flops=1e12).finish()
    assert FakeTransport.instances[-1].run_info["peak_flops"] == 1e12  # the argument wins over the variable
    monkeypatch.setenv("FLEETSCOPE_PEAK_FLOPS", "fast")
    fs.init("dtype-bad-env", transport=FakeTransport, collectives=False, dtype="fp32").finish()
    info = FakeTransport.instances[-1].run_info
    assert info["peak_flops"] is None and info["meta"]["dtype_source"] == "given"  # unusable: ignored
