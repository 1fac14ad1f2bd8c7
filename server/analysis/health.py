"""Run health (docs/metrics.md "Run states", docs/analysis.md "Hangs and failures"): pure functions.

- :func:`stall_threshold`: how long a run may go without a finished step before it is ``stalled``:
  max(``stall_min_s``, ``stall_factor`` × p99 step time), ``stall_first_s`` before its first step.
- :func:`wavefront`: from every rank's latest position, the collective most ranks wait in (grouped by
  dimension, op and per-group sequence number) and the ranks that never arrived there: silent ranks,
  ranks not blocked in any collective, ranks whose last collective on that dimension has a lower
  sequence number. A node all of whose ranks are silent while others report is ``lost``.
- :class:`WaveSummary`: the wavefront as :func:`evaluate` needs it — counts, and bounded lists (the first
  ranks and runs of ranks, nodes, a few stacks) — whatever the world size. :func:`summarize` builds it
  from loaded positions; ``store.health.wave_summary`` computes the same thing in SQL (the server's
  path: it never loads every rank's row).
- :func:`is_peer_error`, :class:`SilentNodes`: a failure whose first record is a rank losing its
  connection to a peer, while some node said nothing at all (no failure record, its own or its
  launcher's; no live position), is that node's loss: once :func:`settle_s` has passed since the
  failure, ``evaluate`` names the node lost as the cause (``Verdict.cause`` "node_lost"); before, the
  failure stands and is re-assessed (``Verdict.settle_until``).
- :func:`evaluate`: the state machine: ``failed`` (a failure record, or finished as failed) >
  ``finished`` > paused/``running`` > ``hung`` (stalled, and the positions show who waits for whom) >
  ``stalled``; with the finding sentence.
- :func:`rank_ranges`: "1536–1543, 1600" for a rank list.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["HealthParams", "Verdict", "Wavefront", "WaveSummary", "RankSet", "stall_threshold", "wavefront",
           "summarize", "evaluate", "rank_ranges", "duration", "root_cause", "open_pause", "HEALTH_STATES",
           "PositionLike", "FailureLike", "PauseLike", "redone_steps", "goodput_split", "pause_category",
           "RANGES_SHOWN", "SilentNodes", "is_peer_error", "settle_s", "PEER_LOST_MARKS"]

HEALTH_STATES = ("running", "stalled", "hung", "failed", "finished")


class PositionLike(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def ts(self) -> float | None: ...
    @property
    def step(self) -> int | None: ...
    @property
    def state(self) -> str | None: ...
    @property
    def phase(self) -> str | None: ...
    @property
    def open_s(self) -> float | None: ...
    @property
    def op(self) -> str | None: ...
    @property
    def dim(self) -> str | None: ...
    @property
    def group(self) -> str | None: ...
    @property
    def seq(self) -> int | None: ...
    @property
    def done(self) -> bool | None: ...
    @property
    def stack(self) -> list[dict[str, Any]] | None: ...
    @property
    def age_s(self) -> float: ...


class FailureLike(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def ts(self) -> float | None: ...
    @property
    def step(self) -> int | None: ...
    @property
    def exception(self) -> str | None: ...
    @property
    def message(self) -> str | None: ...
    @property
    def frames(self) -> list[dict[str, Any]] | None: ...
    @property
    def phase(self) -> str | None: ...
    @property
    def signal(self) -> str | None: ...
    @property
    def exit_code(self) -> int | None: ...


class PauseLike(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def open_since(self) -> float | None: ...
    @property
    def expected_s(self) -> float | None: ...


@dataclass(frozen=True)
class HealthParams:
    stall_min_s: float = 60.0
    stall_factor: float = 10.0
    stall_first_s: float = 600.0
    silence_s: float = 30.0  # a rank whose latest position is older than this is silent
    pause_max_s: float = 1800.0  # a declared pause holds off the stall detector at most max(2 × expected, this)
    max_listed: int = 1024
    max_stacks: int = 16


def stall_threshold(p: HealthParams, steps: int, p99_step_s: float | None) -> float:
    if steps <= 0:
        return max(p.stall_first_s, p.stall_min_s)
    return max(p.stall_min_s, p.stall_factor * (p99_step_s or 0.0))


#: runs of consecutive ranks a finding names ("1536–1543, 1600 and 12 more ranges")
RANGES_SHOWN = 12


def _runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    rs = sorted(set(int(r) for r in ranks))
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append((rs[i], rs[j]))
        i = j + 1
    return out


def _ranges_text(runs: Sequence[tuple[int, int]], total: int, limit: int) -> str:
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs[:limit]]
    if total > limit:
        rest = total - limit
        return ", ".join(parts) + f" and {rest} more range{'s' if rest > 1 else ''}"
    return ", ".join(parts)


def rank_ranges(ranks: Sequence[int], limit: int = RANGES_SHOWN) -> str:
    """"1536–1543, 1600" (at most ``limit`` runs of consecutive ranks, then "and n more")."""
    runs = _runs(ranks)
    return _ranges_text(runs, len(runs), limit)


@dataclass
class RankSet:
    """A set of ranks of any size, bounded: how many, the first ``listed`` (ascending), the first runs of
    consecutive ranks and how many runs there are — enough to name them as :func:`rank_ranges` does."""

    count: int = 0
    listed: list[int] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    run_count: int = 0

    @classmethod
    def of(cls, ranks: Sequence[int], max_listed: int, max_runs: int = RANGES_SHOWN) -> RankSet:
        rs = sorted(set(int(r) for r in ranks))
        runs = _runs(rs)
        return cls(len(rs), rs[:max_listed], runs[:max_runs], len(runs))

    def text(self, limit: int = RANGES_SHOWN) -> str:
        return _ranges_text(self.runs, self.run_count, limit)


def duration(s: float) -> str:
    s = max(float(s), 0.0)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _frame(f: Mapping[str, Any] | None) -> str | None:
    if not f:
        return None
    file = os.path.basename(str(f.get("file") or "?"))
    return f"{file}:{f.get('line')} {f.get('func') or '?'}"


@dataclass
class Wavefront:
    waiting: dict[str, Any] | None = None  # {"op", "dim", "group", "seq", "ranks"}
    missing: list[int] = field(default_factory=list)
    lost_nodes: list[str] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    step: int | None = None


def wavefront(positions: Sequence[PositionLike], world_size: int, nodes: Mapping[int, str],
              silence_s: float) -> Wavefront:
    """Who waits for whom, from the ranks' latest positions (see the module doc)."""
    out = Wavefront()
    if not positions:
        return out
    by_rank = {p.rank: p for p in positions if 0 <= p.rank < world_size}
    live = {r: p for r, p in by_rank.items() if p.age_s <= silence_s}
    silent = sorted(set(range(world_size)) - set(live))
    out.silent = silent
    if not live:
        return out
    blocked = [p for p in live.values() if p.op is not None and p.done is False]
    steps = Counter(p.step for p in live.values() if p.step is not None)
    out.step = steps.most_common(1)[0][0] if steps else None
    # nodes all of whose known ranks are silent while others report
    if nodes:
        members: dict[str, list[int]] = {}
        for r, n in nodes.items():
            if 0 <= r < world_size:
                members.setdefault(n, []).append(r)
        silent_set = set(silent)
        out.lost_nodes = sorted(n for n, rs in members.items() if rs and all(r in silent_set for r in rs))
    if blocked:
        # a collective is named by its dimension, else (no DeviceMesh dimension) by its process group
        def where(p: PositionLike) -> tuple[str | None, str | None]:
            return (p.dim, None) if p.dim else (None, p.group)

        key_count = Counter((*where(p), p.op, p.seq) for p in blocked)
        (dim, group, op, seq), n_wait = key_count.most_common(1)[0]
        out.waiting = {"op": op, "dim": dim, "group": group, "seq": seq, "ranks": n_wait}
        missing = []
        for r in range(world_size):
            p = live.get(r)
            if p is None:
                missing.append(r)
                continue
            same = where(p) == (dim, group) and seq is not None and p.seq is not None
            if p.op is not None and p.done is False:
                if same and p.seq is not None and seq is not None and p.seq < seq:
                    missing.append(r)  # blocked in an earlier collective of the same dimension: behind
                continue  # waiting somewhere: a victim, not the cause
            if same and p.op is not None and p.seq is not None and seq is not None and p.seq >= seq:
                continue  # already past it
            missing.append(r)  # not blocked in any collective: computing, loading data, or stuck there
        out.missing = missing
    else:
        out.missing = silent if len(silent) < world_size else []
    return out


