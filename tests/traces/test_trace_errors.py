"""Broken, odd and large inputs: every failure is a TraceError whose message names the file and what
is wrong; the parse streams (event dicts are not kept); the stdlib fallback gives the same figures."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from trace_testutil import KINETO, cpu, kernel, launch, needs_data, write_trace  # noqa: E402

from fleetscope.traces import (  # noqa: E402
    TraceError,
    jsonstream,  # noqa: E402
    reduce_traces,
)

SAMPLED = KINETO / "hta_sampled_2rank" / "sampled_rank-0.json.gz"


def _raises(path: Path, *fragments: str) -> TraceError:
    with pytest.raises(TraceError) as ei:
        reduce_traces(path)
    msg = str(ei.value)
    assert msg.startswith(path.name + ":"), msg
    for f in fragments:
        assert f in msg, msg
    return ei.value


@needs_data
def test_truncated_gzip_names_file_and_byte(tmp_path: Path) -> None:
    data = SAMPLED.read_bytes()
    p = tmp_path / "cut.json.gz"
    p.write_bytes(data[: len(data) // 2])
    _raises(p, "truncated gzip stream at byte")


@needs_data
def test_corrupt_gzip_is_reported(tmp_path: Path) -> None:
    data = bytearray(SAMPLED.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    p = tmp_path / "flipped.json.gz"
    p.write_bytes(bytes(data))
    err = _raises(p)
    assert "gzip" in err.problem or "JSON" in err.problem


@needs_data
def test_invalid_json_midway_names_the_byte(tmp_path: Path) -> None:
    text = gzip.decompress(SAMPLED.read_bytes())
    mid = text.index(b'"name"', len(text) // 2)
    p = tmp_path / "broken.json"
    p.write_bytes(text[:mid] + b"{{{" + text[mid + 3 :])
    _raises(p, "invalid JSON near byte")


@needs_data
def test_truncated_plain_json(tmp_path: Path) -> None:
    text = gzip.decompress(SAMPLED.read_bytes())
    p = tmp_path / "half.json"
    p.write_bytes(text[: len(text) // 2])
    _raises(p, "truncated JSON")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "empty file"),
        (b'{"schemaVersion": 1, "deviceProperties": []}', "no 'traceEvents' array"),
        (b'{"traceEvents": []}', "traceEvents array is empty"),
        (
            b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {}}]}',
            "no trace events with 'cat' and 'dur'",
        ),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 5}]}', "has 'dur' but no 'ts'"),
        (
            b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 5}]}',
            "complete event without 'dur'",
        ),
        (
            b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "x", "dur": 1}]}',
            "non-numeric ts/dur",
        ),
        (b'{"traceEvents": [1, 2]}', "traceEvents[0] is a int"),
        (b'[{"ph": "X", "cat": "kernel", "ts": 1, "dur"', "truncated JSON"),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 2}', "truncated JSON"),
        (b"\x00\x01garbage", "invalid JSON"),
        (b"42", "not a trace"),
    ],
)
def test_malformed_documents(tmp_path: Path, content: bytes, fragment: str) -> None:
    p = tmp_path / "t.json"
    p.write_bytes(content)
    _raises(p, fragment)


def test_gpu_events_without_streams_are_an_error(tmp_path: Path) -> None:
    ev = [cpu("ProfilerStep#1", 0, 10, "user_annotation"), launch(1, 5)]
    ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": 2, "dur": 3, "args": {"correlation": 5}})
    p = write_trace(tmp_path / "nostream.json", ev)
    _raises(p, "none has args.stream")


def test_some_gpu_events_without_stream_are_counted_not_fatal(tmp_path: Path) -> None:
    ev = [
        launch(1, 5),
        kernel("k", 2, 3, 7, 5),
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 6, "dur": 3, "args": {}},
    ]
    r = reduce_traces(write_trace(tmp_path / "rank0.json", ev))["ranks"]["0"]
    assert r["kernel_time_us"] == 3
    assert any("without args.stream" in n for n in r["notes"])


def test_missing_path_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        reduce_traces(tmp_path / "nope.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no .json or .json.gz trace files"):
        reduce_traces(tmp_path / "empty")


def test_two_files_claiming_one_rank(tmp_path: Path) -> None:
    ev = [launch(1, 5), kernel("k", 2, 3, 7, 5)]
    meta = {"distributedInfo": {"rank": 4, "world_size": 8}}
    write_trace(tmp_path / "a.json", ev, meta=meta)
    write_trace(tmp_path / "b.json", ev, meta=meta)
    with pytest.raises(TraceError, match="rank 4 is also claimed by a.json"):
        reduce_traces(tmp_path)


def test_distributed_info_after_the_events_is_found(tmp_path: Path) -> None:
    ev = [launch(1, 5), kernel("k", 2, 3, 7, 5)]
    doc = json.dumps({"traceEvents": ev, "distributedInfo": {"rank": 6, "world_size": 8}})
    (tmp_path / "x.json").write_text(doc)
    assert list(reduce_traces(tmp_path / "x.json")["ranks"]) == ["6"]


def test_chrome_array_format_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "arr.json").write_text(json.dumps([launch(1, 5), kernel("k", 2, 3, 7, 5)]))
    assert reduce_traces(tmp_path / "arr.json")["ranks"]["0"]["kernel_time_us"] == 3


@needs_data
def test_stdlib_fallback_gives_the_same_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with_ijson = reduce_traces(KINETO / "hta_sampled_2rank")
    monkeypatch.setattr(jsonstream, "ijson_backend", lambda: None)
    without = reduce_traces(KINETO / "hta_sampled_2rank")
    assert without == with_ijson
    data = SAMPLED.read_bytes()
    p = tmp_path / "cut.json.gz"
    p.write_bytes(data[: len(data) // 3])
    _raises(p, "truncated gzip stream")
    text = gzip.decompress(data)
    (tmp_path / "half.json").write_bytes(text[: len(text) // 2])
    _raises(tmp_path / "half.json", "truncated JSON")


def test_limit_on_gpu_events_is_a_clear_error(tmp_path: Path) -> None:
    ev = [launch(1, i) for i in range(10)] + [kernel("k", 2 + i, 1, 7, i) for i in range(10)]
    p = write_trace(tmp_path / "big.json", ev)
    with pytest.raises(TraceError, match="more than 5 GPU events"):
        reduce_traces(p, max_gpu_events=5)


def test_cpu_events_stream_past_without_being_kept(tmp_path: Path) -> None:
    """60k CPU ops with large args (~25 MB of JSON): reducing them grows the process by a few MiB
    (json.load of the same file takes ~5x its size)."""
    ev = (
        '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": %d, "dur": 5, "args": '
        '{"Input Dims": [[1024, 1024], [1024, 1024], [1024, 1024], [1024, 1024]], "Input type": ["float", "float"],'
        ' "Concrete Inputs": ["%s", "%s"]}}'
    )
    pad = "x" * 150
    steps = (
        '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 500000},'
        '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1, "ts": 500000, "dur": 500000}'
    )
    p = tmp_path / "cpu.json"
    with p.open("w") as f:
        f.write('{"traceEvents": [' + steps)
        for i in range(60_000):
            f.write("," + ev % (i * 10, pad, pad))
        f.write("]}")
    assert p.stat().st_size > 20e6
    code = (
        "import resource, sys, json; import numpy, ijson; from fleetscope.traces import reduce_traces;"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "r = reduce_traces(sys.argv[1]);"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "print(json.dumps({'grew_kib': after - before, 'compute_s': r['ranks']['0']['steps'][0]['compute_s']}))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["compute_s"] > 0
    assert res["grew_kib"] < 12 * 1024, res


@pytest.mark.parametrize("open_, close", [(b"[", b"]"), (b'{"a":', b"}")], ids=["arrays", "objects"])
def test_nesting_bomb_is_refused_before_it_costs_memory(tmp_path: Path, open_: bytes, close: bytes) -> None:
    # 20,000 levels in ~40-120 KB: the streaming parser alone would take ~1 GB for this
    depth = 20_000
    p = tmp_path / "bomb.json"
    p.write_bytes(b'{"traceEvents":[{"ph":"X","cat":"kernel","name":"k","ts":1,"dur":2,"args":'
                  + open_ * depth + (b"1" if close == b"}" else b"") + close * depth + b"}]}")
    _raises(p, f"nested deeper than {jsonstream.MAX_DEPTH} levels", "not a trace")


def test_depth_guard_counts_across_reads_and_lets_real_nesting_through() -> None:
    g = jsonstream._DepthGuard("t")
    g.feed(b'{"a": [[{"b": "[x] in a string"}]]}' * 1000)  # balanced, shallow: fine
    assert g.depth == 0
    for _ in range(jsonstream.MAX_DEPTH // 10):
        g.feed(b"[" * 10)  # exactly MAX_DEPTH, fed 10 bytes at a time
    assert g.depth == jsonstream.MAX_DEPTH
    with pytest.raises(TraceError, match="nested deeper"):
        g.feed(b"[")
