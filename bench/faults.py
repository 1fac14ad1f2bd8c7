"""Faults under load (issue #13), each on a real ``fleetscope serve`` and real Postgres, loopback
only, bounded in count and time. Each prints sent / stored / lost / duplicated and its recovery.

    python bench/faults.py [--only overload,pg-url,pg-embedded,outage] [--outage-s 600]
                           [--overload-senders 8] [--load-ranks 512] [--pg-down-s 15]

* ``overload``: ``--overload-senders`` simulate processes send as fast as the server lets them (no
  pacing) — far beyond the sustained rate — against a server with a small backlog limit: it answers
  429/503 with ``Retry-After``, its memory stays bounded, the senders back off and lose nothing.
* ``pg-url`` / ``pg-embedded``: ``--load-ranks`` ranks at 1 step/s (``simulate --realtime``); the
  Postgres the server uses (by URL; or the server's own embedded one, restarted under it with
  pg_ctl) is stopped for ``--pg-down-s`` then started again: ingest resumes by itself (time from
  Postgres back to the first accepted probe batch), nothing lost or duplicated.
* ``outage``: the server is down for ``--outage-s`` (default 10 min) under 8 ranks at 1 step/s: the
  sender's (the agent transport's) RSS growth and its spool stay bounded, and everything is
  delivered after the server comes back.

Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

FS = [sys.executable, "-m", "fleetscope.cli"]
RESULTS: list[str] = []


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


class Server:
    def __init__(self, tmp: Path, *, url_db: str | None, data_dir: Path | None = None, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp, self.url_db, self.data_dir, self.env = tmp, url_db, data_dir, env or {}
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> None:
        db = ["--database-url", self.url_db] if self.url_db else ["--data-dir", str(self.data_dir)]
        log = open(self.tmp / f"serve-{self.port}.log", "a")  # noqa: SIM115
        self.proc = subprocess.Popen([*FS, "serve", "--port", str(self.port), *db], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "FLEETSCOPE_ALERTS_ENABLED": "false", **self.env})
        if wait:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
            raise SystemExit(f"server did not start: {(self.tmp / f'serve-{self.port}.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def rss(self) -> int:
        try:
            p = psutil.Process(self.proc.pid)  # type: ignore[union-attr]
            return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except (psutil.Error, AttributeError):
            return 0

    def rank_steps(self, name: str, token: str) -> int:
        r = httpx.get(f"{self.url}/api/v1/runs", params={"name": name}, timeout=30,
                      headers={"Authorization": f"Bearer {token}"})
        if r.status_code != 200:  # e.g. 503 while the database is away: ask again
            raise httpx.HTTPError(f"{r.status_code}")
        runs = r.json()["runs"]
        return int(runs[0]["rank_steps"]) if runs else 0

    def metric(self, name: str) -> float:
        import re

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def _token(url_db: str | None, data_dir: Path | None) -> str:
    db = ["--database-url", url_db] if url_db else ["--data-dir", str(data_dir)]
    if url_db:
        subprocess.run([*FS, "db", "upgrade", *db], check=True, capture_output=True)
    return subprocess.run([*FS, "token", "create", "--name", f"faults-{time.monotonic_ns()}", *db], check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]


def _sender(srv: Server, token: str, tmp: Path, name: str, ranks: int, steps: int, realtime: bool) -> subprocess.Popen:
    cmd = [*FS, "simulate", "--server", srv.url, "--token", token, "--run", name, "--family", "vla-7b",
           "--ranks", str(ranks), "--steps", str(steps), "--step-ms", "1000"]
    if realtime:
        cmd.append("--realtime")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "w"),  # noqa: SIM115
                            env={**os.environ, "FLEETSCOPE_SPOOL_DIR": str(tmp / f"spool-{name}")})


def _wait_stored(srv: Server, token: str, want: dict[str, int], timeout: float = 600) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            got = {n: srv.rank_steps(n, token) for n in want}
        except httpx.HTTPError:
            pass
        if got == want:
            break
        time.sleep(1)
    return got


def _report(tag: str, want: dict[str, int], got: dict[str, int], extra: str) -> None:
    sent, stored = sum(want.values()), sum(got.values())
    lost = sum(max(0, w - got.get(n, 0)) for n, w in want.items())
    dup = sum(max(0, got.get(n, 0) - w) for n, w in want.items())
    RESULTS.append(f"{tag}: sent {sent}, stored {stored}, lost {lost}, duplicated {dup}; {extra}")


def overload(tmp: Path, args: argparse.Namespace) -> None:
    from fleetscope.server.db import EmbeddedPostgres

    pg = EmbeddedPostgres(tmp / "ov")
    url_db = pg.start()
    srv = Server(tmp, url_db=url_db, env={"FLEETSCOPE_BACKLOG_MAX_ROWS": "20000", "FLEETSCOPE_INGEST_CONCURRENCY": "2",
                                          "FLEETSCOPE_INGEST_QUEUE": "4"})
    try:
        token = _token(url_db, None)
        srv.start()
        ranks, steps = 256, 150
        rss0 = srv.rss()
        t0 = time.monotonic()
        procs = [_sender(srv, token, tmp, f"ov-{i}", ranks, steps, False) for i in range(args.overload_senders)]
        peak = rss0
        while any(p.poll() is None for p in procs):
            peak = max(peak, srv.rss())
            time.sleep(0.5)
            if time.monotonic() - t0 > 1200:
                raise SystemExit("overload senders did not finish in 20 min")
        wall = time.monotonic() - t0
        want = {f"ov-{i}": ranks * steps for i in range(args.overload_senders)}
        got = _wait_stored(srv, token, want)
        refused = srv.metric("fleetscope_ingest_rejections_total")
        fails = [p.returncode for p in procs if p.returncode]
        _report("fault_overload", want, got,
                f"{refused:.0f} batches refused (429/503 + Retry-After), senders failed: {len(fails)}, "
                f"accepted {sum(want.values()) / wall:.0f} rank-steps/s offered without pacing, server RSS "
                f"{rss0 / 2**20:.0f} → peak {peak / 2**20:.0f} MiB")
    finally:
        srv.stop()
        pg.stop()


def pg_restart(tmp: Path, args: argparse.Namespace, embedded: bool) -> None:
    from fleetscope.server.db import EmbeddedPostgres

    tag = "fault_pg_restart_embedded" if embedded else "fault_pg_restart_url"
    data = tmp / ("pge" if embedded else "pgu")
    pg = EmbeddedPostgres(data)
    url_db = pg.start()
    user = pg._server.system_user  # type: ignore[union-attr]  # pg_ctl runs as the postgres user
    if embedded:  # the server owns it (started it first); the bench only restarts it underneath
        pg.owner = False
        pg.stop()
    srv = Server(tmp, url_db=None if embedded else url_db, data_dir=data if embedded else None)
    try:
        token = _token(url_db, None) if not embedded else None
        srv.start()
        if embedded:
            token = _token(None, data)
        steps = 60 + args.pg_down_s
        proc = _sender(srv, token, tmp, f"pg-{int(embedded)}", args.load_ranks, steps, True)
        time.sleep(15)
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

        pgdata = data / "pg"
        pg_ctl(["-m", "fast", "-w", "stop"], pgdata=pgdata, user=user)
        down_at = time.monotonic()
        time.sleep(args.pg_down_s)
        import pgserver

        # started again with pgserver's own options (its socket directory): the handle is cached per pgdata
        pgserver.get_server(pgdata, cleanup_mode=None).ensure_postgres_running()
        up_at = time.monotonic()
        # the first batch accepted after Postgres is back
        recovered = None
        while time.monotonic() - up_at < 120:
            try:
                r = httpx.get(f"{srv.url}/healthz", timeout=5)
                if r.status_code == 200:
                    recovered = time.monotonic() - up_at
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.wait(steps * 3 + 300)
        want = {f"pg-{int(embedded)}": args.load_ranks * steps}
        got = _wait_stored(srv, token, want)
        if proc.returncode:
            print((tmp / f"pg-{int(embedded)}.log").read_text()[-1500:], file=sys.stderr)
        _report(tag, want, got, f"Postgres down {up_at - down_at:.0f} s; server healthy again "
                                f"{recovered if recovered is None else round(recovered, 1)} s after it came back; "
                                f"sender exit {proc.returncode}")
    finally:
        srv.stop()
        if not embedded:
            pg.stop()
        else:
            try:
                from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

                pg_ctl(["-m", "fast", "-w", "stop"], pgdata=data / "pg", user=user)
            except Exception:  # noqa: BLE001 - the server's shutdown stopped it already
                pass


def outage(tmp: Path, args: argparse.Namespace) -> None:
    from fleetscope.server.db import EmbeddedPostgres

    pg = EmbeddedPostgres(tmp / "out")
    url_db = pg.start()
    srv = Server(tmp, url_db=url_db)
    try:
        token = _token(url_db, None)
        srv.start()
        steps = 30 + args.outage_s + 30
        name = "outage"
        proc = _sender(srv, token, tmp, name, 8, steps, True)
        time.sleep(30)
        rss0 = psutil.Process(proc.pid).memory_info().rss
        srv.stop()
        peak_rss, peak_spool = rss0, 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.outage_s:
            try:
                peak_rss = max(peak_rss, psutil.Process(proc.pid).memory_info().rss)
            except psutil.Error:
                break
            peak_spool = max(peak_spool, _dir_size(tmp / f"spool-{name}"))
            time.sleep(2)
        srv.start()
        back = time.monotonic()
        proc.wait(steps * 2 + 600)
        want = {name: 8 * steps}
        got = _wait_stored(srv, token, want)
        if proc.returncode:
            print((tmp / f"{name}.log").read_text()[-2500:], file=sys.stderr)
        _report("fault_server_outage", want, got,
                f"server down {args.outage_s} s; sender RSS growth {(peak_rss - rss0) / 2**20:.1f} MiB; spool peak "
                f"{peak_spool / 2**20:.1f} MiB; all delivered {time.monotonic() - back:.0f} s after restart; "
                f"sender exit {proc.returncode}")
    finally:
        srv.stop()
        pg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="overload,pg-url,pg-embedded,outage")
    ap.add_argument("--outage-s", type=int, default=600)
    ap.add_argument("--overload-senders", type=int, default=8)
    ap.add_argument("--load-ranks", type=int, default=512)
    ap.add_argument("--pg-down-s", type=int, default=15)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fs-faults-"))
    try:
        for what in args.only.split(","):
            {"overload": lambda: overload(tmp, args), "pg-url": lambda: pg_restart(tmp, args, False),
             "pg-embedded": lambda: pg_restart(tmp, args, True), "outage": lambda: outage(tmp, args)}[what]()
            print(RESULTS[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load: {os.getloadavg()}")
    for r in RESULTS:
        print(r)


if __name__ == "__main__":
    main()
