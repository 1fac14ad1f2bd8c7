"""Memory per module (agent/memory_modules.py), measured with the FLOP count on a real model: saved
activations, parameters, gradients and optimizer state per module against hand counts (fp32, known
shapes), checkpointed blocks (their saved bytes are their inputs; what checkpointing drops is measured),
the bound on the event's size, and that a failing measurement never reaches the training step."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fleetscope.agent.memory_modules import MAX_MODULES  # noqa: E402
from fleetscope.agent.mfu import FlopMeter  # noqa: E402

B, DIN, H, DOUT = 8, 16, 32, 4
F = 4  # bytes per fp32 element


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.act(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, ckpt: str | None = None, n: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(DIN, H)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(n)])
        self.out = torch.nn.Linear(H, DOUT)
        self.ckpt = ckpt

    def forward(self, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else b(x)
        return self.out(x)


def _measure(model: Any, *, manual: bool = False, optimizer: str = "adam") -> dict[str, Any]:
    """One training step with the FLOP meter started as the agent starts it: from the model's forward
    pre-hook (automatic mode) or before the call (a ``forward`` phase)."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters()) if optimizer == "adam" else torch.optim.SGD(model.parameters(), lr=0.1)
    got: list[dict[str, Any]] = []
    meter = FlopMeter(memory_emit=got.append)
    h = None
    if manual:
        meter.start()
    else:
        h = model.register_forward_pre_hook(lambda m, a: None if meter.active else meter.start(), prepend=True)
    y = model(torch.randn(B, DIN))
    y.pow(2).sum().backward()
    meter.stop()
    opt.step()
    if h is not None:
        h.remove()
    assert len(got) == 1 and meter.memory is not None and meter.memory.failed is None
    return got[0]


