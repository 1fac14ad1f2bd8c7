"""A small residual MLP "transformer-ish" model with optional activation checkpointing, and the FLOP
expectations of its training step computed with ``FlopCounterMode`` on the plain (un-checkpointed)
model. Imported by the agent HFU tests and by the torchrun job of the end-to-end test."""

from __future__ import annotations

from typing import Any

import torch

D_IN, D, LAYERS, D_OUT = 32, 64, 4, 16


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    """``ckpt``: None (plain), "reentrant" or "nonreentrant" (every block checkpointed)."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.emb = torch.nn.Linear(D_IN, D)
        self.blocks = torch.nn.ModuleList(Block(D) for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x)
        for b in self.blocks:
            if self.ckpt is None:
                h = b(h)
            else:
                h = checkpoint(b, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def train_step(model: Net, x: torch.Tensor) -> None:
    """forward + backward; non-reentrant checkpointing recomputes whole blocks (no early stop), so the
    recomputation is exactly the blocks' forward."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        model(x).square().mean().backward()


def expectations(batch: int, seq: int) -> dict[str, Any]:
    """FLOPs of one training step on a (batch, seq, D_IN) input, from FlopCounterMode on the plain
    model: ``model`` = forward + backward; ``recompute`` = the checkpointed blocks' forward;
    ``hw`` = model + recompute (what a checkpointed model really runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    plain = Net()
    x = torch.randn(batch, seq, D_IN)
    with FlopCounterMode(display=False) as m:
        plain(x).square().mean().backward()
    model = m.get_total_flops()
    with torch.no_grad():
        h = plain.emb(x)
        with FlopCounterMode(display=False) as f:  # the blocks' forward only
            for b in plain.blocks:
                h = b(h)
    recompute = f.get_total_flops()
    return {"model": model, "recompute": recompute, "hw": model + recompute}
