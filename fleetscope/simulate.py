"""`fleetscope simulate`: one synthetic run sent through the real agent transport.

Same code path as a training job (``fleetscope.agent.transport.Transport``: bounded queue,
background sender, batching, retries, disk spool), one transport for all simulated ranks.
Deterministic per ``--seed``: running it twice with the same ``--run`` and ``--seed`` leaves exactly
the same data (the server's keys deduplicate the re-sent records).
"""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

__all__ = ["simulate", "parse_straggler", "parse_slow_node", "parse_shift", "parse_config_json", "parse_token_skew",
           "run_simulation", "parse_rank_at_step", "hang_positions", "crash_failures"]


def parse_straggler(value: str | None) -> dict[int, float]:
    """``"R"`` or ``"R:FACTOR"`` (default factor 1.3) → {rank: factor}; several comma-separated."""
    out: dict[int, float] = {}
    if not value:
        return out
    for part in value.split(","):
        rank_s, _, factor_s = part.strip().partition(":")
        try:
            rank = int(rank_s)
            factor = float(factor_s) if factor_s else 1.3
        except ValueError:
            raise typer.BadParameter(f"--straggler expects RANK[:FACTOR], got {part!r}") from None
        if rank < 0 or factor <= 0:
            raise typer.BadParameter(f"--straggler rank must be >= 0 and factor > 0, got {part!r}")
        out[rank] = factor
    return out


def parse_slow_node(value: str | None) -> dict[str, float]:
    """``"NODE=FACTOR"``, several comma-separated (e.g. ``node0003=2``) → {node: factor}: every collective of
    that node's ranks takes FACTOR× as long (a slow link; FACTOR > 1 slows it)."""
    import math

    out: dict[str, float] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        node, sep, factor_s = part.strip().partition("=")
        try:
            factor = float(factor_s)
        except ValueError:
            factor = float("nan")
        if not sep or not node or not math.isfinite(factor) or factor <= 0:
            raise typer.BadParameter(f"--slow-node expects NODE=FACTOR with FACTOR > 0, got {part.strip()!r}")
        out[node] = factor
    return out


def parse_shift(value: str | None) -> dict[str, float]:
    """``"COMPONENT=FACTOR"``, several comma-separated (e.g. ``comm_exposed_s=2.5``) → {component: factor}."""
    import math

    from .synthetic import SHIFT_COMPONENTS

    out: dict[str, float] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        comp, sep, factor_s = part.strip().partition("=")
        try:
            factor = float(factor_s)
        except ValueError:
            factor = float("nan")
        if not sep or comp not in SHIFT_COMPONENTS or not math.isfinite(factor) or factor <= 0:
            raise typer.BadParameter(f"--shift expects COMPONENT=FACTOR with COMPONENT one of "
                                     f"{', '.join(SHIFT_COMPONENTS)} and FACTOR > 0, got {part.strip()!r}")
        out[comp] = factor
    return out


def parse_token_skew(value: str | None) -> dict[int, float]:
    """``"RANK=FACTOR"``, several comma-separated (e.g. ``37=1.4``) → {rank: factor}: that rank gets FACTOR×
    the tokens (of ``--skew-modality`` only, when given) and does the work they need."""
    import math

    out: dict[int, float] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        rank_s, sep, factor_s = part.strip().partition("=")
        try:
            rank, factor = int(rank_s), float(factor_s)
        except ValueError:
            rank, factor = -1, float("nan")
        if not sep or rank < 0 or not math.isfinite(factor) or factor <= 0:
            raise typer.BadParameter(f"--token-skew expects RANK=FACTOR with RANK >= 0 and FACTOR > 0, got {part.strip()!r}")
        out[rank] = factor
    return out


