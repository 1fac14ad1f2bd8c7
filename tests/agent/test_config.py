"""AgentConfig: frozen, validated at construction, each default written once; every FLEETSCOPE_*
variable it reads falls back to its default, with one warning, when its value is unusable — a typo
in a job's environment never kills the job — while a bad keyword argument raises."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent import config as config_mod  # noqa: E402
from fleetscope.agent.config import ENV_VARS, AgentConfig  # noqa: E402

AGENT_DIR = Path(fs.__file__).parent

# (variable, unusable value) for every variable AgentConfig reads; FLEETSCOPE_SPOOL_DIR takes any
# string (a path), so no value of it is unusable
BAD_VALUES: list[tuple[str, str]] = [
    ("FLEETSCOPE_TRACE_EVERY", "often"),
    ("FLEETSCOPE_TRACE_EVERY", "-5"),
    ("FLEETSCOPE_TRACE_EVERY", "2.5"),
    ("FLEETSCOPE_OFFLINE", "maybe"),
    ("FLEETSCOPE_DISABLED", "perhaps"),
    ("FLEETSCOPE_SERVER", "ftp://fleetscope.example"),
    ("FLEETSCOPE_SERVER", "localhost:8000"),
    ("FLEETSCOPE_SERVER", "http://fleetscope.example:99999"),
    ("FLEETSCOPE_TOKEN", "s3cret\nInjected: header"),
    ("FLEETSCOPE_HEARTBEAT_S", "often"),
    ("FLEETSCOPE_HEARTBEAT_S", "-1"),
    ("FLEETSCOPE_STACK_AFTER_S", "nan"),
    ("FLEETSCOPE_DEVICE_SAMPLE_S", "often"),
    ("FLEETSCOPE_DEVICE_WINDOW_S", "-2"),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ENV_VARS, "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(config_mod, "_warned", set())  # "once per process" starts afresh per test


def test_every_variable_read_has_a_bad_value_case() -> None:
    assert {v for v, _ in BAD_VALUES} == set(ENV_VARS) - {"FLEETSCOPE_SPOOL_DIR"}


@pytest.mark.parametrize("var,raw", BAD_VALUES, ids=[f"{v}={r!r}" for v, r in BAD_VALUES])
def test_unusable_env_value_warns_once_and_keeps_the_default(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, var: str, raw: str
) -> None:
    field = ENV_VARS[var]
    default = AgentConfig.__dataclass_fields__[field].default
    monkeypatch.setenv(var, raw)
    with caplog.at_level(logging.WARNING, logger="fleetscope.agent.config"):
        assert getattr(AgentConfig.from_env(), field) == default
        assert getattr(AgentConfig.from_env(), field) == default
        run = fs.init("bad-env", transport=FakeTransport, collectives=False)  # the job goes on
    try:
        assert isinstance(run, fs.Run) and getattr(run.config, field) == default
    finally:
        run.finish()
    warnings = [r for r in caplog.records if r.name == "fleetscope.agent.config"]
    assert len(warnings) == 1, caplog.text  # once, however often the environment is read
    assert var in warnings[0].getMessage() and "default" in warnings[0].getMessage()
    if var == "FLEETSCOPE_TOKEN":
        assert "s3cret" not in caplog.text  # never logged, not even when unusable


def test_usable_env_values_are_read_and_keywords_win(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSCOPE_SERVER", "https://fs.example:8443/prefix/")
    monkeypatch.setenv("FLEETSCOPE_TOKEN", "tok")
    monkeypatch.setenv("FLEETSCOPE_SPOOL_DIR", "/tmp/somewhere")
    monkeypatch.setenv("FLEETSCOPE_OFFLINE", " Yes ")
    monkeypatch.setenv("FLEETSCOPE_DISABLED", "0")
    monkeypatch.setenv("FLEETSCOPE_TRACE_EVERY", "50")
    c = AgentConfig.from_env()
    assert (c.server, c.token, c.spool_dir, c.offline, c.disabled, c.trace_every_steps) == (
        "https://fs.example:8443/prefix", "tok", "/tmp/somewhere", True, False, 50,
    )  # fmt: skip
    c = AgentConfig.from_env(server="http://other:1", offline=False, trace_every_steps=None)
    assert (c.server, c.offline, c.trace_every_steps) == ("http://other:1", False, 50)  # None: not given
    monkeypatch.setenv("FLEETSCOPE_OFFLINE", "")  # empty: unset, not unusable
    assert AgentConfig.from_env().offline is False


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"server": "ftp://x"}, "server"),
        ({"token": "a\r\nb"}, "token"),
        ({"clock": "sundial"}, "clock"),
        ({"trace_every_steps": -1}, "trace_every_steps"),
        ({"trace_active_steps": 0}, "trace_active_steps"),
        ({"batch_max_records": 0}, "batch_max_records"),
        ({"queue_max_records": 10, "batch_max_records": 20}, "queue_max_records"),
        ({"flush_interval_s": "2"}, "flush_interval_s"),
        ({"memory_every_steps": 1.5}, "memory_every_steps"),
        ({"max_pending_steps": True}, "max_pending_steps"),
    ],
)
def test_bad_keyword_settings_raise_at_construction(clean_env: None, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AgentConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        fs.init("bad", transport=FakeTransport, **kwargs)  # the caller's bug: raised, not swallowed


def test_config_is_frozen_and_documented() -> None:
    c = AgentConfig(server="http://h:1/")
    assert c.server == "http://h:1"  # normalised at construction
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.offline = True  # type: ignore[misc]
    src = (AGENT_DIR / "config.py").read_text()
    for f in dataclasses.fields(AgentConfig):  # one docstring line under every field
        assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"[^\n]+\"\"\"\n", src), f.name
    assert "s3cret" not in repr(AgentConfig(token="s3cret"))


def test_defaults_are_written_once() -> None:
    """No default of a setting is repeated outside its field: settings are read from the config."""
    for path in AGENT_DIR.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"getattr\((self\.|run\.)?(config|cfg), *\"", src), path.name
