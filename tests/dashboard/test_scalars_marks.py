"""The run page's training-scalars chart marks what happened to the run on the step axis (issue 23):
the steps where a straggler rank was slow (shaded), checkpoints and the like (dotted lines) — in headless
chromium against the real server — and, in the figure itself, marks bounded with a note when capped and
user text (scalar and node names) escaped.

Chromium and chromedriver are required: without them the browser test fails with a message saying so."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from analysis_util import field_index, load, with_fields
from browser_util import severe_logs, wait_for_charts
from fleetscope.dashboard import scalars_panel as sp

from fleetscope.synthetic import RunSpec


def test_straggler_steps_and_checkpoints_are_marked_on_the_scalars_chart(browser: Any, live_server: Any) -> None:
    i_step, i_comp = field_index("step_s"), field_index("compute_s")

    def slow_5_from_step_100(step: int, rows: list[tuple]) -> list[tuple]:  # rank 5 slow on steps 100-299 only
        if step >= 100:
            r = rows[5]
            extra = 0.4 * r[i_comp]
            rows[5] = with_fields(r, step_s=r[i_step] + extra, compute_s=r[i_comp] + extra)
        return rows

    events = [{"rank": 0, "seq": s, "kind": "scalars", "ts": 1.7e9 + s, "step": s, "data": {"loss": 3.0 - s / 300}}
              for s in range(300)]
    events.append({"rank": 0, "seq": 1000, "kind": "checkpoint", "ts": 1.7e9 + 50, "step": 50, "data": {"duration_s": 1.0}})
    rid = load(live_server, RunSpec(name="strag-scalars", family="vit-h", world_size=8, steps=300),
               transform=slow_5_from_step_100, collectives=False, events=events)

    browser.get(f"{live_server.url}/runs/{rid}")
    wait_for_charts(browser, ["run-scalars"], min_traces=3)  # loss, step time, checkpoint: the figure arrives whole
    fig = browser.execute_script(
        "const gd = document.querySelector('#run-scalars .js-plotly-plot'); "
        "return {data: gd.data.map(t => [t.name, Array.from(t.x || []), t.text || null]), "
        "shapes: (gd.layout.shapes || []).map(s => [s.type, s.x0, s.x1]), "
        "notes: (gd.layout.annotations || []).map(a => a.text)};")
    by = {name: (x, text) for name, x, text in fig["data"]}
    # rank 5 was slow in windows 1 and 2 (steps 100-299): one shaded range, named in the legend with its node
    assert "straggler rank 5 (node0000)" in by, f"no straggler mark among {list(by)}"
    assert by["straggler rank 5 (node0000)"][0] == [100]
    assert "steps 100–299" in by["straggler rank 5 (node0000)"][1][0]
    assert ["rect", 100, 300] in fig["shapes"]
    assert [s for s in fig["shapes"] if s[0] == "rect"] == [["rect", 100, 300]]  # nothing shaded where it was not slow
    assert by["checkpoint"][0] == [50] and ["line", 50, 50] in fig["shapes"]
    assert by["loss"][0][:3] == [0, 1, 2]
    assert not any("capped" in (n or "") for n in fig["notes"])
    assert severe_logs(browser) == []


def test_marks_are_capped_with_a_note_and_user_text_is_escaped() -> None:
    scalars = {"<b>loss</b>": {"step": list(range(1000)), "value": [1.0] * 1000, "reduced": False}}
    many = list(range(0, 1000, 2))  # 500 recompiles: only MAX_MARKS drawn, and the chart says so
    marks = [sp._capped("recompile", many, "#CC79A7"),
             sp.Mark("straggler rank 3 (<a href='x'>n</a>)", [-1], sp.STRAGGLER_COLOUR, total=1,
                     bands=[(-1, -1, "straggler rank 3 (<a href='x'>n</a>), persistent: slow")])]
    fig = sp.scalars_figure(scalars, list(range(1000)), [0.5] * 1000, marks)
    go.Figure(fig)  # a valid plotly figure
    lines = [s for s in fig["layout"]["shapes"] if s["type"] == "line"]
    assert len(lines) == sp.MAX_MARKS == len(fig["data"][2]["x"])
    assert fig["layout"]["annotations"][0]["text"] == f"marks capped: {sp.MAX_MARKS} of 500 recompile drawn"
    # a persistent straggler without flagged windows is shaded over the whole run
    assert [(s["x0"], s["x1"]) for s in fig["layout"]["shapes"] if s["type"] == "rect"] == [(0, 1000)]
    names = [t["name"] for t in fig["data"]]
    assert names[0] == "&lt;b&gt;loss&lt;/b&gt;" and fig["layout"]["yaxis"]["title"]["text"] == "&lt;b&gt;loss&lt;/b&gt;"
    assert "straggler rank 3 (&lt;a href=&#39;x&#39;&gt;n&lt;/a&gt;)" in names
    assert not any("<a " in str(t.get("text")) or "<b>" in t["name"] for t in fig["data"])
    # within the caps: no note; two ranks slow at overlapping steps are shaded once, each named where it starts
    two = sp.Mark("stragglers (2 ranks)", [100, 150], sp.STRAGGLER_COLOUR, total=2,
                  bands=[(100, 300, "straggler rank 1"), (150, 400, "straggler rank 2")])
    few = sp.scalars_figure(scalars, [], [], [sp._capped("checkpoint", [10, 20], "#009E73"), two])
    go.Figure(few)
    assert "annotations" not in few["layout"]
    assert [(s["x0"], s["x1"]) for s in few["layout"]["shapes"] if s["type"] == "rect"] == [(100, 400)]
    band = next(t for t in few["data"] if t["name"] == "stragglers (2 ranks)")
    assert band["x"] == [100, 150] and band["text"] == ["straggler rank 1; slow at steps 100–299",
                                                        "straggler rank 2; slow at steps 150–399"]