@dataclass
class WaveSummary:
    """The wavefront of a run as :func:`evaluate` uses it, bounded whatever the world size: counts, the
    first ranks (``RankSet``), the first nodes (sorted by code point), the stacks of the first missing
    ranks and the first missing rank's own position. Built by :func:`summarize` from loaded positions, or
    in SQL by ``store.health.wave_summary``; both give the same summary for the same positions."""

    positions: int = 0  # position rows the run has (any rank)
    live: int = 0  # ranks in [0, world) whose position is at most ``silence_s`` old
    silent: int = 0  # ranks in [0, world) without one (0 when the run has no position at all)
    step: int | None = None  # the step most live ranks are in
    waiting: dict[str, Any] | None = None  # {"op", "dim", "group", "seq", "ranks"}
    missing: RankSet = field(default_factory=RankSet)
    missing_nodes: list[str] = field(default_factory=list)
    missing_node_count: int = 0
    lost_nodes: list[str] = field(default_factory=list)
    lost_node_count: int = 0
    lost: RankSet = field(default_factory=RankSet)  # every rank of the lost nodes
    stacks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # of the first missing ranks
    first: PositionLike | None = None  # the first missing rank's position (None: it never reported)


def summarize(positions: Sequence[PositionLike], world_size: int, nodes: Mapping[int, str], silence_s: float, *,
              max_listed: int = 1024, max_stacks: int = 16) -> WaveSummary:
    """:class:`WaveSummary` from loaded positions (:func:`wavefront`, then bounded)."""
    wf = wavefront(positions, world_size, nodes, silence_s)
    by_rank = {p.rank: p for p in positions}
    live = sum(1 for r, p in by_rank.items() if 0 <= r < world_size and p.age_s <= silence_s)
    out = WaveSummary(positions=len(positions), live=live, silent=len(wf.silent), step=wf.step, waiting=wf.waiting)
    out.missing = RankSet.of(wf.missing, max_listed)
    miss_nodes = sorted({nodes[r] for r in wf.missing if r in nodes})
    out.missing_nodes, out.missing_node_count = miss_nodes[:max_listed], len(miss_nodes)
    out.lost_nodes, out.lost_node_count = wf.lost_nodes[:max_listed], len(wf.lost_nodes)
    lost = set(wf.lost_nodes)
    out.lost = RankSet.of([r for r, n in nodes.items() if n in lost], max_listed)
    for r in wf.missing[:max_stacks]:
        p = by_rank.get(r)
        if p is not None and p.stack:
            out.stacks[r] = p.stack
    out.first = by_rank.get(wf.missing[0]) if wf.missing else None
    return out


