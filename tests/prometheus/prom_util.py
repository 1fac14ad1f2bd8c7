"""Debian's Prometheus tools for the tests of the shipped Prometheus side (rules, configs, dashboard):
``promtool`` and ``prometheus`` (package ``prometheus``), ``amtool`` and the Alertmanager
(``prometheus-alertmanager``; upstream calls the binary ``alertmanager``). Installed with apt-get on
first use when missing, as the browser tests install chromium (tests/dashboard/browser_util.py), so
that the README's test command needs no extra step; otherwise a RuntimeError says what to run.

Also: a real Prometheus / Alertmanager process on 127.0.0.1 on a free port with its own storage
directory, stopped (and its directory removed) on leaving the ``with`` block, whatever happened."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: tool -> the names its binary has (Debian's first)
_BINARIES = {
    "promtool": ("promtool",),
    "prometheus": ("prometheus",),
    "amtool": ("amtool",),
    "alertmanager": ("prometheus-alertmanager", "alertmanager"),
}
_APT_PACKAGES = ("prometheus", "prometheus-alertmanager")
_install_lock = threading.Lock()
_install_error: str | None = None


def find_tools() -> dict[str, str | None]:
    """{tool: path or None} for promtool, prometheus, amtool and alertmanager."""
    return {tool: next((p for p in map(shutil.which, names) if p), None) for tool, names in _BINARIES.items()}


def ensure_tools() -> dict[str, str]:
    """The four tools, installed with ``apt-get install prometheus prometheus-alertmanager`` on first
    use when one is missing (as root, or with password-less sudo). Raises RuntimeError naming what is
    missing and the command that installs it."""
    global _install_error
    with _install_lock:
        found = find_tools()
        if all(found.values()):
            return {k: v for k, v in found.items() if v}
        if _install_error is not None:  # tried once this session already
            raise RuntimeError(_install_error)
        apt = shutil.which("apt-get")
        sudo: list[str] = []
        if os.geteuid() != 0:
            sudo = ["sudo", "-n"] if shutil.which("sudo") else []
        why = ""
        if apt and (os.geteuid() == 0 or sudo):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for cmd in ([*sudo, apt, "update", "-q"],
                        [*sudo, apt, "install", "-y", "-q", "--no-install-recommends", *_APT_PACKAGES]):
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
                if r.returncode != 0:
                    why = f"; `{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-400:]}"
                    break
            found = find_tools()
            if all(found.values()):
                return {k: v for k, v in found.items() if v}
        missing = ", ".join(k for k, v in found.items() if not v)
        _install_error = (
            f"the Prometheus tests need Debian's Prometheus tools on PATH (missing: {missing}){why}; install "
            f"them with `sudo apt-get install -y --no-install-recommends {' '.join(_APT_PACKAGES)}`"
        )
        raise RuntimeError(_install_error)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A Prometheus or Alertmanager process on loopback."""

    url: str
    proc: subprocess.Popen[str]
    log: Path

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _wait_ready(p: Proc, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise AssertionError(f"{p.url}: exited with {p.proc.returncode}:\n{p.output()}")
        try:
            if httpx.get(f"{p.url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{p.url} not ready within {timeout:.0f}s:\n{p.output()}")


@contextlib.contextmanager
def _process(argv: list[str], port: int, workdir: Path, timeout: float) -> Iterator[Proc]:
    log = workdir / "process.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=workdir,
                                start_new_session=True)
    p = Proc(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_ready(p, timeout)
        yield p
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)


@contextlib.contextmanager
def run_prometheus(config: dict[str, Any], files: dict[str, str] | None = None,
                   timeout: float = 60) -> Iterator[Proc]:
    """A real Prometheus with ``config`` (as YAML) and ``files`` (name -> text, e.g. rule files) in a
    temp dir that is its working directory, its TSDB under it, on a free loopback port."""
    import yaml

    exe = ensure_tools()["prometheus"]
    d = Path(tempfile.mkdtemp(prefix="fs-prom-"))
    try:
        for name, text in (files or {}).items():
            (d / name).write_text(text)
        (d / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        argv = [exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        with _process(argv, port, d, timeout) as p:
            yield p
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def run_alertmanager(config: dict[str, Any], timeout: float = 60) -> Iterator[Proc]:
    """A real Alertmanager with ``config`` (as YAML), no clustering, its storage in a temp dir, on a free
    loopback port."""
    import yaml

    exe = ensure_tools()["alertmanager"]
    d = Path(tempfile.mkdtemp(prefix="fs-am-"))
    try:
        (d / "alertmanager.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        argv = [exe, f"--config.file={d / 'alertmanager.yml'}", f"--storage.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"]
        with _process(argv, port, d, timeout) as p:
            yield p
    finally:
        shutil.rmtree(d, ignore_errors=True)


def wait_for(pred: Any, timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` s with the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})")
