"""Hang detection latency on a real job (#21): a 4-rank gloo DDP job, unmodified under ``fleetscope run --
torchrun``, where rank 2 stops inside step 6 (a sleep in its data loader) while the others block in the
step's all_reduce — at two step times.

    python bench/health_job.py [--step-ms 50,500] [--stall-min-s 10] [--interval-s 5]

A real server (``fleetscope serve``, embedded Postgres, a local Slack receiver; ``bench/health.py``'s
helpers) with the health pass every ``--interval-s`` s and ``stall_min_s`` = ``--stall-min-s``; the
agent's heartbeat is its default (5 s, ``FLEETSCOPE_HEARTBEAT_S``). Hang start = the moment rank 2
starts sleeping (the job writes its wall time); ``/health`` is polled every 0.2 s. Figures per step
time: seconds from hang start to state ``hung`` (with the missing rank named) and to the Slack
message, the server's threshold (max(stall_min_s, 10 × p99 step)), and what detection added beyond it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from health import FIGURES, Slack, figure, start_server  # noqa: E402

JOB = """
import os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step_s = float(os.environ["STEP_S"])

def next_batch(step):
    time.sleep(step_s)
    if rank == 2 and step == 6:
        with open("hang_start", "w") as f:
            f.write(repr(time.time()))
        time.sleep(float(os.environ["HANG_S"]))
    return torch.randn(4, 8)

for step in range(8):
    model(next_batch(step)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def one(base: str, slack: Slack, step_s: float, args: argparse.Namespace, work: Path) -> None:
    name = f"job-hang-{int(step_s * 1000)}ms"
    d = work / name
    d.mkdir()
    (d / "train.py").write_text(textwrap.dedent(JOB))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLEETSCOPE_SERVER": base, "FLEETSCOPE_SPOOL_DIR": str(d / "spool"),
           "STEP_S": str(step_s), "HANG_S": str(args.hang_s)}
    for var in ("FLEETSCOPE_RUN_NAME", "FLEETSCOPE_JOB_ID", "FLEETSCOPE_TOKEN"):
        env.pop(var, None)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.Popen([sys.executable, "-m", "fleetscope.cli", "run", "--name", name, "--", torchrun, "--standalone",
                             "--nproc-per-node", "4", "train.py"], cwd=d, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    n_slack = len(slack.got)
    try:
        deadline = time.time() + args.hang_s + 60
        t_hung: float | None = None
        h: dict[str, Any] = {}
        rid = None
        while time.time() < deadline:
            if rid is None:
                runs = httpx.get(f"{base}/api/v1/runs", params={"name": name}, timeout=30).json()["runs"]
                rid = runs[0]["id"] if runs else None
            elif (d / "hang_start").exists():
                h = httpx.get(f"{base}/api/v1/runs/{rid}/health", timeout=30).json()
                if h.get("state") == "hung" and t_hung is None:
                    t_hung = time.time()
                if t_hung is not None and len(slack.got) > n_slack:
                    break
            time.sleep(0.2)
        start = float((d / "hang_start").read_text())
        if t_hung is None:
            raise SystemExit(f"{name}: never hung within the bench's wait: {h}")
        t_slack = slack.got[n_slack][0] if len(slack.got) > n_slack else float("nan")
        threshold = float(h.get("threshold_s") or args.stall_min_s)
        print(f"{name}: missing {h.get('missing_ranks')}, finding: {h.get('finding')}", file=sys.stderr)
        figure(f"{name}_missing_rank_named", float(h.get("missing_ranks") == [2]), "bool")
        figure(f"{name}_hang_to_hung_s", t_hung - start, "s")
        figure(f"{name}_hang_to_slack_s", t_slack - start, "s")
        figure(f"{name}_stall_threshold_s", threshold, "s")
        figure(f"{name}_detection_beyond_threshold_s", t_hung - start - threshold, "s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", default="50,500")
    ap.add_argument("--stall-min-s", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--hang-s", type=float, default=90.0, help="how long rank 2 sleeps")
    args = ap.parse_args()
    from fleetscope.server.db import EmbeddedPostgres, upgrade

    work = Path(tempfile.mkdtemp(prefix="fshj-", dir="/tmp"))
    atexit.register(shutil.rmtree, work, True)
    pg = EmbeddedPostgres(str(work / "pg"))
    pg.start()
    url = pg._server.get_uri("postgres")
    upgrade(url)
    slack = Slack()
    proc, base = start_server(url, slack.url, args)
    try:
        figure("health_pass_interval_s", args.interval_s, "s")
        figure("server_stall_min_s", args.stall_min_s, "s")
        for ms in (float(x) for x in args.step_ms.split(",") if x):
            one(base, slack, ms / 1000, args, work)
    finally:
        proc.terminate()
        proc.wait(30)
        slack.close()
        pg.stop()
    figure("load_average_1min", os.getloadavg()[0], "runnable")
    for name, value, unit in FIGURES:
        print(f"{name}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
