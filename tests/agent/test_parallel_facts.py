"""The DDP / FSDP facts the agent records once per run (agent/parallel_facts.py): what the server's bucket
advice is checked against — DDP cannot split one parameter across buckets (issue 31)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent.parallel_facts import _estimated_buckets, ddp_facts, fsdp_facts  # noqa: E402

MIB = 1 << 20


def test_ddp_facts_are_sent_once_with_the_largest_gradient_and_the_bucket_settings(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.set_num_threads(1)
        # three 4 MiB weights under a 1 MiB cap: one bucket each, whatever the cap says
        big = DDP(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)]), bucket_cap_mb=1)
        f = ddp_facts(big)
        assert f is not None
        assert f["largest_grad_bytes"] == 4 * MIB and f["grad_bytes"] == 12 * MIB and f["params"] == 3
        assert f["bucket_cap_bytes"] == MIB and f["first_bucket_bytes"] == MIB  # a set cap: no smaller first bucket
        assert f["gradient_as_bucket_view"] is False and f["buckets_estimated"] == 3
        assert f["largest_grad_param"] == "0.weight"
        # the default cap: 25 MiB with DDP's 1 MiB first bucket; gradient_as_bucket_view as given
        small = DDP(torch.nn.Linear(8, 8), gradient_as_bucket_view=True)
        g = ddp_facts(small)
        assert g is not None and g["bucket_cap_bytes"] == 25 * MIB and g["first_bucket_bytes"] == MIB
        assert g["gradient_as_bucket_view"] is True and g["largest_grad_bytes"] == 4 * 64
        assert ddp_facts(torch.nn.Linear(2, 2)) is None and fsdp_facts(torch.nn.Linear(2, 2)) is None

        run = fs.init("ddp-facts", transport=FakeTransport)
        tx = FakeTransport.instances[-1]
        opt = torch.optim.SGD(big.parameters(), lr=0.1)
        run.instrument(model=big, optimizer=opt)
        run.instrument(model=big)  # instrumented twice: still one event
        for _ in range(2):
            big(torch.randn(2, 1024)).sum().backward()
            opt.step()
            opt.zero_grad()
        run.finish()
        evs = [e for e in tx.of("event") if e.get("kind") == "ddp"]
        assert len(evs) == 1 and evs[0]["data"]["largest_grad_bytes"] == 4 * MIB
    finally:
        dist.destroy_process_group()


def test_bucket_estimate_never_splits_a_parameter() -> None:
    # DDP fills buckets from the last parameter; a bucket closes once it holds its limit
    assert _estimated_buckets([16 * MIB] * 3, MIB, 25 * MIB) == 2  # [16], [16 + 16]
    assert _estimated_buckets([16 * MIB] * 3, 4 * MIB, 4 * MIB) == 3  # each alone, above the cap
    assert _estimated_buckets([MIB // 4] * 8, MIB, MIB) == 2
    assert _estimated_buckets([], MIB, MIB) == 0


def test_fsdp2_units_and_their_full_sizes(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 4))
        fully_shard(m[0])
        fully_shard(m[1])
        fully_shard(m)
        f = fsdp_facts(m)
        # a parameter counts in the innermost unit holding it; sizes unsharded (DTensor's global numel)
        assert f == {"units": 3, "params": 6, "largest_unit_bytes": 4 * (64 * 256 + 256),
                     "smallest_unit_bytes": 4 * (256 * 4 + 4), "root_bytes": 4 * (256 * 4 + 4)}
        assert ddp_facts(m) is None
    finally:
        dist.destroy_process_group()
