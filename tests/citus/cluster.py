"""A Citus cluster on loopback for tests and benchmarks: Citus built once from the vendored source
into the embedded server's PostgreSQL (pgserver), a coordinator and N workers started as an
unprivileged user, registered with each other, and torn down (``pg_ctl stop -m immediate``, data
dirs removed) whatever happens.

    with CitusCluster.start(workers=2) as cluster:
        url = cluster.create_database("fs")   # on every node, with the extension, workers added
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

VENDOR_TARBALL = Path(__file__).resolve().parents[3] / "shared" / "vendor" / "citus-13.2.2.tar.gz"
#: where the build happens (kept between runs: a rebuild is skipped while citus.so is installed)
BUILD_CACHE = Path(os.environ.get("FLEETSCOPE_CITUS_BUILD_DIR", Path.home() / ".cache" / "fleetscope" / "citus-build"))
#: shards per distributed table in the test cluster (Citus' default is 32: fewer keep TRUNCATE and
#: DDL on the ~30 distributed tables fast; 4 still spread over both workers)
TEST_SHARD_COUNT = 4


class CitusUnavailable(RuntimeError):
    """Citus could not be built or started (a failure, not a skip, in CI)."""


def pg_bin() -> Path:
    import pgserver

    return Path(pgserver.__file__).parent / "pginstall" / "bin"


def pg_config() -> Path:
    return pg_bin() / "pg_config"


def citus_installed() -> bool:
    """citus.so and its control file are installed in pgserver's PostgreSQL."""
    out = subprocess.run([str(pg_config()), "--pkglibdir", "--sharedir"], capture_output=True, text=True, check=True)
    libdir, sharedir = out.stdout.split()
    return (Path(libdir) / "citus.so").is_file() and (Path(sharedir) / "extension" / "citus.control").is_file()