#: what a rank's error says when a peer it talked to went away: a consequence of that peer's end, not a
#: cause of its own (gloo: "Connection closed by peer", "Connection reset by peer"; NCCL: "remote process
#: exited or there was a network error"; torch's stores: "Broken pipe", "Connection refused" …)
PEER_LOST_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                   "remote process exited", "socket closed", "peer closed", "connection was closed",
                   "recvbytes", "sendbytes", "failed to recv", "failed to send", "end of file")
#: exceptions that are about the job's connections, whatever their message says
PEER_LOST_EXCEPTIONS = ("DistNetworkError", "DistStoreError", "ConnectionResetError", "BrokenPipeError",
                        "ConnectionRefusedError", "ConnectionAbortedError")


def is_peer_error(f: FailureLike) -> bool:
    """Whether the failure is a rank losing its connection to a peer (or to the job's store): what a
    node that died causes on every other node."""
    if f.exception in PEER_LOST_EXCEPTIONS:
        return True
    text = f"{f.exception or ''}: {f.message or ''}".lower()
    return any(m in text for m in PEER_LOST_MARKS)


@dataclass
class SilentNodes:
    """The ranks of a failed run that never said why they stopped, by node: ``nodes`` — nodes (first
    ``max_listed``, by code point) none of whose ranks sent a failure record (their own, or their
    launcher's) nor a position in the last ``silence_s``; ``ranks`` — every rank of those nodes;
    ``by_node`` — the first nodes with their first ranks; ``unreported`` — ranks in [0, world) the server
    never heard of at all (no registration, no failure: their node unknown, unless a launcher named it)."""

    nodes: list[str] = field(default_factory=list)
    count: int = 0
    ranks: RankSet = field(default_factory=RankSet)
    by_node: list[dict[str, Any]] = field(default_factory=list)  # [{"node", "ranks", "rank_count"}]
    unreported: RankSet = field(default_factory=RankSet)
    #: False: not looked at yet (a big run while its failure settles: the nodes are read once, at the end)
    checked: bool = True


