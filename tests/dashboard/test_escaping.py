"""Text is text: user strings never become markup in a chart or a table.

Plotly draws a subset of HTML in every text it renders (``<a href>`` a live link, ``<b>`` bold) and Dash's
Markdown cells would too. ``figures.plain`` escapes user text wherever it enters a figure; Dash's html
components escape by themselves; the fleet's Markdown cell is backslash-escaped (``md_escape``).

* every figure builder, given user strings full of markup, puts none of it into the figure unescaped
  (trace names, category values, hover text, titles, subtitles, axis titles, annotations);
* in headless chromium, against the real server, a run (and its family, parallel dimension, modality,
  hosts/nodes, custom phase, compile reasons, config, kernel names, a benchmark's name, cluster and
  parameters, an alert on it) whose every string holds ``<a href="https://evil.example/x">click</a>`` and
  ``<b>bold</b>`` is shown on every page — fleet, its run page, compare, scaling, regressions,
  benchmarks, cluster — and the rendered DOM, Plotly's SVGs and hover labels included, holds no link to
  anything but the app and no bold "bold", while the literal text is visible (in HTML and in the charts).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import numpy as np
import plotly.graph_objects as go
import psycopg
import pytest
from browser_util import severe_logs, wait_for, wait_for_charts
from conftest import _db_uri, start_server
from dash_util import add_alert
from fleetscope.dashboard import figures as F
from fleetscope.server.downsample import minmax_series

from fleetscope.client import columnar
from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

EVIL = '<a href="https://evil.example/x">click</a> <b>bold</b>'
LITERAL = "<b>bold</b>"
NAMES = [f.name for f in RANK_STEP_FIELDS]


def _raw_markup(fig: dict[str, Any]) -> list[str]:
    """Unescaped user markup anywhere in a figure (our own ``<b>title</b>``/``<br>``/``<extra>`` aside)."""
    s = json.dumps(fig, ensure_ascii=False)
    bad = [m for m in ("<a ", "<a>", "<b>bold", "evil.example/x\"") if m in s]
    # user text in a hovertemplate literal must not be substituted (%{...}); in data values it is inert
    return bad + [t["hovertemplate"] for t in fig["data"] if "%{evil}" in t.get("hovertemplate", "")]


def test_plain_escapes_what_plotly_reads_as_markup() -> None:
    assert F.plain(EVIL) == ("&lt;a href=&#34;https://evil.example/x&#34;&gt;click&lt;/a&gt; &lt;b&gt;bold&lt;/b&gt;")
    assert F.plain("a & b's") == "a &amp; b&#39;s" and F.plain(None) == "" and F.plain(3) == "3"
    assert F.plain("50%{y}", template=True) == "50&#37;{y}"  # no substitution inside a hovertemplate literal


def test_every_figure_builder_escapes_user_text() -> None:
    u = EVIL + " %{evil}"
    s = minmax_series(np.arange(5), np.ones(5), 100)
    sd = {"rank": np.arange(4), "slowdown": np.array([1.0, 1.0, 1.3, 1.0]), "node_of": [u] * 4,
          "nodes": [{"node": u + " n0", "slowdown": 1.2, "ranks": 2}, {"node": u + " n1", "slowdown": 1.0, "ranks": 2}],
          "time_lost_s": 1.0, "known_hosts": True}
    colls = [{"op": u, "group_size": 8, "size_bucket_bytes": 2**20, "calls": 2, "total_s": 0.1, "busbw_bytes_per_s": 1e9}]
    mod = {"step": np.arange(3), "tokens": {u: np.ones(3)}, "factor": 1}
    pts = [{"world_size": n, "tokens_per_s": 1e5 * n, "ideal_tokens_per_s": 1e5 * n, "efficiency": 1.0, "step_s": 0.5,
            "compute_s": 0.4, "comm_by_dim": {u: {"exposed_s": 0.01}}} for n in (8, 16)]
    scal = {"family": u, "configs": [{"config": u, "mode": u, "points": pts, "growth": u},
                                     {"config": u + "2", "mode": "weak", "points": pts}]}
    names = {1: u, 2: u}  # two runs of the same name stay two bars
    ser = {"x": [1.7e9, 1.7e9 + 60], "y": [1.0, 2.0], "labels": [u, u], "change_index": 1, "xlabel": "run start",
           "metric": u, "unit": u, "source": u}
    bench = [{"name": u, "cluster": u, "params": {"bytes": 2**20, u: u}, "unit": u, "ts": [1.7e9], "value": [1.0],
              "git_commit": [u]}]
    overlap = {"step": 3, "rank": 0, "step_s": 0.1, "tail_s": 0.01, "backward": {"start_s": 0.0, "end_s": 0.05},
               "collectives": [{"op": u, "dim": u, "bytes": 10, "start_s": 0.01, "end_s": 0.02, "exposed_s": 0.0,
                                "phase": u, "gradient": True}]}
    figs = {
        "slowdown": F.slowdown_figure(sd), "collectives": F.collectives_figure(colls), "modality": F.modality_figure(mod, s),
        "scaling throughput": F.scaling_throughput_figure(scal), "scaling efficiency": F.scaling_efficiency_figure(scal),
        "scaling decomposition": F.scaling_decomposition_figure(scal["configs"][0]),
        "scaling dims": F.scaling_comm_dims_figure(scal), "scaling empty": F.scaling_throughput_figure({"family": u}),
        "compare series": F.compare_series_figure({1: s, 2: s}, names),
        "compare decomposition": F.compare_decomposition_figure({1: {"step_s": 1.0}, 2: {"step_s": 1.0}}, names),
        "compare dims": F.compare_comm_dims_figure({1: {u: {"exposed_s": 0.1}}, 2: {}}, names),
        "alert": F.alert_series_figure(ser, {"metric": u, "before": 1.0, "after": 2.0}),
        "benchmark": F.benchmark_figure(bench, u), "benchmark empty": F.benchmark_figure([], u),
        "busbw": F.busbw_by_size_figure(bench),
        "comm dims": F.comm_dims_figure({"steps": [0, 1], "dims": {u: {"exposed_s": [0.1, 0.2]}}}, [u]),
        "overlap": F.overlap_figure(overlap), "empty": F.empty_figure(u),
    }
    for what, fig in figs.items():
        go.Figure(fig)
        assert fig["data"] or what.endswith("empty") or what == "empty", (what, fig["layout"].get("annotations"))
        assert not _raw_markup(fig), (what, _raw_markup(fig), json.dumps(fig)[:800])
        assert F.plain(EVIL) in json.dumps(fig, ensure_ascii=False), what  # the text is there, as text
    assert len({y for t in figs["compare decomposition"]["data"] for y in t["y"]}) == 2


# ---------------------------------------------------------------------------------------------- the browser

#: every anchor must point into the app; nothing bold whose text is "bold"; the literal visible in HTML and SVG
_SCAN_JS = r"""
const out = {links: [], bold: [], html: document.body.innerText.includes(arguments[0]), svg: false, hover: []};
const scan = (root) => {
    for (const a of root.querySelectorAll('a')) {
        const h = a.getAttribute('href') || a.getAttributeNS('http://www.w3.org/1999/xlink', 'href') || '';
        let origin = null;
        try { origin = new URL(h, location.href).origin; } catch (e) {}
        // the app's own links stay on its origin (user text only ever in their encoded query)
        if ((h && origin !== location.origin) || (!h && a.textContent.trim() === 'click'))
            out.links.push(a.outerHTML.slice(0, 200));
    }
    for (const el of root.querySelectorAll('b, strong, tspan, span, text')) {
        const tag = el.tagName.toLowerCase();
        const bold = tag === 'b' || tag === 'strong' || /font-weight:\s*(bold|[6-9]00)/.test(el.getAttribute('style') || '');
        if (bold && el.textContent.trim() === 'bold') out.bold.push(el.outerHTML.slice(0, 200));
    }
};
scan(document);
const svgs = Array.from(document.querySelectorAll('.main-svg'));
out.svg = svgs.some(s => s.textContent.includes(arguments[0]));
// hover every trace's first point of every chart: hover labels are drawn from the same text
for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    (gd.data || []).forEach((t, i) => {
        try { window.Plotly.Fx.hover(gd, [{curveNumber: i, pointNumber: 0}]); } catch (e) { return; }
        const layer = gd.querySelector('.hoverlayer');
        if (layer) { scan(layer); if (layer.textContent) out.hover.push(layer.textContent); }
    });
    try { window.Plotly.Fx.unhover(gd); } catch (e) {}
}
return out;
"""


def _steps(world: int, steps: int, slow_rank: int | None) -> list[tuple]:
    rows = []
    for s in range(steps):
        for r in range(world):
            k = 1.5 if r == slow_rank else 1.0
            vals = {"rank": r, "step": s, "ts": 1.7e9 + s, "step_s": 0.5 * 1.5, "data_s": 0.02, "compute_s": 0.3 * k,
                    "forward_s": 0.1 * k, "backward_s": 0.15 * k, "optimizer_s": 0.02 * k,
                    "comm_exposed_s": 0.5 * 1.5 - 0.02 - 0.3 * k - 0.01, "comm_total_s": 0.6, "other_s": 0.01,
                    "tokens": 8192, "padded_tokens": 9000, "flops": 3e13, "mem_peak_bytes": 4e10}
            row: list[Any] = [None] * len(NAMES)
            for key, v in vals.items():
                row[NAMES.index(key)] = v
            rows.append(tuple(row))
    return rows


def _hostile_run(srv: Any, name: str, world: int, *, node_of: Any) -> int:
    steps = 12
    rows = _steps(world, steps, slow_rank=1)
    colls = [(r, s, 0, "all_reduce", world, 1 << 24, 1, 0.3, 0.2, 1.7e9 + s + 0.3, "dim " + EVIL)
             for s in range(steps) for r in range(world)]
    keys = [(s, r) for s in range(steps) for r in range(world)]
    mods = {"rank": [r for _, r in keys], "step": [s for s, _ in keys], "modality": ["mod " + EVIL] * len(keys),
            "tokens": [8192] * len(keys)}
    phases = {"rank": [r for _, r in keys], "step": [s for s, _ in keys], "phase": ["ph " + EVIL] * len(keys),
              "seconds": [0.01] * len(keys)}
    hosts = [{"rank": r, "host": node_of(r), "node": node_of(r), "local_rank": r % 2} for r in range(world)]
    events = [{"rank": 0, "seq": 1, "kind": "compile", "ts": 1.7e9 + 2, "step": 2,
               "data": {"compile_s": 1.5, "frame": "fr " + EVIL, "recompile": True, "reason": "why " + EVIL}},
              {"rank": 0, "seq": 2, "kind": "graph_break", "ts": 1.7e9 + 2, "step": 2, "data": {"reason": "gb " + EVIL,
                                                                                                  "count": 1}}]
    with srv.client() as c:
        rid = c.register_run({"name": name, "model_family": "fam " + EVIL, "world_size": world, "device_type": "H100",
                              "config": {"opt " + EVIL: "val " + EVIL}, "meta": {"m " + EVIL: EVIL}})
        c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar(rows, RANK_STEP_FIELDS),
                  "collectives": columnar(colls, COLLECTIVE_FIELDS), "modality_tokens": mods, "phases": phases,
                  "ranks": hosts, "events": events})
    return rid


@pytest.fixture(scope="module")
def evil(pg_admin_uri: str) -> Iterator[dict[str, Any]]:
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    srv = start_server(_db_uri(pg_admin_uri, name))
    try:
        def node(r: int) -> str:
            return f"n{r // 2} {EVIL}"

        a = _hostile_run(srv, "r2 " + EVIL, 2, node_of=node)
        b = _hostile_run(srv, "r4 " + EVIL, 4, node_of=node)
        srv.compact()
        eng = srv.state.engine
        add_alert(eng, run_id=b, metric="tokens_per_s_per_gpu", before=100.0, after=80.0, change=-0.2,
                  first_bad={"run_id": b, "index": 1}, details={"runs": [a, b], "values": [100.0, 80.0]})
        from fleetscope.server.store.traces import save_traces

        save_traces(eng, run_id=b, rows=[(0, "rank0.pt.trace.json", {"kernel_time_us": 10.0, "compute_pct": 50.0, "top_kernels": [
            {"kernel_type": "kt " + EVIL, "name": "k " + EVIL, "count": 3, "sum_us": 9.0}]})])
        pts = [{"name": "bench " + EVIL, "params": {"bytes": size, "p " + EVIL: "v " + EVIL}, "unit": "GB/s",
                "value": 10.0 + day, "ts": 1.7e9 + 86400 * day, "git_commit": "c " + EVIL[:50]}
               for day in range(3) for size in (1 << 20, 1 << 24)]
        with srv.client() as c:
            r = c.http.post("/api/v1/benchmarks", json={"cluster": "cl " + EVIL, "points": pts})
            assert r.status_code == 200, r.text
            c.get("/api/v1/nodes")  # the node assessment catches up with the runs
        yield {"srv": srv, "url": srv.url, "a": a, "b": b, "node": node(2)}
    finally:
        srv.stop()
        with psycopg.connect(pg_admin_uri, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_user_text_renders_as_text_on_every_page(browser: Any, evil: dict[str, Any]) -> None:
    a, b = evil["a"], evil["b"]
    fam = quote("fam " + EVIL, safe="")
    pages = [  # (path, charts to wait for, minimum traces each)
        ("/", [], 0),
        (f"/runs/{b}", ["run-decomposition", "run-stragglers", "run-collectives", "run-modality", "run-comm-dims-chart",
                        "run-overlap-chart"], 1),
        (f"/compare?runs={a},{b}&diff=all", ["compare-series", "compare-decomposition", "compare-comm-dims"], 1),
        (f"/scaling?family={fam}", ["scaling-throughput", "scaling-efficiency", "scaling-decomposition-0",
                                    "scaling-comm-dims"], 1),
        ("/regressions", ["regressions-chart"], 1),
        ("/benchmarks", ["benchmarks-size", "benchmarks-0"], 1),
        (f"/cluster?node={quote(evil['node'], safe='')}", ["cluster-chart"], 0),
    ]
    found: dict[str, Any] = {}
    for path, charts, min_traces in pages:
        browser.get(evil["url"] + path)
        wait_for(browser, "document.querySelector('.fs-header') !== null", what="the dashboard shell")
        if charts:
            wait_for_charts(browser, charts, min_traces=min_traces)
        if path == "/":
            wait_for(browser, "document.querySelectorAll('#fleet-table a').length >= 2", what="fleet rows")
        wait_for(browser, "!document.querySelector('[data-dash-is-loading=\"true\"]')", what="every section loaded")
        got = found[path] = browser.execute_script(_SCAN_JS, LITERAL)
        assert not got["links"], (path, got["links"])
        assert not got["bold"], (path, got["bold"])
        assert got["html"] or got["svg"], (path, "the literal text is shown nowhere")
        errs = severe_logs(browser)
        assert not errs, (path, errs)
    # the literal is drawn inside the charts too (legends, axes, titles) and in hover labels
    for path in (f"/runs/{b}", f"/compare?runs={a},{b}&diff=all", f"/scaling?family={fam}", "/benchmarks"):
        assert found[path]["svg"], (path, "no chart shows the user text")
    assert found["/"]["html"] and found[f"/runs/{b}"]["html"]
    assert any(LITERAL in h for p in found.values() for h in p["hover"]), "no hover label shows the user text"
