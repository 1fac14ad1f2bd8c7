"""Run filters, sorting, grouping and paging in SQL — the one query behind ``GET /api/v1/runs`` and the
runs table page (``/runs-table``).

A query is a list of (field, operator, value) filters, a sort, an offset/limit page, and optionally one
or two group keys. Fields:

- ``config.KEY`` / ``meta.KEY`` (a dotted KEY reaches into nested objects): the run's JSONB config or
  meta. ``=`` matches the value as JSON (``4`` matches 4 and 4.0 and the string "4"; ``true``;
  ``"x"`` or plain ``x``: a string), ``!=`` is its negation (a run without the key is "not equal"),
  ``<``/``>``/``<=``/``>=`` compare numbers (a value that is not a number: text comparison), ``in``
  any of a comma-separated list.
- ``tag`` (the run's ``meta.tags``), ``commit`` (a prefix of ``git_commit``), ``name``, ``family``,
  ``status``, ``device_type``, ``world_size``, ``job_id``; ``since``/``until`` (``started_at``, ISO 8601
  or unix seconds).
- figures: ``mfu``, ``hfu``, ``step_s``, ``step_s_p95``, ``tokens_per_s``, ``tokens_per_s_per_gpu``,
  ``data_s``, ``compute_s``, ``comm_exposed_s``, ``straggler_wait_s``, ``mem_peak_bytes`` — as last
  computed (``run_stats``; :func:`stale_figure_runs` lists runs whose figures are due).
- training scalars: ``scalar.NAME.last`` (the value at the run's last logged step) and
  ``scalar.NAME.min``.

Every value is a bound parameter; field names are checked against these forms (a JSON key is passed
as a parameter, never spliced). :class:`QueryError` names the bad parameter (the API's 422).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

from .rows import RunRow
from .runs import _COLS, _row, _snapshot, _with_pending

__all__ = ["Filter", "RunQuery", "QueryError", "parse_query", "query_runs", "group_runs", "stale_figure_runs",
           "FIGURES", "OPERATORS", "MAX_GROUPS", "MAX_FILTERS", "MAX_VALUES", "MAX_SCALARS", "MAX_SORT_KEYS",
           "MAX_COLUMNS", "key_options", "parse_clauses", "check_columns"]

OPERATORS = ("=", "!=", "<", ">", "<=", ">=", "in")
_PREFIX_OPS = {"eq": "=", "ne": "!=", "lt": "<", "gt": ">", "le": "<=", "ge": ">=", "in": "in"}
#: figures a run's ``run_stats`` holds that filters, sorting and grouping may use
FIGURES = ("mfu", "hfu", "step_s", "step_s_p95", "tokens_per_s", "tokens_per_s_per_gpu", "data_s", "compute_s",
           "comm_exposed_s", "other_s", "straggler_wait_s", "mem_peak_bytes", "step_s_per_1k_tokens")
#: plain run columns: parameter -> SQL column
_COLUMNS = {"id": "r.id", "name": "r.name", "family": "r.model_family", "model_family": "r.model_family",
            "status": "r.status", "device_type": "r.device_type", "world_size": "r.world_size", "job_id": "r.job_id",
            "steps": "r.steps", "started_at": "r.started_at", "finished_at": "r.finished_at", "commit": "r.git_commit"}
_NUMERIC_COLUMNS = {"id", "world_size", "steps"}
_TIME_COLUMNS = {"started_at", "finished_at"}
_AGGS = (("mfu", "mfu"), ("tokens_per_s_per_gpu", "tokens_per_s_per_gpu"), ("step_s", "step_s"))
#: what a grouped query sorts by besides its keys
GROUP_SORTS = ("count", *(f"median_{a}" for a, _ in _AGGS))
#: groups one grouped query returns at most; filters one query may hold
MAX_GROUPS = 1_000
MAX_FILTERS = 32
#: what one query may ask for at most (a 422 naming the cap): every filter's values together, distinct
#: training scalars (filters, sorts and columns together), sort keys, extra columns
MAX_VALUES = 512
MAX_SCALARS = 8
MAX_SORT_KEYS = 8
MAX_COLUMNS = 64
#: unix seconds accepted as times: 1970 .. 9999-12-31
_MAX_UNIX_S = 253_402_300_799.0
_KEY = re.compile(r"^[^\x00-\x1f]{1,128}$")
_SCALAR = re.compile(r"^scalar\.(.{1,128})\.(last|min)$")
_RESERVED = {"sort", "offset", "limit", "group_by", "figures", "columns"}


class QueryError(ValueError):
    """A filter, sort or group that cannot be run: ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


