"""`fleetscope demo`: serve + a synthetic fleet history loaded through the real ingest API."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from fleetscope.server.settings import Settings

from .synthetic import PeakMemory, RunSpec, collective_rows, rank_step_rows

__all__ = ["run_demo", "fleet_history", "load_history"]

log = logging.getLogger(__name__)
DAY = 86400.0


#: the smallest world size a family's demo runs use: llm-70b's sharded states (16 bytes a parameter, 1.1 TB)
#: must leave room for activations on an 80 GB device
MIN_WORLD = {"llm-70b": 32}


def fleet_history(*, small: bool = False, now: float | None = None) -> list[RunSpec]:
    """The demo fleet: several families and cluster sizes over three weeks ending ``now`` (default: the
    current time), with one regression at a known commit, one straggler node and one comm-bound
    configuration. Every run uses the realistic model (``RunSpec.realistic``: each family's own
    parallelism, memory and collectives). Names are fixed: re-loading is idempotent."""
    now = time.time() if now is None else now
    specs: list[RunSpec] = []
    sizes = [8, 16, 32, 64] if small else [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    steps = 12 if small else 30
    t0 = now - 21 * DAY
    for fi, fam in enumerate(["vla-7b", "llm-70b", "vit-h", "video-dit-3b"]):
        for si, n in enumerate(sizes):
            if (n > 1024 and fam != "llm-70b") or n < MIN_WORLD.get(fam, 1):
                continue
            specs.append(RunSpec(name=f"{fam}-scale-{n}", family=fam, world_size=n, steps=steps, seed=fi * 100 + si,
                                 start_ts=t0 + (fi * len(sizes) + si) * 3600, realistic=True))
    # nightly runs of vla-7b at 64 GPUs, the last one started two hours ago: a regression lands at commit
    # c0de0010 (night 10) and is never fixed, so `fleetscope check` fails on every later night
    nightly = 8 if small else 21
    for d in range(nightly):
        specs.append(RunSpec(name=f"vla-7b-nightly-{d:02d}", family="vla-7b", world_size=32 if small else 64,
                             steps=steps, seed=1000 + d, start_ts=now - (nightly - 1 - d) * DAY - 2 * 3600,
                             slow_factor=1.18 if d >= nightly // 2 else 1.0, realistic=True))
    # a run with a straggler node (all 8 ranks of node 1 are slow)
    n = 32 if small else 256
    specs.append(RunSpec(name="llm-70b-straggler-node", family="llm-70b", world_size=n, steps=steps, seed=7,
                         straggler={r: 1.3 for r in range(8, 16)}, start_ts=now - 5 * 3600, realistic=True))
    specs.append(RunSpec(name="video-dit-3b-comm-bound", family="video-dit-3b", world_size=n, steps=steps, seed=8,
                         comm_bound=True, start_ts=now - 4 * 3600, realistic=True))
    return specs


def commit_of(spec: RunSpec, nightly: int) -> str | None:
    if not spec.name.startswith("vla-7b-nightly-"):
        return None
    d = int(spec.name.rsplit("-", 1)[1])
    return f"c0de{d:04d}"


def load_history(client: Any, specs: list[RunSpec], *, batch_rank_steps: int = 20_000) -> int:
    """Register and ingest every run through the HTTP API; returns rank-steps sent."""
    from .client import columnar
    from .wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

    sent = 0
    nightly = sum(1 for s in specs if s.name.startswith("vla-7b-nightly-"))
    for spec in specs:
        info = spec.run_info()
        info["git_commit"] = commit_of(spec, nightly)
        info["started_at"] = spec.start_ts
        run_id = client.register_run(info)
        hosts = [{"rank": r, "host": spec.host_of(r), "node": spec.host_of(r), "local_rank": r % spec.gpus_per_node,
                  "device": spec.gpu} for r in range(spec.world_size)]
        buf: list[tuple] = []
        cbuf: list[tuple] = []
        first = True
        end_ts = spec.start_ts
        peaks = PeakMemory()
        for step, rows in rank_step_rows(spec):
            end_ts = max(end_ts, max(r[3] + r[2] for r in rows))  # ts + step_s (wire field order)
            buf.extend(rows)
            cbuf.extend(collective_rows(spec, step, rows))
            peaks.add(rows)
            if len(buf) >= batch_rank_steps or step == spec.steps - 1:
                batch: dict[str, Any] = {"v": 1, "run_id": run_id, "rank_steps": columnar(buf, RANK_STEP_FIELDS),
                                         "collectives": columnar(cbuf, COLLECTIVE_FIELDS)}
                if first:
                    batch["ranks"] = hosts
                    first = False
                if step == spec.steps - 1:  # what the agent sends: its DDP / FSDP facts, each rank's memory figures
                    batch["events"] = peaks.events(spec, end_ts)
                client.ingest(batch)
                sent += len(buf)
                buf, cbuf = [], []
        client.finish_run(run_id, finished_at=end_ts)  # history runs ended when their steps did
    return sent


def run_demo(settings: Settings, *, with_job: bool = True, small: bool = False, exit_when_loaded: bool = False) -> None:
    """Start the server, load the demo fleet, print the URL, and stay up until Ctrl-C."""
    from fleetscope.server.auth import create_token
    from fleetscope.server.serve import run_server
    from fleetscope.webapp import create_web_app

    from .client import Client

    state: dict[str, Any] = {}

    def on_ready(base: str, app: Any) -> None:
        try:
            # the history is the server's own data: loaded with an admin token (it re-finishes runs a
            # previous demo created); the live job gets an ordinary ingest token, like any job
            engine = app.state.fs.engine
            loader = create_token(engine, "demo-history", scope="admin", replace=True)
            with Client(base, loader) as c:
                print(f"fleetscope demo: loading the synthetic fleet history into {base} ...", flush=True)
                n = load_history(c, fleet_history(small=small))
                print(f"fleetscope demo: loaded {n:,} rank-steps", flush=True)
            if with_job:
                from .demo_job import start_job

                token = create_token(engine, "demo-job", replace=True)
                state["job"] = start_job(base, token, log_dir=Path(settings.data_dir) / "demo-job")
            print(f"\n  fleetscope dashboard: {base}/\n  API docs: {base}/docs\n  Ctrl-C to stop\n", flush=True)
        finally:
            if exit_when_loaded:  # also when loading failed: never leave a caller waiting
                os.kill(os.getpid(), signal.SIGINT)

    def on_shutdown() -> None:
        job = state.pop("job", None)
        if job is not None:
            job.stop()

    run_server(settings, app_factory=create_web_app, on_ready=on_ready, on_shutdown=on_shutdown)
