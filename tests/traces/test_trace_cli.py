"""``fleetscope import-trace``: the --json shape of docs/cli.md (subprocess, the installed command),
and --server against the real server: run resolved or registered by name, idempotent re-import,
read back through the API and ``traces_store.run_traces``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(__file__))

from trace_testutil import KINETO, needs_data, reduced  # noqa: E402

CONTRACT_FIELDS = ("kernel_time_us", "idle_pct", "compute_pct", "non_compute_pct", "comm_overlap_pct")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("fleetscope") or str(Path(sys.executable).parent / "fleetscope")
    return subprocess.run([exe, "import-trace", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip


@needs_data
def test_json_output_has_the_contract_shape() -> None:
    out = _cli(str(KINETO / "hta_sampled_2rank"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["ranks"]) == {"0", "1"}
    for rank, s in doc["ranks"].items():
        for f in CONTRACT_FIELDS:
            assert isinstance(s[f], (int, float)), (rank, f)
    assert doc["ranks"]["0"]["idle_pct"] == 53.56 and doc["ranks"]["1"]["comm_overlap_pct"] == 20.05


@needs_data
def test_include_last_step_flag_and_single_file() -> None:
    out = _cli(str(KINETO / "hta_sampled_2rank" / "sampled_rank-1.json.gz"), "--json", "--include-last-step")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["ranks"]["1"]
    assert (s["kernel_time_us"], s["idle_pct"], s["comm_overlap_pct"]) == (1231186, 52.89, 19.93)


def test_bad_trace_exits_1_with_the_file_named(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"traceEvents": [')
    out = _cli(str(tmp_path / "bad.json"))
    assert out.returncode == 1 and "bad.json: truncated JSON" in out.stderr


def test_server_without_run_is_a_usage_error(tmp_path: Path) -> None:
    out = _cli(str(tmp_path), "--server", "http://127.0.0.1:9")
    assert out.returncode == 2 and "--run" in out.stderr


@needs_data
def test_server_attaches_traces_to_a_run_idempotently(live_server: Any) -> None:
    from fleetscope.server.reports import run_traces

    from fleetscope.traces.cli import import_trace

    src = KINETO / "hta_sampled_2rank"
    for _ in range(2):  # the second import replaces the first
        import_trace(src, include_last_step=False, as_json=False, server=live_server.url, token=live_server.token,
                     run="trace-import-1", num_kernels=10)  # fmt: skip
    with live_server.client() as c:
        (run,) = c.run_list(name="trace-import-1")
        got = c.get(f"/api/v1/runs/{run['id']}/traces")
    traces = got["traces"]
    assert [t["rank"] for t in traces] == [-1, 0, 1]
    want = reduced("hta_sampled_2rank", "default")  # num_kernels differs: compare the headline figures
    for t in traces[1:]:
        for f in CONTRACT_FIELDS:
            assert t["summary"][f] == want["ranks"][str(t["rank"])][f]
    assert traces[0]["summary"]["stragglers"]["hta"]["ranks"] == [1]
    assert run_traces(live_server.state.engine, run["id"]) == traces


def test_server_rejects_bad_bodies_and_missing_token(live_server: Any) -> None:
    with live_server.client() as c:
        run_id = c.register_run({"name": "trace-import-2"})
    url = f"{live_server.url}/api/v1/runs/{run_id}/traces"
    ok = {"ranks": {"0": {"source": "r0.json", "idle_pct": 1.5}}}
    assert httpx.post(url, json=ok).status_code == 401
    auth = {"Authorization": f"Bearer {live_server.token}"}
    assert httpx.post(url, json=ok, headers=auth).status_code == 200
    bad = [
        {"ranks": {"x": {"source": "r0.json"}}},
        {"ranks": {"0": {"idle_pct": 1}}},
        {"ranks": {"0": {"source": "r\u0000.json"}}},
        {"nothing": 1},
    ]
    for body in bad:
        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 422, (body, r.text)
    nan = httpx.post(
        url,
        content='{"ranks": {"0": {"source": "a", "v": NaN}}}',
        headers={**auth, "content-type": "application/json"},
    )
    assert nan.status_code == 422
    assert (
        httpx.post(f"{live_server.url}/api/v1/runs/999999/traces", json=ok, headers=auth).status_code == 404
    )
    assert httpx.get(f"{live_server.url}/api/v1/runs/999999/traces").status_code == 404
