"""The disk spool: frames, sealing, torn and corrupt frames, the size cap, and `fleetscope upload`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fleetscope.agent.spool import (
    CORRUPT_SUFFIX,
    MAGIC,
    OPEN_SUFFIX,
    SEALED_SUFFIX,
    Spool,
    default_spool_dir,
    encode_frame,
    parse_name,
    read_segment,
)
from fleetscope.agent.transport import build_batch

from fleetscope.upload import upload
from fleetscope.wire import RANK_STEP_FIELDS

try:
    from ._receiver import Receiver
except ImportError:  # tests/agent is not a package
    from _receiver import Receiver

pytestmark = pytest.mark.timeout(60)

RUN = {"name": "spooled-run", "model_family": "llm-1b", "config": {}, "world_size": 4, "device_type": "cpu"}


def frame_payload(rank: int, steps: range) -> tuple[dict[str, Any], int]:
    rows = [
        ("rank_step", tuple({"rank": rank, "step": i, "step_s": 0.5}.get(f.name) for f in RANK_STEP_FIELDS))
        for i in steps
    ]
    batch, n, _ = build_batch(rows)
    return {"v": 1, "run_info": RUN, "batch": batch}, n


def steps_in(frames: list[Any]) -> list[int]:
    return [s for f in frames for s in f.payload()["batch"]["rank_steps"]["step"]]


def make_spool(d: Path, **kw: Any) -> Spool:
    return Spool(
        d, max_bytes=kw.pop("max_bytes", 1 << 20), segment_max_bytes=kw.pop("segment_max_bytes", 1 << 20)
    )


def test_frames_read_back_in_order_after_sealing(tmp_path):
    sp = make_spool(tmp_path)
    for k in range(5):
        assert sp.append(*frame_payload(0, range(k * 10, k * 10 + 10))) == (True, 0)
    assert [p.suffix for p in tmp_path.iterdir()] == [OPEN_SUFFIX]  # written, not yet sealed
    sp.seal()
    (path,) = tmp_path.iterdir()
    assert path.suffix == SEALED_SUFFIX and parse_name(path.name)["pid"] == os.getpid()
    seg = read_segment(path)
    assert seg.corrupt == [] and seg.records == 50
    assert steps_in(seg.frames) == list(range(50))
    assert sp.pending() == [path]


def test_segments_rotate_by_size_and_names_sort_in_write_order(tmp_path):
    sp = make_spool(tmp_path, segment_max_bytes=600)
    for k in range(12):
        sp.append(*frame_payload(0, range(k * 10, k * 10 + 10)))
    paths = sp.pending()
    assert len(paths) > 2 and paths == sorted(tmp_path.iterdir())
    assert steps_in([f for p in paths for f in read_segment(p).frames]) == list(range(120))


def test_torn_last_frame_is_skipped_and_counted(tmp_path):
    sp = make_spool(tmp_path)
    for k in range(3):
        sp.append(*frame_payload(0, range(k * 10, k * 10 + 10)))
    sp.seal()
    (path,) = tmp_path.iterdir()
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a crash in the middle of writing the last frame
        f.truncate(size - 7)
    seg = read_segment(path)
    assert steps_in(seg.frames) == list(range(20))
    assert len(seg.corrupt) == 1 and "torn" in seg.corrupt[0][1]
    with open(path, "ab") as f:  # even a torn header (a few bytes) is tolerated
        f.write(MAGIC[:3])
    assert steps_in(read_segment(path).frames) == list(range(20))


def test_corrupt_frame_in_the_middle_is_skipped_and_later_frames_survive(tmp_path):
    sp = make_spool(tmp_path)
    offsets = []
    for k in range(4):
        offsets.append(sp.bytes)
        sp.append(*frame_payload(0, range(k * 10, k * 10 + 10)))
    sp.seal()
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[offsets[1] + 20] ^= 0xFF  # a flipped payload byte in frame 1
    data[offsets[2] + 5] ^= 0xFF  # a flipped length in frame 2
    path.write_bytes(bytes(data))
    seg = read_segment(path)
    assert steps_in(seg.frames) == [*range(0, 10), *range(30, 40)]
    assert [off for off, _ in seg.corrupt] == offsets[1:3]  # both found, at their offsets


def test_garbage_file_never_raises(tmp_path):
    p = tmp_path / f"{0:020d}_h_1_ab_cd{SEALED_SUFFIX}"
    p.write_bytes(os.urandom(5000) + encode_frame(*frame_payload(0, range(3))) + b"\x00" * 10)
    seg = read_segment(p)
    assert steps_in(seg.frames) == [0, 1, 2] and seg.corrupt


def test_spool_cap_drops_the_oldest_segments_and_counts_their_records(tmp_path):
    one = len(encode_frame(*frame_payload(0, range(10))))
    sp = make_spool(tmp_path, max_bytes=10 * one, segment_max_bytes=2 * one)
    evicted = 0
    for k in range(30):
        written, ev = sp.append(*frame_payload(0, range(k * 10, k * 10 + 10)))
        assert written
        evicted += ev
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 10 * one  # never over the cap
    assert sp.evicted_segments > 0 and evicted > 0
    kept = steps_in([f for p in sp.pending() for f in read_segment(p).frames])
    assert kept == list(range(300 - len(kept), 300))  # the newest survive, contiguous, in order
    assert evicted + len(kept) == 300


def test_frame_bigger_than_the_cap_is_refused(tmp_path):
    sp = make_spool(tmp_path, max_bytes=200, segment_max_bytes=200)
    assert sp.append(*frame_payload(0, range(1_000))) == (False, 0)
    assert list(tmp_path.iterdir()) == []


def test_close_leaves_no_open_segment_and_spool_is_lazy(tmp_path):
    sp = make_spool(tmp_path / "never")
    sp.close()
    assert not (tmp_path / "never").exists()  # nothing spooled: nothing created
    sp = make_spool(tmp_path / "d")
    sp.append(*frame_payload(0, range(3)))
    sp.close()
    assert [p.suffix for p in (tmp_path / "d").iterdir()] == [SEALED_SUFFIX]


def test_default_spool_dir_is_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_spool_dir() == tmp_path / "fleetscope" / "spool"


# -- upload -------------------------------------------------------------------------------------------


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def test_upload_sends_everything_in_order_and_deletes_what_was_accepted(tmp_path, receiver):
    for rank in range(3):  # three writers sharing one directory
        sp = make_spool(tmp_path, segment_max_bytes=700)
        for k in range(6):
            sp.append(*frame_payload(rank, range(k * 10, k * 10 + 10)))
        sp.close()
    res = upload(tmp_path, receiver.url, "s3cret-token")
    assert res["records"] == 180 and res["failed"] == 0 and res["errors"] == []
    assert res["runs"] == {"spooled-run": 1} and len(receiver.run_posts) == 1  # registered once
    for rank in range(3):
        got = [r["step"] for r in receiver.rows() if r["rank"] == rank]
        assert got == list(range(60))
    assert list(tmp_path.iterdir()) == []


def test_upload_reports_corrupt_frames_by_file_and_keeps_going(tmp_path, receiver):
    sp = make_spool(tmp_path)
    offsets = []
    for k in range(3):
        offsets.append(sp.bytes)
        sp.append(*frame_payload(0, range(k * 10, k * 10 + 10)))
    sp.close()
    other = make_spool(tmp_path)
    other.append(*frame_payload(1, range(5)))
    other.close()
    bad_path = sorted(tmp_path.iterdir())[0]
    data = bytearray(bad_path.read_bytes())
    data[offsets[1] + 30] ^= 0x55
    bad_path.write_bytes(bytes(data))

    res = upload(tmp_path, receiver.url, "s3cret-token")
    assert res["corrupt_frames"] == 1 and res["records"] == 25
    assert any(str(bad_path) in e and "corrupt frame at byte" in e for e in res["errors"])
    assert res["failed"] == 1  # the file with the bad frame is kept for inspection
    assert [p.name for p in tmp_path.iterdir()] == [bad_path.name + CORRUPT_SUFFIX]
    assert sorted((r["rank"], r["step"]) for r in receiver.rows()) == sorted(
        [(0, s) for s in [*range(10), *range(20, 30)]] + [(1, s) for s in range(5)]
    )


def test_upload_stops_and_keeps_files_when_the_server_is_unreachable(tmp_path):
    sp = make_spool(tmp_path)
    sp.append(*frame_payload(0, range(5)))
    sp.close()
    res = upload(tmp_path, "http://127.0.0.1:9", "t", retry_deadline_s=0.2, backoff_initial_s=0.01)
    assert res["failed"] == 1 and res["records"] == 0 and "unreachable" in res["errors"][-1]
    assert len(list(tmp_path.iterdir())) == 1


def test_upload_leaves_segments_a_live_process_is_writing(tmp_path, receiver):
    live = make_spool(tmp_path)
    live.append(*frame_payload(0, range(5)))  # open (".part") and owned by this live process
    res = upload(tmp_path, receiver.url, "s3cret-token")
    assert res["skipped_live_files"] == 1 and res["records"] == 0
    live.close()
    assert upload(tmp_path, receiver.url, "s3cret-token")["records"] == 5


def test_upload_takes_open_segments_of_dead_processes(tmp_path, receiver):
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    sp = make_spool(tmp_path)
    sp.pid = dead
    sp.append(*frame_payload(3, range(8)))
    os.close(sp._fd)  # the writer died without sealing
    assert upload(tmp_path, receiver.url, "s3cret-token")["records"] == 8


def test_upload_of_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        upload(tmp_path / "nope", "http://127.0.0.1:9", None)


def test_a_frame_that_decompresses_past_the_bound_is_refused_not_expanded(tmp_path):
    import zlib

    from fleetscope.agent import spool as sp

    bomb = zlib.compress(b"\0" * (sp.MAX_PAYLOAD_BYTES + 1024), 9)  # ~256 KB on disk
    lr = sp._LEN_REC.pack(len(bomb), 1)
    crc = zlib.crc32(bomb, zlib.crc32(lr))
    path = tmp_path / "bomb.seg"
    path.write_bytes(sp._HEADER.pack(sp.MAGIC, len(bomb), 1, crc) + bomb)
    seg = sp.read_segment(path)
    assert len(seg.frames) == 1  # intact (checksummed) ...
    import pytest

    with pytest.raises(ValueError, match="decompresses past"):
        seg.frames[0].payload()  # ... but never expanded past the bound
