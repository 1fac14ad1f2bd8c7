"""Model vs hardware FLOPs (docs/metrics.md, "MFU and HFU"): on a real activation-checkpointed model the
measured model FLOPs equal the un-checkpointed model's, the hardware FLOPs add exactly the recomputed
forward, and padding counts for hardware FLOPs only. Expectations come from FlopCounterMode on the plain
model (ckpt_model.expectations)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent import mfu  # noqa: E402

BATCH, SEQ = 4, 32
PADDED = BATCH * SEQ  # every position is computed
REAL = 96  # a quarter of them is padding


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.set_num_threads(1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_meter_splits_recomputation_from_model_flops(ckpt: str) -> None:
    import torch
    from ckpt_model import D_IN, Net, expectations, train_step

    exp = expectations(BATCH, SEQ)
    torch.manual_seed(0)
    model = Net(ckpt)
    x = torch.randn(BATCH, SEQ, D_IN)
    meter = mfu.FlopMeter()
    meter.start()
    train_step(model, x)
    total = meter.stop()
    assert total is not None and meter.recompute is not None and meter.forward is not None
    # hardware: everything the device ran, the recomputed forward included
    assert total == pytest.approx(exp["hw"], rel=0.01)
    # model FLOPs = hardware − recompute = the un-checkpointed model's
    assert total - meter.recompute == pytest.approx(exp["model"], rel=0.01)
    assert meter.recompute == pytest.approx(exp["recompute"], rel=0.01)
    assert 1.2 < total / (total - meter.recompute) < 1.45  # about a third more work
    assert meter.forward + meter.backward + meter.recompute == total  # type: ignore[operator]


def test_plain_model_has_no_recomputation() -> None:
    import torch
    from ckpt_model import D_IN, Net, expectations, train_step

    exp = expectations(BATCH, SEQ)
    torch.manual_seed(0)
    meter = mfu.FlopMeter()
    meter.start()
    train_step(Net(), torch.randn(BATCH, SEQ, D_IN))
    assert meter.stop() == pytest.approx(exp["model"], rel=0.01)
    assert meter.recompute == 0


@pytest.mark.parametrize("dv", [32, 64])
def test_a_fused_attention_backward_recomputes_its_scores_as_hardware_work(dv: int) -> None:
    """The fused attention kernels (flash / memory-efficient / cuDNN: what SDPA runs on a GPU) keep no
    score matrix; torch's FLOP formula for their backward counts five matmuls, the first recomputing
    Q·Kᵀ. That one is recompute (hardware FLOPs), so model FLOPs of attention stay backward = 2 ×
    forward, as the math path (CPU) counts them (seen on an H200: an HF Trainer job's FLOPs were 1.2 %
    above the hand count). Meta tensors give the shapes; the counter is fed as its dispatch mode would."""
    import torch

    aten = torch.ops.aten
    b, h, s, d = 2, 4, 128, 32
    q, k, go = (torch.randn(b, h, s, d, device="meta") for _ in range(3))
    v = torch.randn(b, h, s, dv, device="meta")
    go = torch.randn(b, h, s, dv, device="meta")
    out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
    args = (go, q, k, v, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False])
    grads = aten._scaled_dot_product_efficient_attention_backward(*args)
    mode = mfu._split_counter_class()(display=False)
    mode._count_flops(aten._scaled_dot_product_efficient_attention, out, (q, k, v, None, True), {})
    mode._count_flops(aten._scaled_dot_product_efficient_attention_backward, grads, args, {})
    fwd = 2 * b * h * s * s * (d + dv)  # Q·Kᵀ and P·V
    assert mode.fwd == fwd
    assert mode.rec == 2 * b * h * s * s * d  # Q·Kᵀ again
    assert mode.bwd == 2 * fwd  # dV, dP, dQ, dK: the model's backward
    assert mode.get_total_flops() == mode.fwd + mode.bwd + mode.rec
    # any other op is left to the forward / backward / recompute rule
    mode._count_flops(aten.mm, torch.empty(4, 4, device="meta"),
                      (torch.empty(4, 8, device="meta"), torch.empty(8, 4, device="meta")), {})
    assert mode.rec == 2 * b * h * s * s * d and mode.fwd == fwd + 2 * 4 * 8 * 4


def test_agent_records_model_flops_per_real_token_and_hardware_flops_per_position() -> None:
    import torch
    from ckpt_model import D_IN, Net, expectations

    exp = expectations(BATCH, SEQ)
    run = fs.init("hfu-agent", transport=FakeTransport, collectives=False, peak_flops=1e12)
    tx = FakeTransport.instances[-1]
    torch.manual_seed(0)
    model = Net("reentrant")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reals = [REAL, REAL, PADDED]  # the last batch has no padding
    for real in reals:
        with run.step(tokens=real, padded_tokens=PADDED):
            x = torch.randn(BATCH, SEQ, D_IN)
            with run.phase("forward"):
                loss = model(x).square().mean()
            with run.phase("backward"):
                loss.backward()
            with run.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    run.finish()
    steps = tx.steps()
    assert [s["tokens"] for s in steps] == reals
    for s, real in zip(steps, reals, strict=True):
        # model FLOPs: the plain model's, for the real tokens only
        assert s["flops"] == pytest.approx(exp["model"] * real / PADDED, rel=0.01)
        # hardware FLOPs: every computed position, recomputation included
        assert s["hw_flops"] == pytest.approx(exp["hw"], rel=0.01)
    # the measured step is flagged, and its event carries the split
    (ev,) = [e for e in tx.of("event") if e["kind"] == "flops"]
    d = ev["data"]
    assert d["recompute_flops"] == pytest.approx(exp["recompute"], rel=0.01)
    assert d["hw_flops"] == pytest.approx(exp["hw"], rel=0.01) and d["padded_tokens"] == PADDED
    assert run.stats()["internal_errors"] == 0


def test_steps_without_token_counts_use_the_per_step_figures() -> None:
    import torch
    from ckpt_model import D_IN, Net, expectations

    exp = expectations(BATCH, SEQ)
    run = fs.init("hfu-no-tokens", transport=FakeTransport, collectives=False)
    tx = FakeTransport.instances[-1]
    torch.manual_seed(0)
    model = Net("reentrant")
    for _ in range(2):
        with run.step():
            with run.phase("forward"):
                loss = model(torch.randn(BATCH, SEQ, D_IN)).square().mean()
            with run.phase("backward"):
                loss.backward()
    run.finish()
    for s in tx.steps():
        assert s["flops"] == pytest.approx(exp["model"], rel=0.01)
        assert s["hw_flops"] == pytest.approx(exp["hw"], rel=0.01)


def test_estimated_flops_count_real_tokens_and_leave_hardware_unknown() -> None:
    shape = {"params": 1e6, "layers": 2, "heads": 4, "head_dim": 16, "seq_len": 128}
    run = fs.init("hfu-est", transport=FakeTransport, collectives=False, transformer=shape)
    tx = FakeTransport.instances[-1]
    with run.step(tokens=300, padded_tokens=512):
        pass
    run.finish()
    (s,) = tx.steps()
    per_token = mfu.palm_flops_per_token(**shape)
    assert s["flops"] == 300 * per_token  # padding is not model work
    assert s["hw_flops"] is None


def test_flop_rates_definitions() -> None:
    r = mfu.flop_rates(1300.0, 300.0, tokens=75, padded=100)
    assert r.step(75, 100) == (pytest.approx(750.0), pytest.approx(1300.0))
    assert r.step(50, 100) == (pytest.approx(500.0), pytest.approx(1300.0))
    assert r.step(None, None) == (1000.0, 1300.0)
    unknown = mfu.flop_rates(1300.0, None, tokens=None, padded=None)  # split not available
    assert unknown.step(10, None) == (1300.0, 1300.0)