def root_cause(failures: Sequence[FailureLike]) -> FailureLike | None:
    """The first real failure by time (a clean exit, code 0 without exception or signal, is none)."""
    real = [f for f in failures if not (f.exit_code == 0 and not f.exception and not f.signal)]
    if not real:
        return None
    return min(real, key=lambda f: (f.ts is None, f.ts or 0.0))


def _failure_sentence(name: str, f: FailureLike, n_other: int, nodes: Mapping[int, str], *,
                      message: bool = True) -> str:
    """The failure finding; without ``message`` (what goes to alerts and Slack) the exception's message,
    which may hold secrets, stays in the run's record only."""
    node = f" (node {nodes[f.rank]})" if f.rank in nodes else ""
    at = f" at step {f.step}" if f.step is not None else ""
    if f.exception:
        what = f"rank {f.rank}{node} raised {f.exception}" + (f": {f.message}" if f.message and message else "")
        where = _frame(f.frames[-1] if f.frames else None)
        if where:
            what += f" in `{where}`"
    elif f.signal:
        what = f"rank {f.rank}{node} was killed by {f.signal}"
    elif f.exit_code is not None:
        what = f"rank {f.rank}{node} exited with code {f.exit_code}"
    else:
        what = f"rank {f.rank}{node} failed ({f.source})" + (f": {f.message}" if f.message and message else "")
    if f.phase:
        what += f" during {f.phase}"
    tail = f"; {n_other:,} other rank{'s' if n_other != 1 else ''} failed after it" if n_other else ""
    return f"run {name} failed{at}: {what}{tail}"


@dataclass
class Verdict:
    state: str
    since: float | None = None
    finding: str | None = None
    kind: str | None = None  # alert kind: hang, node_lost, failure
    waiting: dict[str, Any] | None = None
    missing_ranks: list[int] = field(default_factory=list)
    missing_count: int = 0
    missing_nodes: list[str] = field(default_factory=list)
    missing_nodes_count: int = 0  # all of them (``missing_nodes`` lists the first ``max_listed``)
    collective: dict[str, Any] | None = None
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stuck: dict[str, Any] | None = None  # the first missing rank's own position
    pause: dict[str, Any] | None = None
    threshold_s: float | None = None
    step: int | None = None
    alert_finding: str | None = None  # the finding as alerts carry it (None: the same)
    #: what ended the run: "failure" (a rank's own failure), "node_lost" (a node stopped without a word
    #: and the others' errors are about losing it), "hang" (stalled or hung); None while it runs
    cause: str | None = None
    lost_nodes: list[dict[str, Any]] = field(default_factory=list)  # [{"node", "ranks", "rank_count"}]
    #: a failure whose cause may still be a node that has not reported yet: re-assessed until this time
    #: (unix time), its alert held until then
    settle_until: float | None = None

    def detail(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "missing_ranks": self.missing_ranks, "missing_count": self.missing_count,
                "missing_nodes": self.missing_nodes, "missing_nodes_count": self.missing_nodes_count,
                "collective": self.collective, "stacks": self.stacks,
                "stuck": self.stuck, "pause": self.pause, "threshold_s": self.threshold_s, "kind": self.kind,
                "step": self.step, "cause": self.cause, "lost_nodes": self.lost_nodes,
                "settle_until": self.settle_until}