@dataclass(frozen=True)
class Filter:
    field: str
    op: str
    value: str | list[str]


@dataclass
class RunQuery:
    filters: list[Filter] = field(default_factory=list)
    sort: list[tuple[str, bool]] = field(default_factory=list)  # (field, descending)
    offset: int = 0
    limit: int = 100
    group_by: list[str] = field(default_factory=list)
    #: the owner namespaces (``runs.owner_key``) the reader sees; None: every run (reports/scope.py)
    owners: frozenset[str] | None = None


def _split_param(key: str, value: str) -> tuple[str, str, str]:
    """(field, operator, value) of one query parameter: ``k=v``, ``k!=v``, ``k>=v``, ``k<=v`` (the URL
    parser splits those at their ``=``), ``k>v`` / ``k<v`` (no ``=``: the whole pair is the key), or
    ``k=op:v`` with op in eq, ne, lt, gt, le, ge, in."""
    if value == "" and ("<" in key or ">" in key):
        m = re.match(r"^(.*?)([<>])(.*)$", key, re.S)
        assert m
        return m.group(1), m.group(2), m.group(3)
    if key.endswith("!"):
        return key[:-1], "!=", value
    if key.endswith(">") or key.endswith("<"):
        return key[:-1], key[-1] + "=", value
    m = re.match(r"^(eq|ne|lt|gt|le|ge|in):(.*)$", value, re.S)
    if m:
        return key, _PREFIX_OPS[m.group(1)], m.group(2)
    return key, "=", value


def _check_field(name: str, param: str) -> None:
    if name in _COLUMNS or name in FIGURES or name in ("tag", "since", "until"):
        return
    if name.startswith(("config.", "meta.")):
        key = name.split(".", 1)[1]
        if not key or not _KEY.match(key) or any(not p for p in key.split(".")):
            raise QueryError(param, f"bad key {key!r}: 1..128 characters, dot-separated, no empty part")
        return
    if _SCALAR.match(name):
        return
    raise QueryError(param, f"unknown field {name!r}: use config.KEY, meta.KEY, tag, commit, since, until, name, "
                            f"family, status, device_type, world_size, job_id, a figure ({', '.join(FIGURES)}) or "
                            "scalar.NAME.last / scalar.NAME.min")


def parse_query(items: Iterable[tuple[str, str]], *, default_limit: int = 100, max_limit: int = 10_000) -> RunQuery:
    """A query from URL parameters (name, value) in order; unknown parameters are refused (QueryError)."""
    q = RunQuery(limit=default_limit)
    for key, value in items:
        if key == "sort":
            for part in (p.strip() for p in value.split(",")):
                if not part:
                    continue
                desc = part.startswith("-")
                name = part.lstrip("-+")
                if name not in GROUP_SORTS:
                    _check_field(name, "sort")
                if name in ("tag", "since", "until"):
                    raise QueryError("sort", f"cannot sort by {name!r}")
                if len(q.sort) >= MAX_SORT_KEYS:
                    raise QueryError("sort", f"at most {MAX_SORT_KEYS} sort keys")
                q.sort.append((name, desc))
            continue
        if key in ("offset", "limit"):
            try:
                n = int(value)
            except ValueError:
                raise QueryError(key, f"must be an integer, got {value[:32]!r}") from None
            hi = 10**9 if key == "offset" else max_limit
            lo = 0 if key == "offset" else 1
            if not lo <= n <= hi:
                raise QueryError(key, f"must be in {lo}..{hi}")
            setattr(q, key, n)
            continue
        if key == "group_by":
            keys = [k.strip() for k in value.split(",") if k.strip()]
            if not 1 <= len(keys) <= 2:
                raise QueryError("group_by", "one or two keys, comma-separated")
            for k in keys:
                _check_field(k, "group_by")
                if k in ("tag", "since", "until") or k in FIGURES or _SCALAR.match(k):
                    raise QueryError("group_by", f"cannot group by {k!r} (a config/meta key or a run column)")
            q.group_by = keys
            continue
        if key in _RESERVED:
            continue
        name, op, val = _split_param(key, value)
        _check_field(name, key)
        if len(q.filters) >= MAX_FILTERS:
            raise QueryError(key, f"more than {MAX_FILTERS} filters (the cap per request)")
        if name in ("since", "until") and op != "=":
            raise QueryError(key, f"{name} takes a time: {name}=2026-01-31T00:00 or unix seconds")
        if op == "in":
            parts = [p for p in val.split(",")]
            if not parts or len(parts) > 256:
                raise QueryError(key, "in: takes 1..256 comma-separated values")
            q.filters.append(Filter(name, op, parts))
        else:
            q.filters.append(Filter(name, op, val))
        if name in ("since", "until"):
            _time(val, key)  # out of range or malformed: the 422 now, before any SQL
        if sum(len(f.value) if isinstance(f.value, list) else 1 for f in q.filters) > MAX_VALUES:
            raise QueryError(key, f"more than {MAX_VALUES} filter values in all (the cap per request)")
    _check_scalars([f.field for f in q.filters] + [n for n, _d in q.sort], "scalar")
    return q


