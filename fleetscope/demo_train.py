"""A small multimodal-style transformer trained with DDP (gloo, CPU) and instrumented by the agent.

Run under torchrun (the demo and the end-to-end tests do)::

    torchrun --nproc-per-node 4 -m fleetscope.demo_train --run-name demo-live --steps 200

Variable-length "vision" + "text" sequences are packed into fixed (batch, seq) blocks with padding,
so tokens, padded tokens and per-modality tokens vary per step. ``analytic_flops`` gives the exact
matmul FLOPs of one training step, for checking MFU.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: this module must import without it
    from torch import Tensor, nn

__all__ = ["TinyTransformer", "analytic_flops", "main"]


def _torch() -> Any:
    import torch

    return torch


def build_model(vocab: int, dim: int, layers: int, heads: int) -> nn.Module:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            b, s, d = x.shape
            h = heads
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h) + mask
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
            x = x + self.proj(y)
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: Tensor, pad_mask: Tensor) -> Tensor:
            x = self.emb(tokens)
            mask = torch.zeros(tokens.shape[0], 1, 1, tokens.shape[1])
            mask = mask.masked_fill(~pad_mask[:, None, None, :], -1e9)
            for blk in self.blocks:
                x = blk(x, mask)
            return self.head(x)

    return TinyTransformer()


TinyTransformer = build_model  # the factory (torch is imported lazily)


def analytic_flops(*, batch: int, seq: int, vocab: int, dim: int, layers: int, heads: int) -> float:
    """Matmul FLOPs of one forward+backward (backward = 2x forward), as FlopCounterMode counts them."""
    t = batch * seq
    per_layer = 2 * t * (dim * 3 * dim + dim * dim + dim * 4 * dim + 4 * dim * dim)
    per_layer += 2 * (2 * batch * heads * seq * seq * (dim // heads))  # QK^T and AV
    fwd = layers * per_layer + 2 * t * dim * vocab
    return 3.0 * fwd


class PackedDataset:
    """Deterministic variable-length vision+text samples packed into (batch, seq) with padding."""

    def __init__(self, *, steps: int, batch: int, seq: int, vocab: int, seed: int) -> None:
        self.steps, self.batch, self.seq, self.vocab, self.seed = steps, batch, seq, vocab, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, Any]:
        torch = _torch()
        rng = random.Random(self.seed * 1_000_003 + i)
        tokens = torch.zeros(self.batch, self.seq, dtype=torch.long)
        pad = torch.zeros(self.batch, self.seq, dtype=torch.bool)
        vision = text = 0
        for b in range(self.batch):
            n_vis = rng.randint(8, self.seq // 2)
            n_txt = rng.randint(4, self.seq - n_vis)
            n = n_vis + n_txt
            tokens[b, :n] = torch.randint(1, self.vocab, (n,), generator=torch.Generator().manual_seed(rng.getrandbits(31)))
            pad[b, :n] = True
            vision += n_vis
            text += n_txt
        return {"tokens": tokens, "pad": pad, "vision": vision, "text": text}


def counts(batch: dict[str, Any]) -> dict[str, Any]:
    """Tokens of one packed batch for the agent: real per modality, padded, samples."""
    return {
        "tokens": {"vision": batch["vision"], "text": batch["text"]},
        "padded_tokens": int(batch["tokens"].numel()),
        "samples": int(batch["tokens"].shape[0]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-name", dest="run", default=os.environ.get("FLEETSCOPE_RUN", "demo-live"))
    ap.add_argument("--family", default="tiny-vla")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--peak-flops", type=float, default=None, help="per-device peak FLOP/s (CPU has none)")
    ap.add_argument("--sleep-ms", type=float, default=0.0, help="pause per step (a slower, watchable demo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ddp-python-hook", action="store_true",
                    help="give DDP torch's default Python all-reduce comm hook when the agent did not register "
                         "its own (a benchmark reference: the cost of a Python comm hook itself)")
    ap.add_argument("--timing-out", default=None, metavar="FILE",
                    help="rank 0 writes the wall time of each loop iteration (perf_counter, s) to FILE as JSON")
    args = ap.parse_args(argv)

    torch = _torch()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fleetscope.agent as fs

    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    shape = {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "dim": args.dim, "layers": args.layers,
             "heads": args.heads}
    run = fs.init(name=args.run, model_family=args.family, config={**shape, "optimizer": "adamw", "lr": 3e-4},
                  peak_flops=args.peak_flops, dtype="fp32")
    model = DDP(build_model(args.vocab, args.dim, args.layers, args.heads))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = PackedDataset(steps=args.steps, batch=args.batch, seq=args.seq, vocab=args.vocab,
                         seed=args.seed * 100 + dist.get_rank())
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False, num_workers=0)
    loader = run.instrument(model=model, optimizer=opt, dataloader=loader, counts=counts)
    if args.ddp_python_hook and not getattr(model, "_fleetscope_comm_hook", False):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    done = 0
    times: list[float] | None = [] if args.timing_out and dist.get_rank() == 0 else None
    cpu: list[float] = []  # CPU time of this process (all its threads: the agent's sender too) per iteration
    t_prev = t_start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes of a host
    c_prev = time.process_time()
    for batch in loader:
        logits = model(batch["tokens"], batch["pad"])
        loss = (loss_fn(logits[:, :-1].reshape(-1, args.vocab), batch["tokens"][:, 1:].reshape(-1))
                * batch["pad"][:, 1:].reshape(-1)).sum() / batch["pad"].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done += 1
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1e3)
        if times is not None:  # the whole iteration, next(loader) included
            t = time.perf_counter()
            c = time.process_time()
            times.append(t - t_prev)
            cpu.append(c - c_prev)
            t_prev, c_prev = t, c
    run.finish()
    if times is not None:
        import json

        with open(args.timing_out, "w") as f:
            json.dump({"rank": 0, "agent": not isinstance(run, fs.NoopRun), "t0": t_start, "step_s": times,
                       "cpu_s": cpu}, f)
    print(f"fleetscope-demo-train: rank {dist.get_rank()} finished {done} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
