"""The job's own id, the same on every node with no coordination (agent/env.py ``job_id``), the node
name (``node_name``), and what `fleetscope run` puts in its command's environment (launcher.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fleetscope.agent import env
from fleetscope.agent.health import job_identity

from fleetscope.launcher import launch_env, launch_job_id

K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, (None, None)),
    # precedence: ours, torchrun's rendezvous id, SLURM job[.step], Kubeflow, MPI, the launch's
    ({"FLEETSCOPE_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "r", "SLURM_JOB_ID": "1"}, ("mine", "fleetscope")),
    ({"TORCHELASTIC_RUN_ID": "r", "SLURM_JOB_ID": "1", "FLEETSCOPE_LAUNCH_ID": "l"}, ("r", "torchrun")),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0"}, ("1234.0", "slurm")),
    ({"TORCHELASTIC_RUN_ID": "", "FLEETSCOPE_JOB_ID": " ", "SLURM_JOB_ID": "1234"}, ("1234", "slurm")),
    ({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "4294967294"}, ("1234", "slurm")),  # the batch script: the job
    ({**K8S, "PET_RDZV_ID": "elastic-1", "MASTER_ADDR": "pj-master-0"}, ("elastic-1", "kubernetes")),
    ({**K8S, "MASTER_ADDR": "pj-master-0", "RANK": "3"}, ("pj", "kubernetes")),  # PyTorchJob (v1)
    ({**K8S, "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_NODE_RANK": "1"}, ("tj", "kubernetes")),  # TrainJob (v2)
    ({**K8S, "PET_RDZV_ENDPOINT": "ej-worker-0:23456"}, ("ej", "kubernetes")),  # elastic PyTorchJob
    ({**K8S, "JOBSET_NAME": "js", "MASTER_ADDR": "js-workers-0-0.js"}, ("js", "kubernetes")),  # JobSet, named
    ({**K8S, "MASTER_ADDR": "js-workers-0-0.js"}, ("js", "kubernetes")),  # JobSet: the leader pod's address
    ({"JOBSET_NAME": "js"}, (None, None)),  # not in a pod
    ({"MASTER_ADDR": "pj-master-0"}, (None, None)),  # not in a pod: a host name, no job
    ({"PMIX_NAMESPACE": "prterun-h1-4711@1", "OMPI_COMM_WORLD_RANK": "0"}, ("prterun-h1-4711@1", "mpi")),
    ({"OMPI_MCA_orte_ess_jobid": "3815636993"}, ("3815636993", "mpi")),
    ({"FLEETSCOPE_LAUNCH_ID": "20250101-000000-abcd"}, ("20250101-000000-abcd", "launch")),
])
def test_job_id_precedence(environ: dict[str, str], expected: tuple[Any, Any]) -> None:
    assert env.job_id(environ) == expected
    assert job_identity(environ)[0] == expected[0]


def test_job_id_is_bounded_and_printable() -> None:
    assert env.job_id({"FLEETSCOPE_JOB_ID": "x" * 300})[0] == "x" * env.MAX_JOB_ID
    assert env.job_id({"TORCHELASTIC_RUN_ID": "a\nb\x00"})[0] == "ab"


def test_node_name() -> None:
    assert env.node_name({"FLEETSCOPE_NODE": " n7 ", "SLURMD_NODENAME": "gpu-1"}) == "n7"
    assert env.node_name({"SLURMD_NODENAME": "gpu-1"}) == "gpu-1"
    assert env.node_name({"FLEETSCOPE_NODE": ""}, host="h") == "h"
    r = env.detect_rank({"FLEETSCOPE_NODE": "n7", "RANK": "1", "WORLD_SIZE": "4"})
    assert r.node == "n7" and r.host != "n7"


TORCHRUN = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "h0:29400", "--rdzv-id", "J7", "train.py", "--rdzv-id", "not-torchruns"]


@pytest.mark.parametrize(("command", "environ", "expected"), [
    (TORCHRUN, {}, ("J7", "torchrun")),
    (["srun", "torchrun", "--rdzv_id=J8", "train.py"], {"SLURM_JOB_ID": "5"}, ("J8", "torchrun")),
    (["python", "-m", "torch.distributed.run", "--rdzv-id", "J9", "-m", "pkg.train"], {}, ("J9", "torchrun")),
    (["torchrun", "--nnodes", "2", "train.py"], {"PET_RDZV_ID": "k8s-j"}, ("k8s-j", "torchrun")),
    # torchrun's default "none": the workers fall through to SLURM, and so does the launcher
    (["torchrun", "--nproc-per-node", "2", "train.py"], {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "1",
                                                         "TORCHELASTIC_RUN_ID": "outer"}, ("5.1", "slurm")),
    # --standalone: torchrun draws its own run id per launch (one node): the launcher knows none
    (["torchrun", "--standalone", "--nproc-per-node", "2", "train.py"], {"SLURM_JOB_ID": "5"}, (None, None)),
    (["python", "train.py"], {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}, ("5.0", "slurm")),
    (["python", "train.py"], {"FLEETSCOPE_LAUNCH_ID": "old"}, (None, None)),
    (["python", "train.py"], {"FLEETSCOPE_JOB_ID": "given", "SLURM_JOB_ID": "5"}, ("given", "fleetscope")),
])
def test_the_launcher_sees_the_job_id_its_processes_will_see(command: list[str], environ: dict[str, str],
                                                             expected: tuple[Any, Any]) -> None:
    assert launch_job_id(command, environ) == expected


def _fs_env(command: list[str], base: dict[str, str], **kw: Any) -> dict[str, str]:
    opts: dict[str, Any] = {"name": None, "family": None, "server": None, "token": None, **kw}
    return launch_env("/site", command, base=base, **opts)


def test_every_node_of_a_job_gets_the_same_name_and_job_the_launchers_ids_untouched() -> None:
    nodes = [_fs_env(TORCHRUN, {"TORCHELASTIC_RUN_ID": "keep", "SLURM_JOB_ID": "5", "HOSTNAME": f"n{i}"})
             for i in range(2)]
    for e in nodes:
        assert e["FLEETSCOPE_RUN_NAME"] == "train-J7"
        assert "FLEETSCOPE_JOB_ID" not in e and "FLEETSCOPE_LAUNCH_ID" not in e  # torchrun's id is the job's
        assert e["TORCHELASTIC_RUN_ID"] == "keep" and e["SLURM_JOB_ID"] == "5"
    named = [_fs_env(TORCHRUN, {}, name="exp-1") for _ in range(2)]
    assert [e["FLEETSCOPE_RUN_NAME"] for e in named] == ["exp-1", "exp-1"]
    given = _fs_env(["python", "train.py"], {"SLURM_JOB_ID": "5"}, job_id="job-x")
    assert given["FLEETSCOPE_JOB_ID"] == "job-x" and given["FLEETSCOPE_RUN_NAME"] == "train-job-x"
    slurm = _fs_env(["python", "train.py"], {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "2"})
    assert slurm["FLEETSCOPE_RUN_NAME"] == "train-5.2" and "FLEETSCOPE_JOB_ID" not in slurm


def test_a_launch_without_any_job_id_makes_one_of_last_resort() -> None:
    a, b = (_fs_env(["python", "train.py"], {}) for _ in range(2))
    assert a["FLEETSCOPE_LAUNCH_ID"] != b["FLEETSCOPE_LAUNCH_ID"]  # two launches: two jobs
    assert a["FLEETSCOPE_RUN_NAME"] == f"train-{a['FLEETSCOPE_LAUNCH_ID']}" and "FLEETSCOPE_JOB_ID" not in a
    # ... which an id the processes find themselves outranks (a torchrun started by a script)
    assert env.job_id({**a, "TORCHELASTIC_RUN_ID": "J7"}) == ("J7", "torchrun")
    assert env.job_id(a) == (a["FLEETSCOPE_LAUNCH_ID"], "launch")