def _check_scalars(fields: Iterable[str], param: str) -> None:
    names = {m.group(1) for m in (_SCALAR.match(f) for f in fields) if m}
    if len(names) > MAX_SCALARS:
        raise QueryError(param, f"{len(names)} training scalars in one request; at most {MAX_SCALARS} (filters, sorts "
                                "and columns together)")


def check_columns(columns: Sequence[str], q: RunQuery | None = None) -> list[str]:
    """The extra columns of a request, checked: known fields, at most MAX_COLUMNS, and at most MAX_SCALARS
    training scalars together with the query's own. QueryError (param ``columns``) otherwise."""
    cols = list(dict.fromkeys(c for c in columns if c))
    if len(cols) > MAX_COLUMNS:
        raise QueryError("columns", f"{len(cols)} columns; at most {MAX_COLUMNS} per request")
    for c in cols:
        _check_field(c, "columns")
    extra = [f.field for f in q.filters] + [n for n, _d in q.sort] if q is not None else []
    _check_scalars([*cols, *extra], "columns")
    return cols


_OP_PREFIX = {v: k for k, v in _PREFIX_OPS.items()}
_CLAUSE = re.compile(r"^([^=<>!\s]+)(!=|>=|<=|=|<|>)(.*)$", re.S)


def parse_clauses(textual: str) -> list[tuple[str, str]]:
    """URL-style parameters from a filter line of space-separated clauses (the runs table's filter box):
    ``config.tp=4 config.lr>0.001 tag=x config.seq_len=in:2048,4096``. Raises QueryError naming a clause
    that has no operator."""
    out: list[tuple[str, str]] = []
    for clause in textual.split():
        m = _CLAUSE.match(clause)
        if not m:
            raise QueryError(clause, "not a filter: write FIELD=VALUE, FIELD!=VALUE, FIELD>VALUE, FIELD<VALUE or "
                                     "FIELD=in:A,B (config.KEY, meta.KEY, tag, commit, since, until, a figure)")
        name, op, val = m.groups()
        out.append((name, val if op == "=" else f"{_OP_PREFIX[op]}:{val}"))
    return out


# ------------------------------------------------------------------------------------------ SQL


def _json_value(v: str) -> Any:
    """A filter value as JSON: a number, true/false/null or a quoted string as such; anything else is
    the string itself."""
    try:
        x = json.loads(v)
    except ValueError:
        return v
    if isinstance(x, float) and not math.isfinite(x):
        return v
    return x if isinstance(x, (int, float, str, bool)) or x is None else v


def _number(v: str) -> float | None:
    try:
        f = float(v)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def _time(v: Any, param: str) -> dt.datetime:
    if not isinstance(v, str):
        raise QueryError(param, "takes one time (ISO 8601 or unix seconds)")
    f = _number(v)
    if f is not None:
        if not 0 <= f <= _MAX_UNIX_S:
            raise QueryError(param, f"time out of range: {v[:40]!r} (unix seconds from 0 to {_MAX_UNIX_S:.0f}, "
                                    "the year 9999)")
        return dt.datetime.fromtimestamp(f, tz=dt.timezone.utc)
    try:
        t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
    except (ValueError, OverflowError):
        raise QueryError(param, f"not a time: {v[:40]!r} (ISO 8601 or unix seconds)") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


