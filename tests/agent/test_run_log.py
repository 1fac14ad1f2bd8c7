"""``run.log`` with a fake transport: one ``scalars`` event per call with the finite numbers only, the
step it belongs to (the open step, else the last finished one, else the given one), bounds on names,
drops counted and never raised, no device sync (a CUDA-like tensor is dropped, not read), the disabled
agent's no-op, and tags in the run's meta."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fleetscope.agent as fs  # noqa: E402
from agent_testutil import FakeTransport  # noqa: E402
from fleetscope.agent.scalars import MAX_SCALAR_NAMES  # noqa: E402


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED", "FLEETSCOPE_TAGS"):
        monkeypatch.delenv(var, raising=False)
    r = fs.init("log-test", transport=FakeTransport, collectives=False)
    yield r
    r.finish()


def _scalars(r: Any) -> list[dict[str, Any]]:
    return [rec for kind, rec in r._tx.records if kind == "event" and rec["kind"] == "scalars"]


def test_one_event_per_call_with_the_finite_numbers_at_the_right_step(run: Any) -> None:
    run.log({"loss": 2.5})  # before any step: the first step's index
    with run.step(tokens=1):
        run.log({"inside": 1})
    run.log({"loss": 1.5, "lr": 3e-4, "nan": float("nan"), "inf": float("inf"), "s": "x", "none": None, "b": True})
    run.log({"eval/acc": 0.7}, step=40)
    run.log({"bad_step": 1.0}, step=-1)
    run.log({"only_bad": float("nan")})
    evs = _scalars(run)
    assert [(e["step"], e["data"]) for e in evs] == [(0, {"loss": 2.5}), (0, {"inside": 1.0}),
                                                     (0, {"loss": 1.5, "lr": 3e-4}), (40, {"eval/acc": 0.7})]
    assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs) and len({e["seq"] for e in evs}) == 4
    st = run.stats()
    assert st["scalars_dropped_values"] == 5 + 1 + 1 and st["scalars_logged"] == 5
    assert all(type(v) is float for e in evs for v in e["data"].values())


def test_numpy_and_cpu_tensor_values_are_read_device_tensors_are_dropped_without_a_sync(run: Any) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

    class DeviceTensor:  # what a CUDA tensor looks like to run.log: reading it would synchronise
        __module__ = "torch"
        device = torch.device("meta")

        def numel(self) -> int:
            return 1

        def is_complex(self) -> bool:
            return False

        def item(self) -> float:
            raise AssertionError("run.log read a device tensor")

    run.log({"np": np.float32(0.5), "np_int": np.int64(3), "cpu": torch.tensor(2.0), "vec": torch.ones(2),
             "dev": DeviceTensor(), "np_vec": np.ones(3)})
    (ev,) = _scalars(run)
    assert ev["data"] == {"np": 0.5, "np_int": 3.0, "cpu": 2.0}
    st = run.stats()
    assert st["scalars_on_device"] == 1 and st["scalars_dropped_values"] == 3


def test_names_are_bounded_per_run_and_a_mapping_that_fails_is_contained(run: Any) -> None:
    run.log({f"m{i}": float(i) for i in range(MAX_SCALAR_NAMES + 10)})
    run.log({"x" * 129: 1.0, "": 2.0, 7: 3.0, "m0": 4.0})
    evs = _scalars(run)
    assert len(evs[0]["data"]) == MAX_SCALAR_NAMES and evs[1]["data"] == {"m0": 4.0}
    assert run.stats()["scalars_dropped_names"] == 10 + 3

    class Broken(dict):
        def items(self) -> Any:
            raise RuntimeError("boom")

    run.log(Broken())  # never raises into the loop
    run.log(None)  # type: ignore[arg-type]
    assert run.stats()["internal_errors"] >= 1


def test_after_finish_and_when_disabled_log_does_nothing(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run.finish()
    run.log({"loss": 1.0})
    assert _scalars(run) == []
    monkeypatch.setenv("FLEETSCOPE_DISABLED", "1")
    noop = fs.init("off")
    assert isinstance(noop, fs.NoopRun) and noop.log({"loss": 1.0}) is None


def test_tags_from_init_meta_and_the_environment_are_stored_once_in_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSCOPE_TAGS", "env-a, ,shared")
    r = fs.init("tags", transport=FakeTransport, collectives=False, meta={"tags": ["m"]}, tags=["shared", "x" * 200, "t"])
    try:
        assert r.info["meta"]["tags"] == ["m", "shared", "t", "env-a"]
    finally:
        r.finish()
