"""How the agent describes a process group (``comm_group`` events): an arithmetic progression of any
size as start/stride (exact, a few bytes), anything else as a list of at most MAX_GROUP_RANKS_LISTED
ranks; the server's limit is the same number; a failure never reaches the training loop. No torch:
``torch.distributed``'s lookups are stood in for by a small fake of the two functions used."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fleetscope.agent import collectives
from fleetscope.server.limits import MAX_GROUP_RANKS_LISTED


class _C10d:
    """The two ``distributed_c10d`` functions ``_describe`` calls, answering from a table."""

    def __init__(self, ranks: dict[str, list[int]]) -> None:
        self.ranks = ranks

    def get_process_group_ranks(self, group: Any) -> list[int]:
        if group.group_name == "broken":
            raise RuntimeError("not a member")
        return list(self.ranks[group.group_name])


class _Group:
    def __init__(self, name: str) -> None:
        self.group_name = name


class _Run:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple[str, Any, dict[str, Any]]] = []
        self.fail = fail

    def _event(self, kind: str, step: Any, data: dict[str, Any]) -> None:
        if self.fail:
            raise OSError("transport gone")
        self.events.append((kind, step, data))


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Run]:
    run = _Run()
    monkeypatch.setattr(collectives, "_run", run)
    monkeypatch.setattr(collectives, "_labels_sent", set())
    yield run


def test_a_progression_is_sent_as_start_and_stride_whatever_its_size() -> None:
    assert collectives.group_members([3]) == {"start": 3, "stride": 1}
    assert collectives.group_members([0, 1]) == {"start": 0, "stride": 1}
    big = list(range(5, 5 + 8 * 262_144, 8))  # a 262,144-rank data-parallel group of stride 8
    assert collectives.group_members(big) == {"start": 5, "stride": 8}
    assert collectives.group_members([0, 1, 3]) == {"ranks": [0, 1, 3]}
    odd = [0, 1, *range(3, 2 * MAX_GROUP_RANKS_LISTED + 3, 2)]  # not a progression, longer than the limit
    assert collectives.group_members(odd) == {"ranks": odd[:MAX_GROUP_RANKS_LISTED]}
    assert collectives.MAX_GROUP_RANKS_LISTED == MAX_GROUP_RANKS_LISTED  # the agent and the server agree


def test_describe_sends_one_event_per_group_in_the_compact_form(fake_torch: _Run, monkeypatch: pytest.MonkeyPatch) -> None:
    dp = list(range(1, 16_384, 8))
    monkeypatch.setattr(collectives, "_c10d", _C10d({"dp": dp, "ep": [0, 4, 5, 9], "tp": list(range(8, 16))}))
    collectives._describe(_Group("dp"), len(dp), "dp")
    collectives._describe(_Group("dp"), len(dp), "dp")  # once per group
    collectives._describe(_Group("ep"), 4, "ep")
    collectives._describe(_Group("tp"), 8, "tp")
    collectives._describe(_Group("broken"), 8, "pp")  # its ranks cannot be read: described without them
    assert [(k, d) for k, _s, d in fake_torch.events] == [
        ("comm_group", {"dim": "dp", "size": 2048, "group": "dp", "start": 1, "stride": 8}),
        ("comm_group", {"dim": "ep", "size": 4, "group": "ep", "ranks": [0, 4, 5, 9]}),
        ("comm_group", {"dim": "tp", "size": 8, "group": "tp", "start": 8, "stride": 1}),
        ("comm_group", {"dim": "pp", "size": 8, "group": "broken"}),
    ]


def test_describe_never_raises_into_the_training_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_run", _Run(fail=True))
    monkeypatch.setattr(collectives, "_labels_sent", set())
    monkeypatch.setattr(collectives, "_c10d", _C10d({"dp": [0, 1]}))
    collectives._describe(_Group("dp"), 2, "dp")  # the event fails: nothing escapes
    monkeypatch.setattr(collectives, "_c10d", None)  # torch.distributed gone
    collectives._describe(_Group("tp"), 2, "tp")


def test_the_agents_collectives_module_imports_without_torch() -> None:
    code = ("import sys; import fleetscope.agent.collectives as c; "
            "assert c.group_members([0, 2, 4]) == {'start': 0, 'stride': 2}; assert 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