class _Sql:
    """Builds bound SQL fragments; parameters named p0, p1 …"""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.figures = False
        #: training scalar name -> its index in the one scalar join (``_from``): every ``scalar.NAME.*`` of a
        #: query is read in a single pass over ``run_scalar_names`` grouped by run — never a join per
        #: field, whose planning time explodes with their number — joined by run id (not a subquery
        #: correlated with ``r.id``, which Citus refuses: ``runs`` is a reference table there)
        self.scalars: dict[str, int] = {}

    def bind(self, v: Any) -> str:
        name = f"p{len(self.params)}"
        self.params[name] = v
        return f":{name}"

    def json_path(self, name: str) -> tuple[str, list[str]]:
        col, key = name.split(".", 1)
        return ("r.config" if col == "config" else "r.meta"), key.split(".")

    def value(self, name: str) -> str:
        """The SQL of a field's value for sorting and grouping."""
        if name in _COLUMNS:
            return _COLUMNS[name]
        if name in FIGURES:
            self.figures = True
            return f"(CASE WHEN jsonb_typeof(s.stats -> '{name}') = 'number' THEN (s.stats ->> '{name}')::float8 END)"
        m = _SCALAR.match(name)
        if m:
            i = self.scalars.setdefault(m.group(1), len(self.scalars))
            if len(self.scalars) > MAX_SCALARS:
                raise QueryError(name, f"at most {MAX_SCALARS} training scalars per request")
            return f"sc.{'m' if m.group(2) == 'min' else 'l'}{i}"
        col, path = self.json_path(name)
        return f"({col} #> CAST({self.bind(path)} AS text[]))"

    def sort_values(self, name: str) -> list[str]:
        """What sorts a field: a JSON value's number (numbers as numbers), then its text."""
        v = self.value(name)
        if name.startswith(("config.", "meta.")):
            return [f"(CASE WHEN jsonb_typeof({v}) = 'number' THEN ({v})::numeric END)", f"({v} #>> '{{}}')"]
        return [v]

    def _json_in(self, name: str, raws: Sequence[str]) -> str:
        """``name`` equals one of ``raws`` (each a JSON value or a plain string; a number also matches
        its string: 4 matches "4"): one containment test against an array of documents, one bound
        parameter however many values — never an OR per value, whose SQL, binding and planning grow
        with the URL."""
        col, path = self.json_path(name)
        docs: list[str] = []
        for raw in raws:
            v = _json_value(raw)
            for alt in ([v] if isinstance(v, str) else [v, raw]):
                doc: Any = alt
                for p in reversed(path):
                    doc = {p: doc}
                docs.append(json.dumps(doc))
        return f"(coalesce({col}, '{{}}'::jsonb) @> ANY(CAST({self.bind(docs)} AS jsonb[])))"

    def condition(self, f: Filter) -> str:
        name, op, val = f.field, f.op, f.value
        if name == "tag":
            tags = val if isinstance(val, list) else [val]
            docs = [json.dumps({"tags": [t]}) for t in tags]
            any_tag = f"(coalesce(r.meta, '{{}}'::jsonb) @> ANY(CAST({self.bind(docs)} AS jsonb[])))"
            return f"NOT {any_tag}" if op == "!=" else any_tag
        if name in ("since", "until"):
            t = _time(str(val), name)
            return f"r.started_at {'>=' if name == 'since' else '<'} {self.bind(t)}"
        if name == "commit":
            vals = val if isinstance(val, list) else [val]
            ors = " OR ".join(f"left(r.git_commit, {len(v)}) = {self.bind(v)}" for v in vals)
            return f"NOT coalesce({ors}, false)" if op == "!=" else f"({ors})"
        if name.startswith(("config.", "meta.")):
            if op == "in":
                assert isinstance(val, list)
                return self._json_in(name, val)
            assert isinstance(val, str)
            if op == "=":
                return self._json_in(name, [val])
            if op == "!=":
                return f"NOT {self._json_in(name, [val])}"
            v = self.value(name)
            num = _number(val)
            if num is not None:
                return f"(CASE WHEN jsonb_typeof({v}) = 'number' THEN ({v})::numeric END) {op} {self.bind(num)}"
            return f"({v} #>> '{{}}') {op} {self.bind(val)}"
        # run columns, figures, scalars
        v = self.value(name)
        vals = val if isinstance(val, list) else [val]
        numeric = name in FIGURES or name in _NUMERIC_COLUMNS or bool(_SCALAR.match(name))
        conv: list[Any] = []
        for x in vals:
            if numeric:
                n = _number(x)
                if n is None:
                    raise QueryError(name, f"{name} takes a number, got {x[:40]!r}")
                conv.append(int(n) if name in _NUMERIC_COLUMNS and n == int(n) else n)
            elif name in _TIME_COLUMNS:
                conv.append(_time(x, name))
            else:
                conv.append(x)
        if op == "in":
            return "(" + " OR ".join(f"{v} = {self.bind(x)}" for x in conv) + ")"
        if op == "!=":
            return f"({v} IS DISTINCT FROM {self.bind(conv[0])})"
        return f"({v} {op} {self.bind(conv[0])})"


