"""fleetscope's in-job agent: measures each rank's steps, phases, collectives, memory and MFU.

::

    import fleetscope.agent as fs
    run = fs.init(name="exp-42", model_family="vla-7b", config={...})   # every rank calls it
    run.instrument(model=model, optimizer=opt, dataloader=loader)         # optional: automatic
    for batch in loader:
        with run.step(tokens=n_tokens, samples=n_samples):                 # or manual steps
            with run.phase("forward"): ...
    run.finish()

Importing this package imports neither torch nor the server or dashboard; torch is touched only by
the PyTorch integration, once the training script has imported it. See docs/agent.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from types import TracebackType
from typing import Any

from .config import AgentConfig
from .noop import NoopRun
from .protocols import Transport, TransportFactory
from .run import Run, get_run
from .step import Phase, Step
from .step_state import FLAG_FLOPS_MEASURED, FLAG_NEGATIVE_RESIDUAL

__all__ = [
    "init",
    "get_run",
    "finish",
    "Run",
    "Step",
    "Phase",
    "NoopRun",
    "AgentConfig",
    "Transport",
    "TransportFactory",
    "FLAG_NEGATIVE_RESIDUAL",
    "FLAG_FLOPS_MEASURED",
]

log = logging.getLogger(__name__)

_NOOP_RUN = NoopRun()
_hooks_installed = False
_crashed = False


def _default_name(job_id: str | None) -> str:
    """The name of a run ``init`` was given none for: ``<script>-<job id>`` (the job's own id,
    ``env.job_id``: the same on every node of the job), else ``<script>``."""
    script = os.path.splitext(os.path.basename(sys.argv[0] or "python"))[0] or "python"
    if job_id and job_id != "none":
        return f"{script}-{job_id}"[:256]
    return script


def _with_size(meta: dict[str, Any] | None, params: float | None, active_params: float | None) -> dict[str, Any] | None:
    """``meta`` with the model size given to ``init`` (``params``, ``active_params``, ``params_source``)."""
    size: dict[str, Any] = {}
    if isinstance(params, (int, float)) and params > 0:
        size.update(params=float(params), params_source="given")
    if isinstance(active_params, (int, float)) and active_params > 0:
        size["active_params"] = float(active_params)
    return {**size, **(meta or {})} if size else meta


def init(
    name: str | None = None,
    *,
    model_family: str | None = None,
    config: dict[str, Any] | None = None,
    flops_per_step: float | None = None,
    flops_per_token: float | None = None,
    transformer: dict[str, int] | None = None,
    peak_flops: float | None = None,
    dtype: str | None = None,
    start_step: int = 0,
    mp_size: int | None = None,
    meta: dict[str, Any] | None = None,
    tags: list[str] | None = None,
    agent_config: AgentConfig | None = None,
    transport: TransportFactory | None = None,
    params: float | None = None,
    active_params: float | None = None,
    **agent_settings: Any,
) -> Run | NoopRun:
    """Start (or join: all ranks of a job, on every node, land in one run — by the job's own id, else by
    name; without ``name``, ``<script>-<job id>``, env.job_id) a run and return it.

    ``flops_per_step``/``flops_per_token`` give the model FLOPs (source "given"); ``transformer`` =
    ``{"params", "layers", "heads", "head_dim", "seq_len"}`` estimates them by the PaLM formula
    ("estimated"); otherwise they are measured once with FlopCounterMode ("measured").
    ``peak_flops`` overrides FLEETSCOPE_PEAK_FLOPS, which overrides the per-device table (mfu.py) looked
    up by ``dtype`` ("bf16", "fp16", "fp32"...; None: detected — the autocast state at init, else torch's
    default dtype; zero-code runs detect it from the model, see auto.py). ``mp_size`` = TP×PP ranks per
    data-parallel replica (tokens are counted once per replica; the formula's FLOPs are divided by it,
    else by the DeviceMesh's model-parallel degree). ``agent_settings`` are ``AgentConfig``
    fields (``server=``, ``token=``, ``offline=``, ``disabled=`` ...) over the FLEETSCOPE_* variables.
    ``transport`` is a factory ``(AgentConfig, run_info) -> Transport`` (``protocols.Transport``; tests).
    ``tags`` (with FLEETSCOPE_TAGS, comma-separated) are stored in the run's ``meta.tags`` (at most 64,
    each ≤ 128 characters): filter runs by them (``GET /api/v1/runs?tag=x``, the runs table).
    ``params`` / ``active_params``: the model's parameters, all and used per token (a mixture of experts
    activates fewer; default: all), stored in the run's meta (source "given") for per-parameter
    comparison; without them the agent counts ``sum(p.numel())`` of the model it instruments ("measured").
    Never raises because of the environment (an unusable FLEETSCOPE_* value is reported and ignored,
    see config.py): on an internal error it logs and returns a disabled run.
    """
    # a wrong agent setting is the caller's bug: AgentConfig raises it now, precisely
    cfg = agent_config if agent_config is not None else AgentConfig.from_env(**agent_settings)
    if cfg.disabled:
        return _NOOP_RUN
    try:
        return _init(
            cfg,
            name=name,
            model_family=model_family,
            config=config,
            flops_per_step=flops_per_step,
            flops_per_token=flops_per_token,
            transformer=transformer,
            peak_flops=peak_flops,
            dtype=dtype,
            start_step=start_step,
            mp_size=mp_size,
            meta=_with_size(meta, params, active_params),
            tags=tags,
            transport=transport,
        )
    except Exception as e:  # noqa: BLE001 - the training job must run even if the agent cannot
        log.warning("fleetscope agent disabled: init failed: %r", e)
        return _NOOP_RUN


def _init(
    cfg: AgentConfig,
    *,
    name: str | None,
    model_family: str | None,
    config: dict[str, Any] | None,
    flops_per_step: float | None,
    flops_per_token: float | None,
    transformer: dict[str, int] | None,
    peak_flops: float | None,
    dtype: str | None,
    start_step: int,
    mp_size: int | None,
    meta: dict[str, Any] | None,
    transport: TransportFactory | None,
    tags: list[str] | None = None,
) -> Run:
    from . import env, mfu
    from . import run as run_mod

    previous = get_run()
    if previous is not None:
        log.warning("fleetscope: init() while run %r is active: finishing it first", previous.name)
        previous.finish()

    rank_env = env.detect_rank()
    device = env.detect_device(rank_env.local_rank, cfg.clock)
    versions = env.detect_versions()

    per_token = None
    if flops_per_step is not None or flops_per_token is not None:
        source: str | None = "given"
        per_token = float(flops_per_token) if flops_per_token is not None else None
    elif transformer is not None:
        source = "estimated"
        per_token = mfu.palm_flops_per_token(
            params=transformer["params"],
            layers=transformer["layers"],
            heads=transformer["heads"],
            head_dim=transformer["head_dim"],
            seq_len=transformer["seq_len"],
        )
    elif cfg.measure_flops and "torch" in sys.modules:
        source = "measured"  # by FlopCounterMode over the first step (an "flops" event carries it)
    else:
        source = None
    dtype_source = "given"
    if dtype is None:
        dtype, dtype_source = mfu.detect_dtype()
    env_peak = mfu.env_peak_flops() if peak_flops is None else None
    if peak_flops is not None:
        peak: float | None = float(peak_flops)
        peak_source: str | None = "given"
    elif env_peak is not None:
        peak, peak_source = env_peak, "env"
    else:
        peak = mfu.peak_flops(device.device_type, dtype)
        peak_source = "table" if peak else None
    formula_mp = int(mp_size) if source == "estimated" and mp_size else None  # given: no mesh lookup

    from .health import job_identity

    job, attempt = job_identity()  # the job's own id: every node of the job alike (env.job_id)
    run_name = name or os.environ.get("FLEETSCOPE_RUN_NAME") or _default_name(job)
    run_meta: dict[str, Any] = {
        "host": rank_env.host,
        "node": rank_env.node,
        "rank": rank_env.rank,
        "local_rank": rank_env.local_rank,
        "node_rank": rank_env.node_rank,
        "job_id": rank_env.job_id,
        "launcher": rank_env.launcher,
        "device_name": device.device_name,
        "dtype": dtype,
        "dtype_source": dtype_source,
        "flops_source": source,
        "peak_flops_source": peak_source,
        "agent": "fleetscope",
        **versions,
    }
    if source == "given" and flops_per_step is not None:
        run_meta["flops_per_step"] = float(flops_per_step)
    if per_token is not None:
        run_meta["flops_per_token"] = per_token
        if formula_mp is not None and formula_mp > 1:  # the formula counts the whole model; a rank does 1/mp_size
            per_token /= formula_mp
            run_meta["flops_mp_degree"] = formula_mp
    if meta:
        run_meta.update(meta)
    all_tags = _tags(tags, run_meta.get("tags"))
    if all_tags:
        run_meta["tags"] = all_tags
    run_info: dict[str, Any] = {
        "name": run_name,
        "model_family": model_family,
        "config": dict(config or {}),
        "world_size": rank_env.world_size,
        "device_type": device.device_type,
        "device_count": device.device_count,
        "peak_flops": peak,
        "git_commit": env.git_commit(),
        "started_at": time.time(),
        "meta": run_meta,
    }
    if mp_size is not None:
        run_info["mp_size"] = int(mp_size)
    run_info["job_id"], run_info["attempt"] = job, attempt  # one job, one run; restarts are attempts (docs/agent.md)

    factory = transport if transport is not None else _transport_factory()
    tx: Transport
    try:
        tx = factory(cfg, run_info)
    except Exception as e:  # noqa: BLE001
        log.warning("fleetscope: transport failed to start (%r); records are dropped", e)
        tx = _NullTransport(cfg, run_info)

    run = Run(
        config=cfg,
        transport=tx,
        run_info=run_info,
        rank=rank_env.rank,
        world_size=rank_env.world_size,
        start_step=start_step,
        flops_per_step=float(flops_per_step) if flops_per_step is not None else None,
        flops_per_token=per_token,
        flops_source=source,
    )
    if formula_mp is not None:
        run._flop_mp = formula_mp
    tx.submit(
        "rank",
        {
            "rank": rank_env.rank,
            "host": rank_env.host,
            "node": rank_env.node,
            "local_rank": rank_env.local_rank,
            "device": device.device_name,
        },
    )
    run._ensure_collectives()  # record collectives from now on, with or without instrument()
    from . import compile_watch

    compile_watch.install(run)  # torch.compile health, once torch._dynamo is imported (compile_watch.py)
    if "torch" in sys.modules:
        from .mfu import watch_torch_compile

        watch_torch_compile()  # a job that compiles is not FLOP-measured (mfu.py)
    run_mod._set_active(run)
    from . import pipeline_watch

    run._hooks.append(pipeline_watch.attach(run))  # pipeline stages and schedules (pipeline_watch.py)
    _install_process_hooks()
    _install_stop_watch(run, tx)
    _install_graph_collectives(run, tx)
    return run


def _install_graph_collectives(run: Run, tx: Transport) -> None:
    """Collectives only torch's Flight Recorder sees (compiled graphs, C++): counted on the sender
    thread (flight_recorder.py). The buffer is asked for here when no process group exists yet."""
    try:
        from . import flight_recorder, health

        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            flight_recorder.enable()
        flight_recorder.install(run, tx, health.event)
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: flight recorder not used (%r)", e)


def _tags(given: Any, in_meta: Any) -> list[str]:
    """The run's tags: ``meta["tags"]``, ``tags=`` and FLEETSCOPE_TAGS (comma-separated), in that order,
    once each; strings of 1..128 characters, at most 64 (others are left out)."""
    out: list[str] = []
    for src in (in_meta, given, os.environ.get("FLEETSCOPE_TAGS", "").split(",")):
        if isinstance(src, str):
            src = [src]
        if not isinstance(src, (list, tuple)):
            continue
        for t in src:
            if isinstance(t, str) and 0 < len(t.strip()) <= 128 and t.strip() not in out and len(out) < 64:
                out.append(t.strip())
    return out


def finish(status: str = "finished", timeout: float | None = None) -> None:
    """Finish the active run, if any (``Run.finish``)."""
    run = get_run()
    if run is not None:
        run.finish(status, timeout=timeout)


class _NullTransport:
    """Used when no transport can run: accepts and drops everything, counting it."""

    def __init__(self, config: AgentConfig, run_info: dict[str, Any]) -> None:
        self.dropped = 0

    def submit(self, kind: str, record: object) -> None:
        self.dropped += 1

    def flush(self, timeout: float | None = None) -> bool:
        return False

    def close(self, timeout: float | None = None) -> None:
        return None

    def finish_run(self, status: str) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"dropped": self.dropped, "transport": "none"}


def _transport_factory() -> TransportFactory:
    try:
        from .transport import Transport as SenderTransport
    except ImportError as e:
        log.warning("fleetscope: agent transport unavailable (%r); records are dropped", e)
        return _NullTransport
    return SenderTransport


def _install_process_hooks() -> None:
    """At exit, finish a run the script did not finish ("failed" after an uncaught exception); in a
    forked child (DataLoader workers), make the inherited run inert."""
    global _hooks_installed
    # (re-)registered at every init: atexit runs last-registered first, so the run is finished
    # before the transport that init just created closes itself at exit
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def excepthook(et: type[BaseException], ev: BaseException, tb: TracebackType | None) -> None:
        global _crashed
        _crashed = True
        previous(et, ev, tb)

    sys.excepthook = excepthook
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


def _install_stop_watch(run: Run, tx: Transport) -> None:
    """When the run stops, say where and why: positions from the sender thread (health.py), failure
    records (failures.py), checkpoints as pauses (checkpoint_watch.py). Never raises."""
    try:
        from . import checkpoint_watch, failures, health

        if run.config.heartbeat_s > 0:
            health.install(run, tx)
        failures.install(get_run)
        checkpoint_watch.install(get_run)
    except Exception as e:  # noqa: BLE001
        log.warning("fleetscope: run-stop reporting unavailable (%r)", e)
    try:
        from . import device_telemetry

        device_telemetry.install(run, tx)  # the rank's GPU through NVML, on the sender thread
    except Exception as e:  # noqa: BLE001
        log.debug("fleetscope: device telemetry unavailable (%r)", e)


def _after_fork_in_child() -> None:
    run = get_run()
    if run is not None:
        try:
            run._make_inert()
        except Exception:  # noqa: BLE001 - never break the child
            pass


def _at_exit() -> None:
    run = get_run()
    if run is not None and not run.finished:
        try:
            from .failures import failed

            run.finish("failed" if _crashed or failed() else "finished")
        except Exception:  # noqa: BLE001
            pass
