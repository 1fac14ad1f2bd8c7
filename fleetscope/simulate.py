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
           "run_simulation", "parse_rank_at_step", "hang_positions", "crash_failures", "parse_throttle", "device_events",
           "parse_rank_factors"]


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
    return parse_rank_factors(value, "--token-skew")


def parse_rank_factors(value: str | None, opt: str) -> dict[int, float]:
    """``"RANK=FACTOR"``, several comma-separated (``--slow-link``, ``--slow-loader``) → {rank: factor}."""
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
            raise typer.BadParameter(f"{opt} expects RANK=FACTOR with RANK >= 0 and FACTOR > 0, got {part.strip()!r}")
        out[rank] = factor
    return out


THROTTLE_REASONS = ("power", "thermal", "hw_slowdown")
#: a throttled rank's slowdown (its compute takes this much longer) and its GPU as the fake NVML shows it
_THROTTLE = {"power": (1.4, {"sm_clock_mhz": 1410.0, "power_w": 699.0, "temp_c": 71.0}),
             "thermal": (1.25, {"sm_clock_mhz": 1590.0, "power_w": 610.0, "temp_c": 89.0}),
             "hw_slowdown": (1.6, {"sm_clock_mhz": 1240.0, "power_w": 480.0, "temp_c": 84.0})}
_HEALTHY = {"sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "power_w": 520.0, "power_limit_w": 700.0, "temp_c": 62.0,
            "util": 0.97, "mem_used_bytes": float(60 << 30)}


def parse_throttle(values: list[str] | None) -> dict[int, str]:
    """``--throttle RANK:REASON`` (repeatable; REASON power, thermal or hw_slowdown) → {rank: reason}."""
    out: dict[int, str] = {}
    for v in values or []:
        for part in v.split(","):
            rank_s, sep, reason = part.strip().partition(":")
            try:
                rank = int(rank_s)
            except ValueError:
                rank = -1
            if not sep or rank < 0 or reason not in THROTTLE_REASONS:
                raise typer.BadParameter(f"--throttle expects RANK:REASON with REASON one of "
                                         f"{', '.join(THROTTLE_REASONS)}, got {part.strip()!r}")
            out[rank] = reason
    return out