def _where(q: RunQuery, sql: _Sql) -> str:
    conds = [sql.condition(f) for f in q.filters]
    if q.owners is not None:
        conds.insert(0, f"r.owner_key = ANY(CAST({sql.bind(sorted(q.owners))} AS text[]))")
    return ("WHERE " + " AND ".join(conds)) if conds else ""


def _from(sql: _Sql) -> str:
    out = "runs r" + (" LEFT JOIN run_stats s ON s.run_id = r.id" if sql.figures else "")
    if sql.scalars:
        cols = []
        for name, i in sql.scalars.items():
            n = sql.bind(name)
            cols.append(f"max(min_value) FILTER (WHERE name = {n}) AS m{i}, "
                        f"max(last_value) FILTER (WHERE name = {n}) AS l{i}")
        names = sql.bind(list(sql.scalars))
        # the names' summaries kept at ingest (store/scalars.py): one row per run and name
        out += (f" LEFT JOIN (SELECT run_id, {', '.join(cols)} FROM run_scalar_names WHERE name = ANY(CAST({names} "
                "AS text[])) GROUP BY run_id) sc ON sc.run_id = r.id")
    return out


def query_runs(engine: Engine, q: RunQuery, *, columns: Sequence[str] = ()) -> tuple[int, list[RunRow], dict[int, dict[str, Any]]]:
    """(runs matching, the page of them as RunRows, {run id: {column: value}} of the extra ``columns``:
    figures as stored, ``config.KEY`` / ``meta.KEY`` values, ``scalar.NAME.last|min``)."""
    sql = _Sql()
    columns = check_columns(columns, q)
    where = _where(q, sql)
    for n, _d in q.sort:
        if n in GROUP_SORTS:
            raise QueryError("sort", f"{n!r} sorts groups: use it with group_by")
    order = [f"{v} {'DESC' if d else 'ASC'} NULLS LAST" for n, d in q.sort for v in sql.sort_values(n)]
    order += ["r.started_at DESC NULLS LAST", "r.id DESC"]
    extra = [(c, sql.value(c)) for c in columns if c not in ("tag", "since", "until")]
    for f in q.filters:
        if f.field in FIGURES:
            sql.figures = True
    # config/meta columns come back as one JSON array per row (one document to decode, not one per
    # column and row: 64 columns of 10,000 runs were 640,000 decodes on the serving process); the others
    # (figures, scalars, run columns) keep their SQL types
    jx = [i for i, (c, _v) in enumerate(extra) if c.startswith(("config.", "meta."))]
    jset = set(jx)
    sel_extra = "".join(f", {v} AS x{i}" for i, (_c, v) in enumerate(extra) if i not in jset)
    if jx:
        sel_extra += f", to_jsonb(ARRAY[{', '.join(extra[i][1] for i in jx)}]) AS xj"
    with _snapshot(engine) as conn:  # the counters and the fragments of one moment (runs._snapshot)
        total = int(conn.execute(text(f"SELECT count(*) FROM {_from(sql)} {where}"), sql.params).scalar() or 0)
        rows = conn.execute(
            text(f"SELECT {', '.join('r.' + c.strip() for c in _COLS.split(','))}{sel_extra} FROM {_from(sql)} {where} "
                 f"ORDER BY {', '.join(order)} OFFSET :_off LIMIT :_lim"),
            {**sql.params, "_off": q.offset, "_lim": q.limit},
        ).fetchall()
        out_rows = _with_pending(conn, [_row(r) for r in rows], only_running=True)
    extras: dict[int, dict[str, Any]] = {}
    for r, row in zip(rows, out_rows, strict=True):
        m = r._mapping
        packed = dict(zip(jx, m["xj"], strict=True)) if jx else {}
        extras[row.id] = {c: (packed[i] if i in packed else _plain(m[f"x{i}"])) for i, (c, _v) in enumerate(extra)}
    return total, out_rows, extras


