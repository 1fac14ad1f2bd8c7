"""Headless Debian chromium for the dashboard tests (selenium + chromedriver)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1440,900")

#: per graph id: number of traces Plotly drew (-1: no graph element, or not drawn yet)
_TRACES_JS = """
return arguments[0].map(function (id) {
    var el = document.getElementById(id);
    if (!el) return -1;
    var gd = el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
    if (!gd || !gd._fullLayout || !gd.querySelector('.main-svg')) return -1;
    return (gd.data || []).length;
});
"""


def find_chromium() -> tuple[str | None, str | None]:
    browser = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    return browser, shutil.which("chromedriver")


_APT_PACKAGES = ("chromium", "chromium-driver")
_install_lock = threading.Lock()
_install_error: str | None = None


def ensure_chromium() -> tuple[str, str]:
    """Debian's chromium and chromedriver, installed with apt-get on first use when they are missing
    (as root, or with password-less sudo), so that the README's test command needs no extra step.
    Raises RuntimeError naming what is missing and the command that installs it."""
    global _install_error
    with _install_lock:
        binary, driver = find_chromium()
        if binary and driver:
            return binary, driver
        if _install_error is not None:  # tried once this session already
            raise RuntimeError(_install_error)
        apt = shutil.which("apt-get")
        sudo: list[str] = []
        if os.geteuid() != 0:
            sudo = ["sudo", "-n"] if shutil.which("sudo") else []
        why = ""
        if apt and (os.geteuid() == 0 or sudo):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for cmd in ([*sudo, apt, "update", "-q"], [*sudo, apt, "install", "-y", "-q", *_APT_PACKAGES]):
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
                if r.returncode != 0:
                    why = f"; `{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-400:]}"
                    break
            binary, driver = find_chromium()
            if binary and driver:
                return binary, driver
        _install_error = (
            "the dashboard browser tests need headless chromium and chromedriver on PATH "
            f"(found chromium={binary}, chromedriver={driver}){why}; install them with "
            "`sudo apt-get install -y chromium chromium-driver`"
        )
        raise RuntimeError(_install_error)


def start_browser() -> Any:
    """A headless chromium with a fresh profile (installed on first use, see ``ensure_chromium``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = ensure_chromium()
    opts = Options()
    for f in FLAGS:
        opts.add_argument(f)
    profile = tempfile.mkdtemp(prefix="fs-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.binary_location = binary
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        d = webdriver.Chrome(service=Service(driver), options=opts)
    except Exception:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    quit_ = d.quit

    def quit_and_clean() -> None:  # the fresh profile goes with the browser
        try:
            quit_()
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    d.quit = quit_and_clean
    d.set_page_load_timeout(60)
    return d


def wait_for_charts(driver: Any, ids: list[str], *, timeout: float = 45.0, min_traces: int = 1) -> list[int]:
    """Wait until every graph in ``ids`` is drawn with at least ``min_traces`` traces; returns the counts."""
    deadline = time.monotonic() + timeout
    while True:
        counts = driver.execute_script(_TRACES_JS, ids)
        if all(c >= min_traces for c in counts):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"charts not drawn within {timeout:.0f}s: {dict(zip(ids, counts, strict=True))}")
        time.sleep(0.05)


def wait_for(driver: Any, js: str, *, timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll a JS expression until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        v = driver.execute_script("return " + js)
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {js}")
        time.sleep(0.05)


def severe_logs(driver: Any) -> list[str]:
    """Browser-console entries of level SEVERE since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def open_browser() -> Iterator[Any]:
    """The body of a ``browser`` fixture (``yield from open_browser()``): a headless chromium for the
    fixture's scope, quit afterwards, failing or not; the test fails naming why when none starts."""
    import pytest

    try:
        d = start_browser()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield d
    finally:
        d.quit()