def settle_s(p: HealthParams) -> float:
    """How long after a failure that blames a peer the pass waits for every node to report, before it
    calls the nodes that said nothing lost: the silence threshold plus a margin for the last sends."""
    return p.silence_s + 2.0


def _node_lost(v: Verdict, name: str, first: FailureLike, n_failed_ranks: int, nodes: Mapping[int, str],
               silent: SilentNodes, now: float, p: HealthParams) -> None:
    """The failure's first record is a rank losing a peer, and some nodes said nothing at all: once they
    had time to (:func:`settle_s` after it), they are the root cause — lost — and the errors are what
    followed. Before that the failure stands as found, re-assessed (``settle_until``)."""
    t0 = first.ts if first.ts is not None else now
    if now - t0 < settle_s(p):
        v.settle_until = t0 + settle_s(p)
        return
    if not silent.checked:
        return
    v.cause = "node_lost"
    lost, unrep = silent.ranks, silent.unreported
    v.missing_nodes = silent.nodes[:p.max_listed]
    v.missing_nodes_count = silent.count
    v.missing_ranks = sorted({*lost.listed, *unrep.listed})[:p.max_listed]
    v.missing_count = lost.count + unrep.count
    v.lost_nodes = [dict(n) for n in silent.by_node]
    if unrep.count:
        v.lost_nodes.append({"node": None, "ranks": unrep.listed[:64], "rank_count": unrep.count})
    parts = []
    if silent.count:
        n = silent.count
        nn = ", ".join(silent.nodes[:8]) + (f" and {n - 8} more" if n > 8 else "")
        whose = "its" if n == 1 else "their"
        ranks = (f"rank {lost.text()}" if lost.count == 1 else f"{lost.count:,} ranks ({lost.text()})")
        parts.append(f"node{'s' if n > 1 else ''} {nn} lost — {whose} {ranks} stopped with no failure or exit "
                     f"reported")
    if unrep.count:
        parts.append(f"rank{'s' if unrep.count > 1 else ''} {unrep.text()} (node unknown) never reported")
    at = f" at step {first.step}" if first.step is not None else ""
    node = f" (node {nodes[first.rank]})" if first.rank in nodes else ""
    what = first.exception or (f"signal {first.signal}" if first.signal else None) or (
        f"exit code {first.exit_code}" if first.exit_code is not None else first.source)
    others = max(n_failed_ranks - 1, 0)
    tail = f", {others:,} other rank{'s' if others != 1 else ''} after it" if others else ""
    v.finding = v.alert_finding = (
        f"run {name} failed{at}: {'; '.join(parts)}; then rank {first.rank}{node} lost its connection to it "
        f"({what}){tail}")


def open_pause(pauses: Sequence[PauseLike], now: float, p: HealthParams) -> dict[str, Any] | None:
    """The declared pause holding the run now (the latest begun, within its bound), else None."""
    best = None
    for q in pauses:
        if q.open_since is None:
            continue
        bound = max(2.0 * (q.expected_s or 0.0), p.pause_max_s)
        if now - q.open_since <= bound and (best is None or q.open_since > (best.open_since or 0.0)):
            best = q
    if best is None:
        return None
    return {"reason": best.reason, "since": best.open_since, "expected_s": best.expected_s,
            "ranks": sum(1 for q in pauses if q.open_since is not None and q.reason == best.reason)}


