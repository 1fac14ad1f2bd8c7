"""The Prometheus tests need Debian's ``prometheus`` and ``prometheus-alertmanager``: install them once,
before any test runs (outside every test's timeout), when a test of this folder is selected and a tool
is missing (prom_util.ensure_tools; the tests fail with its message when it cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(Path(str(item.path)).resolve().parent == _HERE for item in session.items):
        return
    from .prom_util import ensure_tools, find_tools

    if all(find_tools().values()):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("installing prometheus + prometheus-alertmanager with apt-get for the Prometheus tests "
                      "(first run only) ...")
    try:
        ensure_tools()
    except RuntimeError as e:  # each test that needs a tool fails with this message
        if tr is not None:
            tr.write_line(f"  {e}")


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    """{promtool, prometheus, amtool, alertmanager: path}; fails the test with the install command."""
    from .prom_util import ensure_tools

    try:
        return ensure_tools()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