def _by_name(ev: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cols = ev["modules"]
    return {n: {k: v[i] for k, v in cols.items()} for i, n in enumerate(cols["name"])}


@pytest.mark.parametrize("manual", [False, True])
def test_hand_counted_saved_activations_parameters_gradients_and_adam_state(manual: bool) -> None:
    torch.set_num_threads(1)
    ev = _measure(Net(), manual=manual)
    m = _by_name(ev)
    lin_in, lin_h, lin_out = (DIN * H + H) * F, (H * H + H) * F, (H * DOUT + DOUT) * F
    # saved for backward, each storage once, by the first module that saved it:
    # inp saves the batch x; each fc1 its input; each ReLU its output (which fc2 saves again: counted once);
    # out saves its input (the last fc2's output)
    assert m["inp"]["activation_bytes"] == B * DIN * F
    for k in range(3):
        assert m[f"blocks.{k}.fc1"]["activation_bytes"] == B * H * F
        assert m[f"blocks.{k}.act"]["activation_bytes"] == B * H * F
        assert m[f"blocks.{k}.fc2"]["activation_bytes"] == 0
        assert m[f"blocks.{k}.fc1"]["param_bytes"] == lin_h == m[f"blocks.{k}.fc1"]["grad_bytes"]
        # Adam: exp_avg and exp_avg_sq per parameter, plus a 0-d fp32 step per parameter
        assert m[f"blocks.{k}.fc2"]["optim_bytes"] == 2 * lin_h + 2 * F
        assert m[f"blocks.{k}"]["checkpointed"] is False
        # forward FLOPs of a block (its children included): two H×H matmuls over B rows
        assert m[f"blocks.{k}"]["flops"] == 2 * (2 * B * H * H)
    assert m["out"]["activation_bytes"] == B * H * F
    assert ev["totals"]["activation_bytes"] == B * DIN * F + 3 * 2 * B * H * F + B * H * F
    assert ev["totals"]["param_bytes"] == lin_in + 6 * lin_h + lin_out == ev["totals"]["grad_bytes"]
    assert ev["totals"]["optim_bytes"] == 2 * (lin_in + 6 * lin_h + lin_out) + 16 * F
    # the weights the matmuls saved are parameters, not activations (inp's is not needed: x needs no grad)
    assert ev["totals"]["param_saved_bytes"] == 6 * H * H * F + H * DOUT * F
    assert ev["forward_flops"] == 2 * B * (DIN * H + 6 * H * H + H * DOUT)
    assert ev["micro_batch"] == B and ev["forwards"] == 1 and ev["optimizer"] == "Adam"
    assert m["(model)"]["param_bytes"] == 0 and ev["cost_s"] > 0


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_checkpointed_blocks_keep_only_their_inputs(ckpt: str) -> None:
    torch.set_num_threads(1)
    ev = _measure(Net(ckpt))
    m = _by_name(ev)
    for k in range(3):
        blk = m[f"blocks.{k}"]
        assert blk["checkpointed"] is True and m[f"blocks.{k}.fc1"]["checkpointed"] is True
        assert blk["activation_bytes"] == B * H * F  # the block's input, kept by the checkpoint
        assert m[f"blocks.{k}.act"]["activation_bytes"] == 0 and m[f"blocks.{k}.fc1"]["activation_bytes"] == 0
        if ckpt == "nonreentrant":
            # what the block would keep without checkpointing beyond its input: the ReLU's output
            assert m[f"blocks.{k}.act"]["ckpt_saved_bytes"] == B * H * F
    assert m["inp"]["checkpointed"] is False and m["out"]["checkpointed"] is False
    assert ev["totals"]["activation_bytes"] == B * DIN * F + 3 * B * H * F + B * H * F
    if ckpt == "nonreentrant":
        assert ev["totals"]["ckpt_saved_bytes"] == 3 * B * H * F


def test_the_event_is_bounded_and_folds_deeper_modules_into_listed_ancestors() -> None:
    torch.set_num_threads(1)
    ev = _measure(Net(n=100), optimizer="sgd")  # 1 + 3 + 100 + 300 modules
    names = ev["modules"]["name"]
    assert len(names) <= MAX_MODULES and ev["modules_total"] == 404
    m = _by_name(ev)
    assert "blocks.99" in m and not any(n.endswith(".fc1") for n in names)  # depth 3 does not fit: folded
    assert m["blocks.7"]["activation_bytes"] == 2 * B * H * F and m["blocks.7"]["param_bytes"] == 2 * (H * H + H) * F
    assert ev["totals"]["activation_bytes"] == B * DIN * F + 100 * 2 * B * H * F + B * H * F
    assert ev["totals"]["optim_bytes"] == 0  # plain SGD keeps no state
    assert len(names) * len(ev["modules"]) < 4_000  # within the server's MAX_MEMORY_MODULES_VALUES


def test_a_failing_measurement_never_reaches_the_training_step() -> None:
    torch.set_num_threads(1)

    def boom(data: dict[str, Any]) -> None:
        raise RuntimeError("transport down")

    model = Net()
    opt = torch.optim.Adam(model.parameters())
    meter = FlopMeter(memory_emit=boom)
    h = model.register_forward_pre_hook(lambda m, a: None if meter.active else meter.start(), prepend=True)
    model(torch.randn(B, DIN)).sum().backward()
    assert meter.stop() is not None  # the FLOPs are still counted
    opt.step()  # the emit raised inside the optimizer's hook: caught
    h.remove()
    assert meter.memory is not None and meter.memory.failed is not None
    # no hook is left behind: the next step runs as without the agent
    from torch.nn.modules import module as nn_module

    assert not any("memory_modules" in repr(f) for f in nn_module._global_forward_pre_hooks.values())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


_SHARDED_JOB = """
import json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from fleetscope.agent.mfu import FlopMeter
B, D, H = 4, 16, 32


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, H, bias=False)
        self.down = torch.nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(sys.argv[1],))
model = MLP()
if sys.argv[1] == "tp":
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
else:
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters())
got = []
meter = FlopMeter(memory_emit=got.append)
h = model.register_forward_pre_hook(lambda m, a: None if meter.active else meter.start(), prepend=True)
model(torch.randn(B, D)).pow(2).mean().backward()
meter.stop()
opt.step()
print(json.dumps({"ev": got[0] if got else None, "failed": meter.memory.failed}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_parameters_gradients_and_optimizer_state_are_this_ranks_shards(tmp_path: Any, layout: str) -> None:
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "job.py").write_text(_SHARDED_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, "job.py", layout], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["failed"] is None and out["ev"] is not None
    m = _by_name(out["ev"])
    d, h, b = 16, 32, 4
    for name in ("up", "down"):  # a D×H weight split over 2 ranks (TP: DTensor shards; FSDP2: DTensor shards)
        assert m[name]["param_bytes"] == d * h * F // 2 == m[name]["grad_bytes"]
        assert m[name]["optim_bytes"] == 2 * d * h * F // 2 + F  # Adam's moments of the local shard
    assert m["up"]["activation_bytes"] == b * d * F  # the (replicated) input
    # the ReLU output, saved in the model's own forward: local columns under TP, whole under FSDP
    assert m["(model)"]["activation_bytes"] == b * h * F // (2 if layout == "tp" else 1)
    # the weight down saved: a parameter (FSDP2's unsharded one included), never an activation
    assert m["down"]["activation_bytes"] == 0 and m["down"]["param_saved_bytes"] > 0


class PartlyCheckpointed(Net):
    """Net whose blocks in ``ckpt`` run under non-reentrant checkpointing (named by their module names)."""

    def __init__(self, ckpt_names: set[str], n: int = 4) -> None:
        super().__init__(None, n)
        self.names = ckpt_names

    def forward(self, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if f"blocks.{i}" in self.names else b(x)
        return self.out(x)


def test_applying_the_advice_frees_what_it_promised_at_the_recompute_it_priced() -> None:
    """Closed loop: measure, ask for a target below the activations, checkpoint what the advice names,
    measure again: the activations fell by ``saves_bytes`` (the target is met) and the FLOP counter's
    recompute equals ``recompute_flops``."""
    from fleetscope.server.analysis import checkpointing as ck

    torch.set_num_threads(1)
    before = _measure(PartlyCheckpointed(set()))
    rows = ck.decode_modules(before)
    acts = before["totals"]["activation_bytes"]
    peak = 10 * acts  # any peak: the advice works on the difference peak − target
    advice, _ = ck.checkpoint_advice(rows, peak=peak, target=peak - 2.5 * B * H * F, target_basis="test",
                                     forwards=1, flops_per_s=None, step_s=None)
    (a,) = advice
    assert a["method"] == "exact" and len(a["modules"]) == 3  # three blocks, one B×H activation each
    from torch.utils.checkpoint import set_checkpoint_early_stop

    recomputed = {}
    for early_stop in (False, True):
        model = PartlyCheckpointed(set(a["modules"]))
        got: list[dict[str, Any]] = []
        meter = FlopMeter(memory_emit=got.append)
        h = model.register_forward_pre_hook(lambda m, x, mt=meter: None if mt.active else mt.start(), prepend=True)
        opt = torch.optim.Adam(model.parameters())
        with set_checkpoint_early_stop(early_stop):
            model(torch.randn(B, DIN)).pow(2).sum().backward()
        meter.stop()
        opt.step()
        h.remove()
        after = got[0]
        assert acts - after["totals"]["activation_bytes"] == a["saves_bytes"] >= 2.5 * B * H * F
        recomputed[early_stop] = meter.recompute
    # the re-run forwards, as counted by the FLOP meter: the whole blocks' forward, as priced; with torch's
    # default early stop the recompute ends at the last saved tensor (each block's fc2 is not re-run)
    assert recomputed[False] == a["recompute_flops"]
    assert recomputed[True] == a["recompute_flops"] / 2
    cols = after["modules"]
    blocks = {n for n, c in zip(cols["name"], cols["checkpointed"], strict=True) if c and n.count(".") == 1}
    assert blocks == set(a["modules"])


def test_a_manual_mode_run_sends_one_memory_modules_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the agent's own run (``run.step`` / ``run.phase``): one ``memory_modules`` event for the run,
    from the FLOP-measured step, with the hand-counted totals; nothing counted as an internal error."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import fleetscope.agent as fs
    from agent_testutil import FakeTransport

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED", "FLEETSCOPE_SERVER"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)
    run = fs.init("mem-manual", transport=FakeTransport, collectives=False, clock="cpu")
    tx = FakeTransport.instances[-1]
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        with run.step():
            with run.phase("forward"):
                loss = model(torch.randn(B, DIN)).pow(2).sum()
            with run.phase("backward"):
                loss.backward()
            with run.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    stats = run.stats()
    run.finish()
    evs = [r["data"] for r in tx.of("event") if r["kind"] == "memory_modules"]
    assert len(evs) == 1 and stats["internal_errors"] == 0
    assert evs[0]["totals"]["activation_bytes"] == B * DIN * F + 3 * 2 * B * H * F + B * H * F
    assert evs[0]["totals"]["optim_bytes"] > 0 and evs[0]["forwards"] == 1
