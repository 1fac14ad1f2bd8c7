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
           "run_simulation"]


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
) -> dict:
    """Send the run; returns the transport's counters. Raises RuntimeError if anything was lost."""
    from fleetscope.agent.config import AgentConfig
    from fleetscope.agent.transport import Transport

    from .synthetic import RunSpec, collective_rows, modality_rows, rank_step_rows

    spec = RunSpec(name=run, family=family, world_size=ranks, steps=steps, seed=seed, straggler=straggler or {},
                   gpu=gpu, step_ms=step_ms, shift=shift or {}, config=config, git_commit=git_commit,
                   token_skew=token_skew or {}, token_skew_modality=skew_modality)
    send_modalities = modality_tokens or bool(token_skew)
    spec.slow_nodes = slow_nodes or {}
    if realtime:
        spec.start_ts = time.time()
    info = spec.run_info()
    cfg = AgentConfig.from_env(server=server, token=token, spool_dir=spool_dir, offline=False, disabled=False,
                               queue_max_records=max(200_000, 8 * ranks * 5), batch_max_records=max(5000, ranks * 5),
                               exit_timeout_s=flush_timeout_s)
    tr = Transport(cfg, info)
    for r in range(ranks):
        tr.submit("rank", {"rank": r, "host": spec.host_of(r), "node": spec.host_of(r),
                           "local_rank": r % spec.gpus_per_node, "device": gpu})
    pending = 0
    t0 = time.monotonic()
    for step, rows in rank_step_rows(spec):
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
    cfg = parse_config_json(config_json)
    if commit is not None and not 0 < len(commit) <= 64:
        raise typer.BadParameter(f"--commit must be 1-64 characters, got {len(commit)}")
    try:
        stats = run_simulation(server=server, token=token, run=run, family=family, ranks=ranks, steps=steps,
                               seed=seed, straggler=strag, gpu=gpu, step_ms=step_ms, realtime=realtime,
                               shift=shifts, config=cfg, git_commit=commit, slow_nodes=slow_nodes,
                               token_skew=skew, skew_modality=skew_modality, modality_tokens=modality_tokens)
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
