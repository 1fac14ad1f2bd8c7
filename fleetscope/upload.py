"""``fleetscope upload SPOOL_DIR``: send what the agent spooled (offline mode, or a server outage).

Reads every segment of the directory oldest first, registers each frame's run (idempotent by name),
sends the frames in order, and deletes a file once all its frames were accepted. Resending is safe:
the server keys every record, so a file that was half sent before is simply sent again.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from fleetscope.agent.api_client import Client
from fleetscope.agent.spool import (
    CORRUPT_SUFFIX,
    OPEN_SUFFIX,
    SEALED_SUFFIX,
    host_name,
    parse_name,
    pid_alive,
    read_segment,
)

__all__ = ["upload"]

logger = logging.getLogger(__name__)


def _segments(directory: Path) -> tuple[list[Path], list[Path]]:
    """(files to upload, oldest first; files skipped because a live process on this host writes them)."""
    host = host_name()
    todo: list[Path] = []
    live: list[Path] = []
    for name in sorted(os.listdir(directory)):
        if not (name.endswith(SEALED_SUFFIX) or name.endswith(OPEN_SUFFIX)):
            continue
        info = parse_name(name)
        if (
            info is not None
            and info["suffix"] == OPEN_SUFFIX
            and info["host"] == host
            and pid_alive(info["pid"])
        ):
            live.append(directory / name)  # still being written: leave it to its owner
            continue
        todo.append(directory / name)
    return todo, live


def upload(
    spool_dir: str | os.PathLike[str],
    server: str,
    token: str | None = None,
    *,
    request_timeout_s: float = 10.0,
    retry_deadline_s: float = 30.0,
    backoff_initial_s: float = 0.2,
    backoff_max_s: float = 10.0,
) -> dict[str, Any]:
    """Send every spooled frame of ``spool_dir`` to ``server``; returns counts (``failed``: files not fully sent).

    Corrupt or torn frames are skipped and reported by file; such a file is renamed ``*.corrupt`` once
    its good frames are sent. When the server cannot be reached (or refuses the token) the upload stops
    and leaves the remaining files for a later try.
    """
    directory = Path(spool_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"spool directory {str(directory)!r} does not exist")
    client = Client(
        server,
        token,
        request_timeout_s=request_timeout_s,
        backoff_initial_s=backoff_initial_s,
        backoff_max_s=backoff_max_s,
    )
    out: dict[str, Any] = {
        "files": 0,
        "files_done": 0,
        "frames": 0,
        "records": 0,
        "batches": 0,
        "finished_runs": 0,
        "corrupt_frames": 0,
        "dropped": {},
        "skipped_live_files": 0,
        "runs": {},
        "failed": 0,
        "errors": [],
    }
    todo, live = _segments(directory)
    out["skipped_live_files"] = len(live)
    stopped: str | None = None
    try:
        for i, path in enumerate(todo):
            out["files"] += 1
            try:
                seg = read_segment(path)
            except FileNotFoundError:
                continue  # taken by its owner meanwhile
            except OSError as e:
                out["errors"].append(f"{path}: cannot read ({e})")
                out["failed"] += 1
                continue
            bad = len(seg.corrupt)
            for offset, why in seg.corrupt:
                out["errors"].append(f"{path}: corrupt frame at byte {offset} skipped ({why})")
            for frame in seg.frames:
                try:
                    payload = frame.payload()
                except ValueError as e:
                    out["errors"].append(f"{path}: corrupt frame at byte {frame.offset} skipped ({e})")
                    bad += 1
                    continue
                res = client.deliver(
                    payload["run_info"], payload, frame.records, deadline=time.monotonic() + retry_deadline_s
                )
                out["records"] += res.sent
                out["batches"] += res.batches
                out["finished_runs"] += res.finished
                for reason, k in res.dropped.items():
                    out["dropped"][reason] = out["dropped"].get(reason, 0) + k
                if res.unsent:
                    stopped = (
                        f"{path}: server {res.reason or 'unreachable'}; upload stopped, "
                        f"{len(todo) - i} file(s) stay in the spool"
                    )
                    break
                out["frames"] += 1
                rid = client.cached_run_id(payload["run_info"])
                if rid is not None:
                    out["runs"][str(payload["run_info"].get("name"))] = rid
            out["corrupt_frames"] += bad
            if stopped:
                out["failed"] += len(todo) - i
                break
            if bad:
                dst = path.with_name(path.name + CORRUPT_SUFFIX)
                try:
                    os.replace(path, dst)
                    out["errors"].append(f"{path}: {bad} corrupt frame(s); file kept as {dst.name}")
                except OSError:
                    pass
                out["failed"] += 1
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            out["files_done"] += 1
    finally:
        client.close()
    if stopped:
        out["errors"].append(stopped)
    for msg in out["errors"]:
        logger.warning("%s", msg)
    return out