def evaluate(*, name: str, status: str, world_size: int, steps: int, current_step: int | None, now: float,
             progress_at: float, p99_step_s: float | None, failures: Sequence[FailureLike], n_failed_ranks: int,
             finished_at: float | None, pauses: Sequence[PauseLike], positions: Sequence[PositionLike] | None,
             nodes: Mapping[int, str], params: HealthParams, last_pause_end: float | None = None,
             wave: WaveSummary | None = None, pause: dict[str, Any] | None = None,
             silent: SilentNodes | None = None) -> Verdict:
    """The run's state now (see the module doc). The wavefront comes from ``wave`` (computed in SQL), else
    from ``positions`` (loaded; None and no ``wave``: not analysed — the run is not stalled, or its analysis
    did not fit its budget). ``nodes``: {rank: node} of the failed ranks at least (the failure finding
    names the root cause's node), of every rank when the wavefront comes from ``positions``.
    ``pause``: the open declared pause found by the store (else found in ``pauses``).
    ``last_pause_end``: when the latest declared pause ended — the clock of the stall restarts there (the
    first step after a long checkpoint is not late)."""
    first = root_cause(failures)
    if first is not None:
        v = Verdict("failed", since=first.ts or finished_at or now, kind="failure", step=first.step, cause="failure")
        v.finding = _failure_sentence(name, first, max(n_failed_ranks - 1, 0), nodes)
        v.alert_finding = _failure_sentence(name, first, max(n_failed_ranks - 1, 0), nodes, message=False)
        if silent is not None and is_peer_error(first) and (
                not silent.checked or silent.count or silent.unreported.count):
            _node_lost(v, name, first, n_failed_ranks, nodes, silent, now, params)
        return v
    if status == "failed":
        return Verdict("failed", since=finished_at, finding=f"run {name} was marked failed")
    if status in ("finished", "aborted"):
        return Verdict("finished", since=finished_at)
    threshold = stall_threshold(params, steps, p99_step_s)
    if pause is None:
        pause = open_pause(pauses, now, params)
    if pause is not None:
        return Verdict("running", since=pause["since"], pause=pause, threshold_s=threshold,
                       finding=f"run {name} is paused for {pause['reason']} since {duration(now - pause['since'])}")
    if last_pause_end is not None and last_pause_end > progress_at:
        progress_at = last_pause_end
    age = now - progress_at
    if age < threshold:
        return Verdict("running", threshold_s=threshold)
    at_step = (current_step + 1) if current_step is not None else 0
    v = Verdict("stalled", since=progress_at, kind="hang", threshold_s=threshold, step=at_step)
    wf = wave if wave is not None else summarize(positions or [], world_size, nodes, params.silence_s,
                                                 max_listed=params.max_listed, max_stacks=params.max_stacks)
    if wf.step is not None:
        v.step = at_step = wf.step
    waited = f"no step finished for {duration(age)} (threshold {duration(threshold)})"
    if wf.lost_node_count and wf.silent < world_size:
        v.state, v.kind = "hung", "node_lost"
        v.missing_nodes = wf.lost_nodes[:params.max_listed]
        v.missing_nodes_count = wf.lost_node_count
        v.missing_ranks = wf.lost.listed[:params.max_listed]
        v.missing_count = wf.lost.count
        others = world_size - wf.silent
        n_lost = wf.lost_node_count
        nn = ", ".join(wf.lost_nodes[:8]) + (f" and {n_lost - 8} more" if n_lost > 8 else "")
        v.finding = (f"run {name} stalled at step {at_step}: node{'s' if n_lost > 1 else ''} {nn} lost — "
                     f"all {wf.lost.count:,} of its ranks ({wf.lost.text()}) went silent while "
                     f"{others:,} others report; {waited}")
        if wf.waiting:
            v.waiting = wf.waiting
            v.collective = {k: wf.waiting[k] for k in ("op", "dim", "seq")}
        return v
    n_miss = wf.missing.count
    if wf.waiting and n_miss and n_miss < world_size:
        v.state = "hung"
        v.waiting = wf.waiting
        v.collective = {k: wf.waiting[k] for k in ("op", "dim", "seq")}
        v.missing_ranks = wf.missing.listed[:params.max_listed]
        v.missing_count = n_miss
        miss_nodes = wf.missing_nodes
        v.missing_nodes = miss_nodes[:params.max_listed]
        v.missing_nodes_count = wf.missing_node_count
        for r, stack in list(wf.stacks.items())[:params.max_stacks]:
            v.stacks[str(r)] = stack
        p0 = wf.first
        stuck_where = None
        stuck_for = age
        if p0 is not None:
            stuck_where = _frame(p0.stack[-1] if p0.stack else None)
            if p0.open_s is not None and p0.ts is not None and p0.state == "in_step":
                stuck_for = p0.open_s + p0.age_s
            v.stuck = {"rank": p0.rank, "state": p0.state, "phase": p0.phase, "step": p0.step, "open_s": p0.open_s,
                       "op": p0.op, "dim": p0.dim, "seq": p0.seq, "silent": p0.age_s > params.silence_s,
                       "for_s": stuck_for}
        w = wf.waiting
        on = f" on dim {w['dim']}" if w.get("dim") else (f" of group {w['group']}" if w.get("group") else "")
        seq = f" #{w['seq']}" if w.get("seq") is not None else ""
        nodes_txt = ""
        n_nodes = wf.missing_node_count
        if n_nodes:
            nodes_txt = f" (node{'s' if n_nodes > 1 else ''} {', '.join(miss_nodes[:8])}" + (
                f" and {n_nodes - 8} more" if n_nodes > 8 else "") + ")"
        who = f"rank{'s' if n_miss > 1 else ''} {wf.missing.text()}{nodes_txt} never arrived"
        if p0 is None or p0.age_s > params.silence_s:
            how = f" — silent for {duration(stuck_for)}"
        elif stuck_where:
            how = f" — stuck in `{stuck_where}` for {duration(stuck_for)}"
        elif p0.phase:
            how = f" — stuck in {p0.phase} for {duration(stuck_for)}"
        else:
            how = f" — for {duration(stuck_for)}"
        v.finding = (f"run {name} hung at step {at_step}: {w['ranks']:,} of {world_size:,} ranks wait in "
                     f"{w['op']}{seq}{on}; {who}{how}")
        return v
    if wf.positions and wf.silent >= world_size:
        v.finding = f"run {name} stalled at step {at_step}: every rank went silent; {waited}"
    else:
        v.finding = f"run {name} stalled at step {at_step}: {waited}"
    return v


