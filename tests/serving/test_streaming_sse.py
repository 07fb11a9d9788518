"""One server-sent event per answer chunk, whatever characters the answer holds."""

from __future__ import annotations

import json

from serving.streaming import sse


def test_unicode_line_breaks_in_an_answer_stay_inside_their_event():
    """Readers that split on every Unicode line break (httpx's iter_lines) cut an event holding a raw
    U+2028, U+2029 or U+0085 in two; escaped, the JSON reads back to the same text."""
    from serving.answers import FunctionCall

    text = "line one\u2028line two\u2029three\x85four"
    for payload in (FunctionCall(name="f", arguments=text), {"content": text}):
        event = sse(payload)
        assert event.endswith("\n\n")
        lines = event.removesuffix("\n\n").splitlines()
        assert len(lines) == 1 and lines[0].startswith("data: ")
        decoded = json.loads(lines[0].removeprefix("data: "))
        assert text in (decoded.get("arguments"), decoded.get("content"))