def device_events(ranks: int, throttle: dict[int, str], t_lo: float, t_hi: float, ev: _Events,
                  max_windows: int = 8, window_s: float = 30.0) -> list[dict]:
    """The ``device`` events of every rank over [t_lo, t_hi) (what agent/device_telemetry.py sends: windows of
    about ``window_s``, at most ``max_windows`` per rank): healthy GPUs at full clocks, each ``throttle``
    rank's GPU held by its reason."""
    n = max(1, min(max_windows, int((t_hi - t_lo) // window_s) or 1))
    w = max((t_hi - t_lo) / n, 1e-3)
    out = []
    for r in range(ranks):
        reason = throttle.get(r)
        figs = {**_HEALTHY, **(_THROTTLE[reason][1] if reason else {})}
        for i in range(n):
            jitter = 1.0 + 0.002 * (((r * 7 + i * 3) % 11) - 5)
            data: dict = {"window_s": round(w, 3), "samples": max(1, int(w))}
            for k, v in figs.items():
                m = round(v * (jitter if k in ("sm_clock_mhz", "power_w", "temp_c") else 1.0), 3)
                data[k] = {"min": round(m * 0.99, 3), "mean": m, "max": round(min(m * 1.01, figs["power_limit_w"])
                                                                            if k == "power_w" else m * 1.01, 3)}
            data.update(throttle=[reason] if reason else [], throttle_s={reason: round(0.95 * w, 3)} if reason else {},
                        ecc_errors=0, xid=[], device_index=r % 8)
            out.append(ev(r, "device", data, None, t_lo + i * w))
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
    realistic: bool = False,
    throttle: dict[int, str] | None = None,
    slow_links: dict[int, float] | None = None,
    slow_loaders: dict[int, float] | None = None,
    bucket_mb: float | None = None,
    largest_grad_mb: float | None = None,
) -> dict:
    """Send the run; returns the transport's counters. Raises RuntimeError if anything was lost.

    ``throttle`` {rank: reason}: that rank's GPU throttles (``--throttle``): its compute is slower (unless
    ``straggler`` names it too) and every rank sends ``device`` telemetry showing it. ``slow_links`` {rank:
    factor}: that rank's collectives take factor× as long (``--slow-link``); ``slow_loaders`` {rank: factor}:
    its data loading does (``--slow-loader``).

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
            crash=(0, restart), checkpoint_every=every, job_id=job_id or run, attempt=attempt, realistic=realistic,
            bucket_mb=bucket_mb, largest_grad_mb=largest_grad_mb)
        resume = (restart // every) * every  # the last checkpoint before the crash: steps after it are redone
        second = run_simulation(
            server=server, token=token, run=run, family=family, ranks=ranks, steps=steps, seed=seed,
            straggler=straggler, gpu=gpu, step_ms=step_ms, realtime=realtime, spool_dir=spool_dir,
            flush_timeout_s=flush_timeout_s, slow_nodes=slow_nodes, shift=shift, config=config, git_commit=git_commit,
            checkpoint_every=every, job_id=job_id or run, attempt=attempt + 1, step_lo=resume, realistic=realistic,
            bucket_mb=bucket_mb, largest_grad_mb=largest_grad_mb)
        return {k: first.get(k, 0) + second.get(k, 0) if isinstance(first.get(k, 0), int) else second.get(k)
                for k in set(first) | set(second)}
    from fleetscope.agent.config import AgentConfig
    from fleetscope.agent.transport import Transport

    from .synthetic import PeakMemory, RunSpec, collective_rows, modality_rows, rank_step_rows

    if throttle:  # a throttled GPU makes its rank slower
        straggler = {**{r: _THROTTLE[x][0] for r, x in throttle.items()}, **(straggler or {})}
    t_span = [float("inf"), float("-inf")]  # the steps' time range, for the device windows
    spec = RunSpec(name=run, family=family, world_size=ranks, steps=steps, seed=seed, straggler=straggler or {},
                   gpu=gpu, step_ms=step_ms, shift=shift or {}, config=config, git_commit=git_commit,
                   token_skew=token_skew or {}, token_skew_modality=skew_modality, realistic=realistic,
                   bucket_mb=bucket_mb, largest_grad_mb=largest_grad_mb)
    send_modalities = modality_tokens or bool(token_skew)
    spec.slow_nodes = slow_nodes or {}
    spec.slow_links = slow_links or {}
    spec.slow_loaders = slow_loaders or {}
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
    peaks = PeakMemory()
    end_ts = spec.start_ts
    for step, rows in step_iter:
        peaks.add(rows)
        end_ts = max([end_ts] + [float(r[ts_i]) + float(r[2]) for r in rows])
        if throttle and rows:
            t_span = [min(t_span[0], float(rows[0][ts_i])), max(t_span[1], float(rows[0][ts_i]) + float(rows[0][2]))]
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
    for e in peaks.events(spec, end_ts):  # the realistic model's DDP / FSDP facts and memory figures
        tr.submit("event", ev(e["rank"], e["kind"], e["data"], e["step"], e["ts"]))
    if throttle and t_span[1] > t_span[0]:
        for e in device_events(ranks, throttle, t_span[0], t_span[1], ev):
            tr.submit("event", e)
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
    realistic: Annotated[bool, typer.Option(
        "--realistic/--legacy-model", help="the family's own parallelism, memory and collective placement (as the "
        "demo; the default); --legacy-model: one DDP-like model for every family, its collectives at the step's "
        "start")] = True,
    throttle: Annotated[Optional[list[str]], typer.Option(
        "--throttle", help="RANK:REASON (repeatable; power, thermal, hw_slowdown): that rank's GPU throttles, the "
                           "rank is slower and device telemetry shows why")] = None,
    slow_link: Annotated[Optional[str], typer.Option(
        "--slow-link", help="RANK=FACTOR[,...]: that one rank's collectives run FACTOR× slower (a bad NIC or cable)")] = None,
    slow_loader: Annotated[Optional[str], typer.Option(
        "--slow-loader", help="RANK=FACTOR[,...]: that rank's data loading takes FACTOR× as long")] = None,
    bucket_mb: Annotated[Optional[float], typer.Option(
        "--bucket-mb", min=0.001, help="realistic DDP layouts: DDP's bucket_cap_mb (default: the family's, 25)")] = None,
    largest_grad_mb: Annotated[Optional[float], typer.Option(
        "--largest-grad-mb", min=0.001, help="realistic DDP layouts: the model's largest gradient tensor in MiB "
        "(default: one of a block's MLP matrices)")] = None,
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
    throttled = parse_throttle(throttle)
    if throttled and max(throttled) >= ranks:
        raise typer.BadParameter(f"--throttle rank {max(throttled)} is not < --ranks {ranks}")
    links = parse_rank_factors(slow_link, "--slow-link")
    loaders = parse_rank_factors(slow_loader, "--slow-loader")
    for opt, m in (("--slow-link", links), ("--slow-loader", loaders)):
        if m and max(m) >= ranks:
            raise typer.BadParameter(f"{opt} rank {max(m)} is not < --ranks {ranks}")
    cfg = parse_config_json(config_json)
    if commit is not None and not 0 < len(commit) <= 64:
        raise typer.BadParameter(f"--commit must be 1-64 characters, got {len(commit)}")
    try:
        stats = run_simulation(server=server, token=token, run=run, family=family, ranks=ranks, steps=steps,
                               seed=seed, straggler=strag, gpu=gpu, step_ms=step_ms, realtime=realtime,
                               shift=shifts, config=cfg, git_commit=commit, slow_nodes=slow_nodes,
                               token_skew=skew, skew_modality=skew_modality, modality_tokens=modality_tokens,
                               hang=hang_at, crash=crash_at, restart=restart, checkpoint_every=checkpoint_every,
                               hold_s=hold, job_id=job_id, realistic=realistic, throttle=throttled,
                               bucket_mb=bucket_mb, largest_grad_mb=largest_grad_mb,
                               slow_links=links, slow_loaders=loaders)
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    # spooled during an outage and replayed once the server was back: delivered; still on disk: not
    left = max(0, stats.get("spooled", 0) - stats.get("replayed", 0))
    typer.echo(f"sent run {run!r}: {ranks} ranks x {steps} steps ({stats.get('sent', 0)} records sent"
               + (f", {stats.get('replayed', 0)} after spooling" if stats.get("replayed") else "")
               + (f", {left} spooled for later upload" if left else "") + ")")
    if realistic:  # a layout whose states cannot fit is a run no one could train: say so, send it anyway
        from .synthetic import DEVICE_MEMORY, RunSpec, memory_model

        peak = memory_model(RunSpec(name=run, family=family, world_size=ranks, steps=steps, gpu=gpu,
                                    realistic=True))["peak"]
        dev = DEVICE_MEMORY.get(gpu)
        if dev is not None and peak > dev:
            typer.echo(f"warning: {family} on {ranks} ranks needs ~{peak / 1e9:.0f} GB per rank, more than a {gpu}'s "
                       f"{dev / 1e9:.0f} GB: use more ranks", err=True)
    if left:
        raise typer.Exit(1)