# ------------------------------------------------------------------------------------------ goodput


def pause_category(reason: str) -> str:
    r = reason.lower()
    if r.startswith("checkpoint") or r.startswith("ckpt") or r in ("save", "load"):
        return "checkpoint"
    if r.startswith("eval"):
        return "eval"
    return "pause"


def redone_steps(prev_last_step: int | None, steps_of_attempt: int, first_step: int | None,
                 last_step: int | None) -> int:
    """Steps of an attempt whose index is ≤ the previous attempt's last step (redone after the restore),
    estimated from the attempt's first and last step index and its step count."""
    if prev_last_step is None or first_step is None or last_step is None or first_step > prev_last_step:
        return 0
    return max(0, min(prev_last_step, last_step) - first_step + 1) if steps_of_attempt else 0


def goodput_split(*, wall_s: float, step_s: float, data_s: float, init_s: float, pause_s: Mapping[str, float],
                  hang_s: float, failure_s: float, redone_s: float) -> dict[str, Any]:
    """``{"wall_s", "productive_s", "fraction", "lost": {category: s}}``: productive = step time of steps not
    redone minus their data stalls; ``lost`` holds init, checkpoint, eval, other pauses, data stalls,
    hang, failure (time from the failure to the run's end) and redone steps, plus ``other`` (the rest of
    the wall time: gaps between steps) — so productive + Σ lost = wall (``other`` never negative)."""
    productive = max(step_s - redone_s - data_s, 0.0)
    lost: dict[str, float] = {"init": max(init_s, 0.0), "checkpoint": 0.0, "eval": 0.0, "pause": 0.0,
                              "data_stall": max(data_s, 0.0), "hang": max(hang_s, 0.0),
                              "failure": max(failure_s, 0.0), "redone_steps": max(redone_s, 0.0)}
    for reason, s in pause_s.items():
        lost[pause_category(reason)] += max(float(s), 0.0)
    wall = max(wall_s, productive + sum(lost.values()))
    lost["other"] = max(wall - productive - sum(lost.values()), 0.0)
    return {"wall_s": wall, "productive_s": productive, "fraction": productive / wall if wall > 0 else None,
            "lost": lost}