def ensure_citus_built(tarball: Path = VENDOR_TARBALL, jobs: int = 2) -> None:
    """Build Citus from ``tarball`` and install it into pgserver's PostgreSQL, unless it is already
    installed there. Serialised by a file lock (concurrent test sessions build once)."""
    if citus_installed():
        return
    if not tarball.is_file():
        raise CitusUnavailable(f"Citus is not installed in {pg_config().parent.parent} and its source {tarball} is absent")
    BUILD_CACHE.mkdir(parents=True, exist_ok=True)
    with open(BUILD_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if citus_installed():
            return
        work = Path(tempfile.mkdtemp(prefix="citus-", dir=BUILD_CACHE))
        log = BUILD_CACHE / "build.log"
        try:
            with tarfile.open(tarball) as tf:
                tf.extractall(work, filter="data")
            (src,) = [p for p in work.iterdir() if p.is_dir()]
            with open(log, "w") as out:
                for cmd in (
                    ["./configure", f"PG_CONFIG={pg_config()}", "--without-libcurl", "--without-lz4", "--without-zstd"],
                    ["make", f"-j{jobs}"],
                    ["make", "install"],
                ):
                    out.write(f"+ {' '.join(cmd)}\n")
                    out.flush()
                    r = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT, check=False)
                    if r.returncode != 0:
                        tail = log.read_text()[-3000:]
                        raise CitusUnavailable(f"building Citus failed at `{' '.join(cmd)}` (log {log}):\n{tail}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not citus_installed():
            raise CitusUnavailable(f"`make install` did not install citus.so into {pg_config().parent.parent}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> dict[str, Any]:
    """subprocess kwargs that run PostgreSQL as an unprivileged user (it refuses root)."""
    if os.geteuid() != 0:
        return {}
    from pgserver.utils import ensure_user_exists

    entry = ensure_user_exists("pgserver")  # the user pgserver itself runs its postmaster as when root
    assert entry is not None
    return {"user": entry.pw_uid, "group": entry.pw_gid}


class Node:
    def __init__(self, name: str, pgdata: Path, port: int) -> None:
        self.name, self.pgdata, self.port = name, pgdata, port

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def connect(self, db: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(db), autocommit=True)


NODE_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = ''
shared_preload_libraries = 'citus'
max_connections = 120
shared_buffers = 48MB
fsync = off
synchronous_commit = off
full_page_writes = off
wal_level = logical
max_replication_slots = 16
max_wal_senders = 16
citus.node_conninfo = 'sslmode=disable'
citus.shard_count = {shard_count}
citus.max_adaptive_executor_pool_size = 4
log_min_messages = warning
"""


class CitusCluster:
    """A coordinator and ``workers`` worker nodes on loopback ports; ``stop()`` removes everything."""

    def __init__(self, root: Path, workers: int, shard_count: int = TEST_SHARD_COUNT) -> None:
        self.root = root
        self.shard_count = shard_count
        self.as_user = _run_as()
        names = ["coordinator"] + [f"worker{i}" for i in range(1, workers + 1)]
        self.nodes = [Node(n, root / n, _free_port()) for n in names]
        self.databases: list[str] = []

    @property
    def coordinator(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    @classmethod
    def start(cls, workers: int = 2, shard_count: int = TEST_SHARD_COUNT) -> CitusCluster:
        ensure_citus_built()
        root = Path(tempfile.mkdtemp(prefix="fs-citus-", dir="/tmp"))
        cluster = cls(root, workers, shard_count)
        try:
            if cluster.as_user:
                shutil.chown(root, cluster.as_user["user"], cluster.as_user["group"])
            root.chmod(0o755)
            for node in cluster.nodes:
                cluster._start_node(node)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_worker(self) -> Node:
        """Start one more worker node and register it with the coordinator in every database
        created so far (``citus_add_node``)."""
        node = Node(f"worker{len(self.nodes)}", self.root / f"worker{len(self.nodes)}", _free_port())
        self.nodes.append(node)
        self._start_node(node)
        for db in self.databases:
            with node.connect() as c:
                c.execute(f'CREATE DATABASE "{db}"')
            with node.connect(db) as c:
                c.execute("CREATE EXTENSION citus")
            with self.coordinator.connect(db) as c:
                c.execute("SELECT citus_add_node('127.0.0.1', %s)", (node.port,))
        return node

    def _pg(self, exe: str, *args: str, timeout: float = 120) -> None:
        r = subprocess.run(
            [str(pg_bin() / exe), *args], capture_output=True, text=True, timeout=timeout, check=False, **self.as_user
        )
        if r.returncode != 0:
            raise CitusUnavailable(f"{exe} {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def _start_node(self, node: Node) -> None:
        self._pg("initdb", "-D", str(node.pgdata), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                 "--locale=C", "--no-sync")
        with open(node.pgdata / "postgresql.conf", "a") as f:
            f.write(NODE_CONF.format(port=node.port, shard_count=self.shard_count))
        self._pg("pg_ctl", "-D", str(node.pgdata), "-l", str(node.pgdata / "server.log"), "-w", "-t", "60", "start")
        deadline = time.monotonic() + 30
        while True:
            try:
                with node.connect():
                    return
            except psycopg.OperationalError as e:
                if time.monotonic() > deadline:
                    log = (node.pgdata / "server.log").read_text()[-2000:]
                    raise CitusUnavailable(f"{node.name} on port {node.port} did not accept connections: {e}\n{log}") from e
                time.sleep(0.1)

    def create_database(self, name: str | None = None) -> str:
        """A database on every node with the citus extension, the coordinator's metadata knowing
        every worker; its URL on the coordinator."""
        name = name or "fs_" + uuid.uuid4().hex[:10]
        for node in self.nodes:
            with node.connect() as c:
                c.execute(f'CREATE DATABASE "{name}"')
            with node.connect(name) as c:
                c.execute("CREATE EXTENSION citus")
        with self.coordinator.connect(name) as c:
            c.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (self.coordinator.port,))
            for w in self.workers:
                c.execute("SELECT citus_add_node('127.0.0.1', %s)", (w.port,))
        self.databases.append(name)
        return self.coordinator.url(name)

    def drop_database(self, name: str) -> None:
        for node in self.nodes:
            with node.connect() as c:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.databases:
            self.databases.remove(name)

    def stop(self) -> None:
        """Stop every node (immediate shutdown) and remove the data directories."""
        try:
            for node in self.nodes:
                if (node.pgdata / "postmaster.pid").exists():
                    try:
                        self._pg("pg_ctl", "-D", str(node.pgdata), "-m", "immediate", "-w", "-t", "30", "stop")
                    except (CitusUnavailable, subprocess.TimeoutExpired):
                        _kill_postmaster(node.pgdata)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> CitusCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_postmaster(pgdata: Path) -> None:
    import signal

    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, signal.SIGQUIT)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # `python tests/citus/cluster.py build`: what .ci/run does before the tier
    import sys

    if sys.argv[1:] != ["build"]:
        raise SystemExit("usage: python tests/citus/cluster.py build")
    t0 = time.monotonic()
    already = citus_installed()
    ensure_citus_built()
    print("citus: already installed in" if already else f"citus: built in {time.monotonic() - t0:.0f}s and installed into",
          pg_config().parent.parent)
