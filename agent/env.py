"""Where this process runs: rank, world size, host and node, device, framework versions, git commit.

Read once at ``init``. Standard library only; torch is consulted only when the training script has
already imported it (``sys.modules``), so detecting the environment never imports torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RankEnv", "DeviceEnv", "detect_rank", "detect_device", "detect_versions", "git_commit", "job_id", "node_name",
           "JOB_ID_SOURCES", "MAX_JOB_ID"]

#: launcher -> (rank, world size, local rank, node rank, job id) environment variables, in priority
#: order. torchrun inside a SLURM allocation sets both; torchrun's own variables win because they
#: describe the processes that actually train.
_LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("GROUP_RANK",), ("TORCHELASTIC_RUN_ID",)),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NODEID",), ("SLURM_JOB_ID",)),
    (
        "mpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_NODE_RANK",),
        ("OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid"),
    ),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), (), ("PMI_JOBID",)),
)


@dataclass
class RankEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int | None = None
    host: str = ""
    node: str = ""
    job_id: str | None = None
    launcher: str = "single"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DeviceEnv:
    """The accelerator this rank trains on (``device_type`` "cpu" without one, "unknown" without torch)."""

    device_type: str = "unknown"
    device_name: str = "unknown"
    device_count: int = 0
    cuda_available: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _int(environ: Any, *names: str) -> int | None:
    for n in names:
        v = environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return None


def _str(environ: Any, *names: str) -> str | None:
    for n in names:
        v = environ.get(n)
        if v not in (None, ""):
            return str(v)
    return None


MAX_JOB_ID = 128
"""The longest job id kept (the server's bound); a longer one is cut."""

#: where a job id comes from, in precedence order (``job_id``; docs/agent.md, "Launchers")
JOB_ID_SOURCES = ("fleetscope", "torchrun", "slurm", "kubernetes", "mpi", "launch")

#: Slurm's special step ids (the batch script, the extern and interactive steps ...): no step of their own
_SLURM_SPECIAL_STEP = 0xFFFFFFF0


def _clean(v: Any) -> str | None:
    """A job id as the server stores it: printable, stripped, at most ``MAX_JOB_ID`` characters; None
    for nothing, or torchrun's default rendezvous id "none"."""
    s = "".join(c for c in str(v or "") if c.isprintable()).strip()  # a text field on the server
    if not s or s.lower() == "none":
        return None
    return s[:MAX_JOB_ID]


def _slurm_job(env: Any) -> str | None:
    job = _clean(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    if job is None:
        return None
    step = _clean(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    if step is not None:
        try:
            special = int(step) >= _SLURM_SPECIAL_STEP  # the batch script's own "step": the job itself
        except ValueError:
            special = False
        if not special:
            job = f"{job}.{step}"
    return job[:MAX_JOB_ID]


def _kubernetes_job(env: Any) -> str | None:
    """The Kubeflow training operator's job name, inside a Kubernetes pod: PyTorchJob (v1) sets
    ``MASTER_ADDR``/``PET_MASTER_ADDR`` = ``<job>-master-0`` (an elastic job ``PET_RDZV_ENDPOINT`` =
    ``<job>-worker-0:<port>``); a TrainJob (v2, JobSet) sets ``PET_MASTER_ADDR`` =
    ``<job>-<replicated job>-0-0.<job>``; a plain JobSet's pods reach their leader by the same address
    (``MASTER_ADDR``), and ``JOBSET_NAME`` (the JobSet's name, which its examples pass through the
    downward API from the ``jobset.sigs.k8s.io/jobset-name`` annotation) names it outright.
    ``PET_RDZV_ID`` (an elastic policy's ``rdzvId``) first."""
    rdzv = _clean(env.get("PET_RDZV_ID"))
    if rdzv is not None:
        return rdzv
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    named = _clean(env.get("JOBSET_NAME"))
    if named is not None:
        return named
    for var in ("PET_MASTER_ADDR", "MASTER_ADDR"):
        addr = str(env.get(var) or "").strip()
        host, _, domain = addr.partition(".")
        svc = domain.split(".", 1)[0]
        if svc and host.startswith(svc + "-"):  # v2: <job>-node-0-0.<job>
            return _clean(svc)
        if host.endswith("-master-0") and len(host) > len("-master-0"):  # v1
            return _clean(host[: -len("-master-0")])
    host = str(env.get("PET_RDZV_ENDPOINT") or "").strip().rsplit(":", 1)[0].split(".", 1)[0]
    if host.endswith("-worker-0") and len(host) > len("-worker-0"):  # v1, elastic
        return _clean(host[: -len("-worker-0")])
    return None


def job_id(environ: Any = None) -> tuple[str | None, str | None]:
    """(the job's own id, where it came from): the id every process of a job sees alike, on every node,
    with no coordination between them — ``FLEETSCOPE_JOB_ID`` ("fleetscope"), else torchrun's
    ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``) unless empty or torchrun's default "none" ("torchrun"),
    else ``SLURM_JOB_ID`` with ``.SLURM_STEP_ID`` when the process runs in a step of its own ("slurm"),
    else the Kubeflow job's ``PET_RDZV_ID`` or name ("kubernetes"), else the MPI job's
    ``PMIX_NAMESPACE`` / Open MPI job id ("mpi"), else ``FLEETSCOPE_LAUNCH_ID``, the one ``fleetscope
    run`` made when it saw none ("launch"); (None, None) without any. At most ``MAX_JOB_ID`` characters."""
    env = os.environ if environ is None else environ
    found = _clean(env.get("FLEETSCOPE_JOB_ID"))
    if found is not None:
        return found, "fleetscope"
    found = _clean(env.get("TORCHELASTIC_RUN_ID"))
    if found is not None:
        return found, "torchrun"
    found = _slurm_job(env)
    if found is not None:
        return found, "slurm"
    found = _kubernetes_job(env)
    if found is not None:
        return found, "kubernetes"
    for var in ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid", "PMI_JOBID"):
        found = _clean(env.get(var))
        if found is not None:
            return found, "mpi"
    found = _clean(env.get("FLEETSCOPE_LAUNCH_ID"))
    if found is not None:
        return found, "launch"
    return None, None


def node_name(environ: Any = None, host: str | None = None) -> str:
    """This process's node as every rank reports it: ``FLEETSCOPE_NODE``, else ``SLURMD_NODENAME``,
    else the host name (fleetscope/bench.py ``node_name`` alike)."""
    env = os.environ if environ is None else environ
    for var in ("FLEETSCOPE_NODE", "SLURMD_NODENAME"):
        v = "".join(c for c in str(env.get(var) or "") if c.isprintable()).strip()
        if v:
            return v
    return host if host is not None else socket.gethostname()


def detect_rank(environ: Any = None) -> RankEnv:
    """Rank, world size, local rank, node and job from torchrun, SLURM, Open MPI or PMI variables."""
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    out = RankEnv(host=host, node=node_name(env, host)[:128])
    for launcher, rank_var, size_var, local_vars, node_vars, job_vars in _LAUNCHERS:
        rank = _int(env, rank_var)
        if rank is None:
            continue
        out.launcher = launcher
        out.rank = rank
        out.world_size = _int(env, size_var) or max(rank + 1, 1)
        local = _int(env, *local_vars)
        out.local_rank = local if local is not None else 0
        out.node_rank = _int(env, *node_vars)
        out.job_id = _str(env, *job_vars)
        break
    if out.job_id is None:
        # torchrun inside SLURM: the allocation's job id still names the job
        out.job_id = _str(env, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
    # torch.distributed, when the script already initialised it, is the authority
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            out.rank = int(dist.get_rank())
            out.world_size = int(dist.get_world_size())
    except Exception:  # pragma: no cover - a broken process group must not break init
        pass
    return out


def device_type_of(name: str) -> str:
    """Short, comparable device type from a device name ("NVIDIA H100 80GB HBM3" -> "H100")."""
    n = name.upper()
    if "GH200" in n or "NVL" in n:
        return name  # not in the peak table: keep the full name rather than guess
    if "MI300X" in n:
        return "MI300X"
    if "B200" in n:
        return "B200"
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100-PCIe" if "PCIE" in n else "H100"
    if "A100" in n:
        return "A100"
    return name


def detect_device(local_rank: int = 0, clock: str = "auto") -> DeviceEnv:
    """Device name and count, from torch only if the script already imported it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return DeviceEnv()
    out = DeviceEnv(device_type="cpu", device_name="cpu", device_count=0)
    if clock == "cpu":
        return out
    try:
        if torch.cuda.is_available():
            out.cuda_available = True
            out.device_count = int(torch.cuda.device_count())
            idx = torch.cuda.current_device() if torch.cuda.is_initialized() else local_rank
            idx = idx % max(out.device_count, 1)
            out.device_name = str(torch.cuda.get_device_name(idx))
            out.device_type = device_type_of(out.device_name)
    except Exception:  # pragma: no cover - no usable GPU: a CPU run
        pass
    return out


def detect_versions() -> dict[str, Any]:
    """Python, torch, CUDA and NCCL versions (torch ones only when torch is already imported)."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    out["torch"] = str(getattr(torch, "__version__", ""))
    ver = getattr(torch, "version", None)
    out["cuda"] = getattr(ver, "cuda", None)
    out["hip"] = getattr(ver, "hip", None)
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # pragma: no cover
        pass
    return out


def git_commit(cwd: str | None = None, timeout_s: float = 2.0) -> str | None:
    """``GIT_COMMIT`` if set, else ``git rev-parse HEAD`` (bounded by ``timeout_s``), else None."""
    v = os.environ.get("GIT_COMMIT")
    if v:
        return v.strip()
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.decode(errors="replace").strip()
    return out if r.returncode == 0 and out else None