def parse_config_json(value: str | None) -> dict | None:
    """``--config-json``: a JSON object laid over the synthetic run's config (None when not given)."""
    import json

    if value is None:
        return None
    try:
        cfg = json.loads(value)
    except ValueError as e:
        raise typer.BadParameter(f"--config-json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise typer.BadParameter(f"--config-json must be a JSON object, got {type(cfg).__name__}")
    return cfg


def parse_rank_at_step(value: str | None, opt: str) -> tuple[int, int] | None:
    """``"RANK@STEP"`` → (rank, step) for ``--hang`` / ``--crash``."""
    if not value:
        return None
    rank_s, sep, step_s = value.strip().partition("@")
    try:
        rank, step = int(rank_s), int(step_s)
    except ValueError:
        rank, step = -1, -1
    if not sep or rank < 0 or step < 0:
        raise typer.BadParameter(f"{opt} expects RANK@STEP with RANK >= 0 and STEP >= 0, got {value!r}")
    return rank, step


_SEQ0 = 1_000_000  # event sequence numbers of the health scenarios (apart from any other event)
_DATA_STACK = [{"file": "/workspace/train.py", "line": 142, "func": "main"},
               {"file": "/workspace/train.py", "line": 97, "func": "train_step"},
               {"file": "/usr/lib/python3/site-packages/torch/utils/data/dataloader.py", "line": 631, "func": "__next__"},
               {"file": "/workspace/data/shards.py", "line": 211, "func": "read_shard"}]
_CRASH_FRAMES = [{"file": "/workspace/train.py", "line": 142, "func": "main"},
                 {"file": "/workspace/train.py", "line": 101, "func": "train_step"},
                 {"file": "/workspace/model/attention.py", "line": 77, "func": "forward"}]


def _ts_index() -> int:
    from .wire import RANK_STEP_FIELDS

    return [f.name for f in RANK_STEP_FIELDS].index("ts")


_TS_INDEX = _ts_index()


def _ending_now(steps: list[tuple[int, list[tuple]]]) -> list[tuple[int, list[tuple]]]:
    """The steps with their times shifted so the last one ends now."""
    if not steps:
        return steps
    last = steps[-1][1]
    end = max(float(r[_TS_INDEX]) + float(r[2]) for r in last)
    shift = time.time() - end
    return [(st, [(*r[:_TS_INDEX], float(r[_TS_INDEX]) + shift, *r[_TS_INDEX + 1:]) for r in rows]) for st, rows in steps]


class _Events:
    """Per-rank event sequence numbers for the health scenarios' records."""

    def __init__(self) -> None:
        self.seq: dict[int, int] = {}

    def __call__(self, rank: int, kind: str, data: dict, step: int | None, ts: float | None = None) -> dict:
        n = self.seq.get(rank, _SEQ0)
        self.seq[rank] = n + 1
        return {"rank": rank, "seq": n, "kind": kind, "ts": time.time() if ts is None else ts, "step": step,
                "data": data}


def hang_positions(ranks: int, rank: int, step: int, *, open_s: float, ev: _Events) -> list[dict]:
    """What a job hung at ``step`` by ``rank`` reports: every other rank blocked in the step's data-parallel
    all_reduce (per-group sequence number ``4·step + 3``), ``rank`` inside its step in the data loader
    (its last all_reduce, one earlier, done) with its stack."""
    seq = 4 * step + 3
    out = []
    for r in range(ranks):
        if r == rank:
            coll = {"op": "all_reduce", "dim": "dp", "group": "0", "seq": seq - 1, "bytes": 1 << 26,
                    "since_s": open_s + 1.0, "done": True}
            out.append(ev(r, "position", {"state": "in_step", "phase": "data", "open_s": open_s, "collective": coll,
                                          "stack": _DATA_STACK, "source": "agent"}, step))
        else:
            coll = {"op": "all_reduce", "dim": "dp", "group": "0", "seq": seq, "bytes": 1 << 26,
                    "since_s": max(open_s - 0.5, 0.0), "done": False}
            out.append(ev(r, "position", {"state": "in_step", "phase": "backward", "open_s": open_s,
                                          "collective": coll, "stack": None, "source": "flight_recorder"}, step))
    return out


def crash_failures(ranks: int, rank: int, step: int, *, ev: _Events, t: float | None = None) -> list[dict]:
    """What a job that crashed at ``step`` on ``rank`` reports: the exception on ``rank``, then the other
    ranks torn down by the launcher (SIGTERM) a second later, and the launcher's exit codes."""
    t = time.time() if t is None else t
    out = [ev(rank, "failure", {"source": "exception", "exception": "RuntimeError",
                                "message": "CUDA error: an illegal memory access was encountered",
                                "frames": _CRASH_FRAMES, "phase": "forward", "signal": None, "exit_code": 1,
                                "rank": rank}, step, t)]
    for r in range(ranks):
        if r != rank:
            out.append(ev(r, "failure", {"source": "signal", "exception": None, "message": None, "frames": [],
                                         "phase": "backward", "signal": "SIGTERM", "exit_code": -15, "rank": r},
                          step, t + 1.0))
    return out


def run_simulation(
    *,
    server: str,
    token: str | None,
    run: str,
    family: str,
    ranks: int,
    steps: int,
    seed: int = 0,
    straggler: dict[int, float] | None = None,
    gpu: str = "H100",
    step_ms: float | None = None,
    realtime: bool = False,
    spool_dir: str | None = None,
    flush_timeout_s: float = 120.0,
    slow_nodes: dict[str, float] | None = None,
    shift: dict[str, float] | None = None,
    config: dict | None = None,
    git_commit: str | None = None,
    token_skew: dict[int, float] | None = None,
    skew_modality: str | None = None,
    modality_tokens: bool = False,
    hang: tuple[int, int] | None = None,
    crash: tuple[int, int] | None = None,
    restart: int | None = None,
    checkpoint_every: int = 0,
    hold_s: float = 0.0,
    job_id: str | None = None,
    attempt: int = 0,
    step_lo: int = 0,
) -> dict:
    """Send the run; returns the transport's counters. Raises RuntimeError if anything was lost.

    Health scenarios (docs/cli.md): ``hang`` (rank, step) stops the run at that step with every rank's
    position (the others blocked in the step's all_reduce, the rank in its data loader), re-sent every
    5 s for ``hold_s`` seconds, and leaves it running; ``crash`` (rank, step) ends it there with the
    failures a real job reports, ``failed``; ``restart`` STEP crashes attempt ``attempt`` at STEP, then
    registers the next attempt of the job (``job_id``, default the run name) and resumes from the last
    checkpoint (every ``checkpoint_every`` steps, declared as ``checkpoint_save`` pauses)."""
    if restart is not None:
        every = checkpoint_every or 10
        first = run_simulation(
            server=server, token=token, run=run, family=family, ranks=ranks, steps=steps, seed=seed,
            straggler=straggler, gpu=gpu, step_ms=step_ms, realtime=realtime, spool_dir=spool_dir,
            flush_timeout_s=flush_timeout_s, slow_nodes=slow_nodes, shift=shift, config=config, git_commit=git_commit,
            crash=(0, restart), checkpoint_every=every, job_id=job_id or run, attempt=attempt)
        resume = (restart // every) * every  # the last checkpoint before the crash: steps after it are redone
        second = run_simulation(
            server=server, token=token, run=run, family=family, ranks=ranks, steps=steps, seed=seed,
            straggler=straggler, gpu=gpu, step_ms=step_ms, realtime=realtime, spool_dir=spool_dir,
            flush_timeout_s=flush_timeout_s, slow_nodes=slow_nodes, shift=shift, config=config, git_commit=git_commit,
            checkpoint_every=every, job_id=job_id or run, attempt=attempt + 1, step_lo=resume)
        return {k: first.get(k, 0) + second.get(k, 0) if isinstance(first.get(k, 0), int) else second.get(k)
                for k in set(first) | set(second)}
    from fleetscope.agent.config import AgentConfig
    from fleetscope.agent.transport import Transport

    from .synthetic import RunSpec, collective_rows, modality_rows, rank_step_rows

    spec = RunSpec(name=run, family=family, world_size=ranks, steps=steps, seed=seed, straggler=straggler or {},
                   gpu=gpu, step_ms=step_ms, shift=shift or {}, config=config, git_commit=git_commit,
                   token_skew=token_skew or {}, token_skew_modality=skew_modality)
    send_modalities = modality_tokens or bool(token_skew)
    spec.slow_nodes = slow_nodes or {}
    scenario = hang is not None or crash is not None or bool(attempt) or job_id is not None or bool(checkpoint_every)
    if realtime:
        spec.start_ts = time.time()
    info = spec.run_info()
    if job_id is not None or attempt:
        info.update(job_id=job_id or run, attempt=attempt)
    cfg = AgentConfig.from_env(server=server, token=token, spool_dir=spool_dir, offline=False, disabled=False,
                               queue_max_records=max(200_000, 8 * ranks * 5), batch_max_records=max(5000, ranks * 5),
                               exit_timeout_s=flush_timeout_s)
    tr = Transport(cfg, info)
    for r in range(ranks):
        tr.submit("rank", {"rank": r, "host": spec.host_of(r), "node": spec.host_of(r),
                           "local_rank": r % spec.gpus_per_node, "device": gpu})
    pending = 0
    t0 = time.monotonic()
    ev = _Events()
    stop_at = hang[1] if hang is not None else crash[1] if crash is not None else None
    step_iter = rank_step_rows(spec, step_lo, stop_at)
    if scenario and not realtime:
        # a stopped or restarted run is judged by the server's clock: its steps end now
        step_iter = iter(_ending_now(list(step_iter)))
    ts_i = _TS_INDEX
    for step, rows in step_iter:
        if checkpoint_every and step > step_lo and step % checkpoint_every == 0:
            t_ck = rows[0][ts_i] if rows else None
            for r in range(ranks):
                tr.submit("event", ev(r, "pause", {"reason": "checkpoint_save", "state": "begin", "expected_s": 2.0},
                                      step, t_ck))
                tr.submit("event", ev(r, "pause", {"reason": "checkpoint_save", "state": "end", "duration_s": 0.0},
                                      step, t_ck))
        for row in rows:
            tr.submit("rank_step", row)
        for c in collective_rows(spec, step, rows):
            tr.submit("collective", c)
        if send_modalities:  # per-rank tokens by modality (--modality-tokens, implied by --token-skew)
            for m in modality_rows(spec, step, rows):
                tr.submit("modality_tokens", m)
        pending += 5 * len(rows)
        if realtime:
            due = t0 + (step + 1) * (step_ms or 1000.0) / 1e3
            time.sleep(max(0.0, due - time.monotonic()))
        if pending >= cfg.queue_max_records // 2:
            tr.flush(timeout=flush_timeout_s)  # pace the producer: a simulation may wait, a job never does
            pending = 0
    if hang is not None:  # positions every 5 s while the step stays open; the run is left running
        t_hang = time.monotonic()
        while True:
            # the step has been open since the last one ended; the agent reports once it is twice as long as usual
            open_s = 2.0 * (step_ms or 1000.0) / 1e3 + time.monotonic() - t_hang
            for e in hang_positions(ranks, hang[0], hang[1], open_s=open_s, ev=ev):
                tr.submit("event", e)
            tr.flush(timeout=flush_timeout_s)
            left = hold_s - (time.monotonic() - t_hang)
            if left <= 0:
                break
            time.sleep(min(5.0, left))
    elif crash is not None:
        for e in crash_failures(ranks, crash[0], crash[1], ev=ev):
            tr.submit("event", e)
        tr.finish_run("failed")
    else:
        tr.finish_run("finished")
    tr.flush(timeout=flush_timeout_s)
    tr.close(timeout=flush_timeout_s)
    stats = tr.stats()
    lost = sum((stats.get("dropped") or {}).values())
    if lost:
        raise RuntimeError(f"simulate lost {lost} records: {stats.get('dropped')}")
    return stats


def simulate(
    server: Annotated[str, typer.Option("--server", envvar="FLEETSCOPE_SERVER", help="fleetscope server base URL")],
    run: Annotated[str, typer.Option("--run", help="run name (idempotent)")],
    family: Annotated[str, typer.Option("--family", help="model family, e.g. vla-7b, llm-70b, vit-h, video-dit-3b")],
    ranks: Annotated[int, typer.Option("--ranks", min=1, max=65536, help="world size")],
    steps: Annotated[int, typer.Option("--steps", min=1, help="steps to send")],
    token: Annotated[Optional[str], typer.Option("--token", envvar="FLEETSCOPE_TOKEN")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    straggler: Annotated[Optional[str], typer.Option("--straggler", help="RANK[:FACTOR], e.g. 17:1.3")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="device type (peak FLOP/s from docs/metrics.md)")] = "H100",
    step_ms: Annotated[Optional[float], typer.Option("--step-ms", min=1.0, help="median step time in ms")] = None,
    realtime: Annotated[bool, typer.Option("--realtime", help="emit steps at the step time, like a live job")] = False,
    slow_node: Annotated[Optional[str], typer.Option(
        "--slow-node", help="NODE=FACTOR[,...]: that node's collectives run FACTOR× slower (e.g. node0003=2)")] = None,
    shift: Annotated[Optional[str], typer.Option(
        "--shift", help="COMPONENT=FACTOR[,...]: scale data_s, compute_s, comm_exposed_s or other_s in this run")] = None,
    config_json: Annotated[Optional[str], typer.Option(
        "--config-json", help="JSON object laid over the run's config, e.g. '{\"fsdp\": {\"prefetch\": false}}'")] = None,
    commit: Annotated[Optional[str], typer.Option("--commit", help="git commit recorded for the run")] = None,
    token_skew: Annotated[Optional[str], typer.Option(
        "--token-skew", help="RANK=FACTOR[,...]: that rank gets FACTOR× the tokens and the work (e.g. 37=1.4)")] = None,
    skew_modality: Annotated[Optional[str], typer.Option(
        "--skew-modality", help="skew only this modality's tokens (e.g. vision; one of the family's)")] = None,
    modality_tokens: Annotated[bool, typer.Option(
        "--modality-tokens", help="send per-rank tokens by modality (implied by --token-skew)")] = False,
    hang: Annotated[Optional[str], typer.Option(
        "--hang", help="RANK@STEP: the run stops at STEP; RANK never reaches the all_reduce the others wait in")] = None,
    crash: Annotated[Optional[str], typer.Option(
        "--crash", help="RANK@STEP: RANK raises at STEP, the others are torn down; the run fails")] = None,
    restart: Annotated[Optional[int], typer.Option(
        "--restart", min=1, help="STEP: attempt 0 crashes at STEP; attempt 1 resumes from the last checkpoint")] = None,
    checkpoint_every: Annotated[int, typer.Option(
        "--checkpoint-every", min=0, help="declare a checkpoint_save pause every N steps (--restart: default 10)")] = 0,
    hold: Annotated[float, typer.Option(
        "--hold", min=0.0, help="--hang: keep re-sending the positions every 5 s for this many seconds")] = 0.0,
    job_id: Annotated[Optional[str], typer.Option("--job-id", help="job identity shared by the attempts")] = None,
) -> None:
    """Send one synthetic run through the real agent transport (same code path as a training job)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    strag = parse_straggler(straggler)
    bad = [r for r in strag if r >= ranks]
    if bad:
        raise typer.BadParameter(f"--straggler rank {bad[0]} is not < --ranks {ranks}")
    slow_nodes = parse_slow_node(slow_node)
    if slow_nodes:
        from .synthetic import RunSpec

        probe = RunSpec(name=run, family=family, world_size=ranks, steps=1)
        nodes = {probe.host_of(r) for r in range(ranks)}
        unknown = sorted(set(slow_nodes) - nodes)
        if unknown:
            raise typer.BadParameter(f"--slow-node {unknown[0]!r} is not a node of this run ({probe.host_of(0)} … "
                                     f"{probe.host_of(ranks - 1)}, {probe.gpus_per_node} ranks per node)")
    shifts = parse_shift(shift)
    skew = parse_token_skew(token_skew)
    if skew and max(skew) >= ranks:
        raise typer.BadParameter(f"--token-skew rank {max(skew)} is not < --ranks {ranks}")
    if skew_modality is not None:
        from .synthetic import FAMILIES

        mods = FAMILIES[family].modalities if family in FAMILIES else ()
        if skew_modality not in mods:
            raise typer.BadParameter(f"--skew-modality {skew_modality!r} is not a modality of {family} "
                                     f"({', '.join(mods) or 'unknown family'})")
    hang_at = parse_rank_at_step(hang, "--hang")
    crash_at = parse_rank_at_step(crash, "--crash")
    if sum(x is not None for x in (hang_at, crash_at, restart)) > 1:
        raise typer.BadParameter("--hang, --crash and --restart are separate scenarios: give one")
    for opt, at in (("--hang", hang_at), ("--crash", crash_at)):
        if at is not None and (at[0] >= ranks or at[1] >= steps):
            raise typer.BadParameter(f"{opt} {at[0]}@{at[1]}: the rank must be < --ranks {ranks} and the step < --steps {steps}")
    if restart is not None and restart >= steps:
        raise typer.BadParameter(f"--restart {restart}: the step must be < --steps {steps}")
    cfg = parse_config_json(config_json)
    if commit is not None and not 0 < len(commit) <= 64:
        raise typer.BadParameter(f"--commit must be 1-64 characters, got {len(commit)}")
    try:
        stats = run_simulation(server=server, token=token, run=run, family=family, ranks=ranks, steps=steps,
                               seed=seed, straggler=strag, gpu=gpu, step_ms=step_ms, realtime=realtime,
                               shift=shifts, config=cfg, git_commit=commit, slow_nodes=slow_nodes,
                               token_skew=skew, skew_modality=skew_modality, modality_tokens=modality_tokens,
                               hang=hang_at, crash=crash_at, restart=restart, checkpoint_every=checkpoint_every,
                               hold_s=hold, job_id=job_id)
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    # spooled during an outage and replayed once the server was back: delivered; still on disk: not
    left = max(0, stats.get("spooled", 0) - stats.get("replayed", 0))
    typer.echo(f"sent run {run!r}: {ranks} ranks x {steps} steps ({stats.get('sent', 0)} records sent"
               + (f", {stats.get('replayed', 0)} after spooling" if stats.get("replayed") else "")
               + (f", {left} spooled for later upload" if left else "") + ")")
    if left:
        raise typer.Exit(1)
