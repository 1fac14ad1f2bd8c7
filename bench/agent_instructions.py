"""Agent overhead in instructions: a deterministic companion of ``bench/agent_overhead.py``.

    python bench/agent_instructions.py [--steps 3000] [--modes floor,agent,agent_no_collectives,step]

Wall-clock figures on a shared VM move by ±40 % with the neighbours' load; instruction counts do not.
Each mode's loop runs under ``valgrind --tool=callgrind`` twice, with 0 and with ``--steps``
iterations, and the difference divided by the iterations is the cost of one iteration, start-up
excluded. To keep the count deterministic the process has no other thread: the transport is a list
append (the real one's ``submit`` is not counted; its sender thread is measured by
agent_overhead.py) and torch.distributed is replaced by a stub group of one rank (so torch is not
imported), while the agent's own code — ``init``, the prebuilt context managers, the generated
collective wrapper (``collectives._make_wrapper``), the step resolution — is the real one.
Needs valgrind. Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("floor", "agent", "agent_no_collectives", "step")


class _ListTransport:
    """A ``fleetscope.agent.protocols.Transport`` whose ``submit`` is a list append."""

    def __init__(self, config: Any, run_info: dict[str, Any]) -> None:
        self.q: list[tuple[str, Any]] = []

    def submit(self, kind: str, record: Any) -> None:
        q = self.q
        if len(q) > 10_000:
            q.clear()
        q.append((kind, record))

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def finish_run(self, status: str) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class _NoopCM:
    __slots__ = ()

    def __enter__(self) -> _NoopCM:
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        return None


def _noop_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None


class _Tensor:
    nbytes = 4096


def _loop(mode: str, n: int) -> None:
    sys.path.insert(0, str(ROOT))
    import fleetscope.agent as fs
    from fleetscope.agent import collectives

    run = fs.init(name="instr", flops_per_step=1e9, transport=_ListTransport, collectives=False, clock="cpu")
    world = object()
    collectives._c10d = types.SimpleNamespace(
        _world=types.SimpleNamespace(_default_pg=world),
        GroupMember=types.SimpleNamespace(WORLD=world),
        get_world_size=lambda g: 1,
    )
    collectives._sizes[world] = (1, "world")
    all_reduce = collectives._make_wrapper("all_reduce", _noop_all_reduce)
    collectives._run = run
    run._collectives_installed = True
    t = _Tensor()
    a, b, c, d, e = (_NoopCM() for _ in range(5))
    if mode == "floor":
        for _ in range(n):
            with a:
                with b:
                    pass
                with c:
                    pass
                with d:
                    pass
                with e:
                    pass
    elif mode in ("agent", "agent_no_collectives"):
        ncoll = mode == "agent"
        for _ in range(n):
            with run.step(tokens=4096, samples=8):
                with run.phase("data"):
                    pass
                with run.phase("forward"):
                    pass
                with run.phase("backward"):
                    if ncoll:
                        all_reduce(t)
                        all_reduce(t)
                with run.phase("optimizer"):
                    pass
    elif mode == "step":
        for _ in range(n):
            with run.step():
                pass
    collectives._run = None


def _count(mode: str, n: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--child", mode, str(n)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stderr
    m = re.search(r"Collected : (\d+)", out)
    if m is None:
        raise SystemExit(f"no instruction count from valgrind:\n{out[-2000:]}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _loop(argv[1], int(argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is needed (apt-get install valgrind)")
    res = {}
    for mode in args.modes.split(","):
        res[mode] = (_count(mode, args.steps) - _count(mode, 0)) / args.steps
        print(f"{mode}: {res[mode]:,.0f} instructions per iteration", file=sys.stderr, flush=True)
    for mode, v in res.items():
        print(f"instructions_{mode}: {v:.0f} instr")
    if "agent" in res and "floor" in res:
        print(f"agent_over_floor_instructions: {res['agent'] / res['floor']:.2f} x")


if __name__ == "__main__":
    main()