def _plain(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return v.isoformat()
    if hasattr(v, "__float__") and not isinstance(v, (int, float, bool)):
        return float(v)
    return v




def group_runs(engine: Engine, q: RunQuery) -> list[dict[str, Any]]:
    """One row per group of ``q.group_by`` over the runs matching ``q.filters``: the group's key values,
    ``count``, and the medians of MFU, tokens/s/GPU and step time (as stored figures), largest groups
    first (or by ``q.sort`` when it names ``count`` or a median), at most MAX_GROUPS."""
    sql = _Sql()
    sql.figures = True
    where = _where(q, sql)
    keys = [sql.value(k) for k in q.group_by]
    med = ", ".join(
        f"percentile_cont(0.5) WITHIN GROUP (ORDER BY {sql.value(f)}) AS median_{a}" for a, f in _AGGS)
    sel = ", ".join(f"{k} AS g{i}" for i, k in enumerate(keys))
    grp = ", ".join(f"g{i}" for i in range(len(keys)))
    with engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT {sel}, count(*) AS count, {med} FROM {_from(sql)} {where} GROUP BY {grp} "
                 f"ORDER BY count DESC, {grp} LIMIT {MAX_GROUPS}"),
            sql.params,
        ).fetchall()
    out = []
    for r in rows:
        m = r._mapping
        d: dict[str, Any] = {k: _plain(m[f"g{i}"]) for i, k in enumerate(q.group_by)}
        d["count"] = int(m["count"])
        for a, _f in _AGGS:
            v = m[f"median_{a}"]
            d[f"median_{a}"] = float(v) if v is not None else None
        out.append(d)
    if q.sort:
        name, desc = q.sort[0]
        if name in ("count", *(f"median_{a}" for a, _ in _AGGS)):
            out.sort(key=lambda d: (d.get(name) is None, -(d.get(name) or 0) if desc else (d.get(name) or 0)))
    return out


def stale_figure_runs(engine: Engine, limit: int = 200) -> list[int]:
    """Runs whose stored figures (``run_stats``) are missing or older than their counters, most recently
    seen first: the figures a query that filters, sorts or groups by a figure refreshes first."""
    with engine.connect() as c:
        return [int(i) for (i,) in c.execute(
            text("SELECT r.id FROM runs r LEFT JOIN run_stats s ON s.run_id = r.id WHERE r.rank_steps > 0 AND "
                 "(s.run_id IS NULL OR s.rank_steps <> r.rank_steps OR s.status <> r.status) "
                 "ORDER BY r.last_seen_at DESC NULLS LAST LIMIT :n"), {"n": limit})]


def key_options(engine: Engine, *, recent: int = 2_000, limit: int = 500) -> dict[str, list[str]]:
    """Field names to offer in pickers: ``config.KEY`` / ``meta.KEY`` keys (one nested level dotted) of
    the ``recent`` newest runs, and ``scalar.NAME`` names logged in them; at most ``limit`` of each."""
    sql = (
        "WITH r AS (SELECT id, config, meta FROM runs ORDER BY started_at DESC NULLS LAST, id DESC LIMIT :recent), "
        "k AS (SELECT 'config' AS src, e.key, e.value FROM r, jsonb_each(CASE WHEN jsonb_typeof(r.config) = 'object' "
        "THEN r.config ELSE '{}' END) e UNION ALL SELECT 'meta', e.key, e.value FROM r, "
        "jsonb_each(CASE WHEN jsonb_typeof(r.meta) = 'object' THEN r.meta ELSE '{}' END) e) "
        "SELECT DISTINCT src, CASE WHEN jsonb_typeof(k.value) = 'object' THEN k.key || '.' || n.key ELSE k.key END "
        "FROM k LEFT JOIN LATERAL jsonb_object_keys(CASE WHEN jsonb_typeof(k.value) = 'object' THEN k.value "
        "ELSE '{}' END) n(key) ON true WHERE jsonb_typeof(k.value) <> 'object' OR n.key IS NOT NULL LIMIT :lim")
    with engine.connect() as c:
        rows = c.execute(text(sql), {"recent": recent, "lim": 4 * limit}).fetchall()
        names = [str(n) for (n,) in c.execute(text(
            "SELECT DISTINCT name FROM run_scalar_names WHERE run_id IN (SELECT id FROM runs ORDER BY started_at DESC "
            "NULLS LAST, id DESC LIMIT :recent) ORDER BY 1 LIMIT :lim"), {"recent": recent, "lim": limit})]
    cfg = sorted({f"config.{k}" for s, k in rows if s == "config" and _KEY.match(k)})[:limit]
    meta = sorted({f"meta.{k}" for s, k in rows if s == "meta" and _KEY.match(k)})[:limit]
    return {"config": cfg, "meta": meta, "scalars": names}
