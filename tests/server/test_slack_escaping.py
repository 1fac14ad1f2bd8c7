"""Slack messages escape every user-supplied string: no pings, mentions or disguised links."""

from __future__ import annotations

import json

from fleetscope.server.notifier import slack_message


def _alert(**over: object) -> dict:
    a = {"id": 7, "kind": "run_series", "metric": "tokens_per_s_per_gpu", "state": "firing", "run_id": 3,
         "before": 100.0, "after": 80.0, "change": -0.2, "significance": 0.001, "url": "http://127.0.0.1:8000/runs/3",
         "details": {"family": "<!channel> vla", "world_size": 64, "device_type": "<https://evil.example|H100>",
                     "config_signature": "abc`<@U123>`", "unit": "tok/s", "good_commit": "c0de&<b>"},
         "first_bad": {"run": "run-<!here>", "commit": "dead`beef"}}
    a.update(over)
    return a


def test_user_strings_cannot_ping_mention_or_disguise_links() -> None:
    msg = slack_message(_alert(), "firing")
    text = json.dumps(msg)
    for bad in ("<!channel>", "<!here>", "<@U123>", "<https://evil.example|H100>", "<b>"):
        assert bad not in text, bad
    assert "&lt;!channel&gt; vla" in text and "c0de&amp;&lt;b&gt;" in text
    # a backtick in a value cannot close the code span it is shown in
    ctx = msg["blocks"][3]["text"]["text"]
    assert "`dead'beef`" in ctx and "`abc'&lt;@U123&gt;'`" in ctx
    # the server's own deep link is still a real link
    assert "<http://127.0.0.1:8000/runs/3|http://127.0.0.1:8000/runs/3>" in text


def test_benchmark_and_straggler_fields_are_escaped_too() -> None:
    b = slack_message(_alert(kind="benchmark", metric="busbw<!channel>",
                             details={"cluster": "<@U1>", "params": {"<k>": "<v>"}, "unit": "GB/s"},
                             first_bad={"index": 3, "ts": "t", "commit": "x"}), "firing")
    s = slack_message(_alert(kind="straggler", details={"node": "<!everyone>", "component": "data"},
                             first_bad={"rank": 1, "host": "<@U2>"}), "firing")
    for msg in (b, s):
        text = json.dumps(msg)
        assert "<!channel>" not in text and "<@U1>" not in text and "<@U2>" not in text and "<!everyone>" not in text
