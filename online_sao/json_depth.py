"""How deeply a JSON text nests, measured before it is parsed.

Python's JSON parser recurses once per ``[`` or ``{``, up to the interpreter's recursion limit
(1000 frames), and only then raises ``RecursionError``. Refusing such text by catching that error
left the process at the bottom of a thousand-frame stack: a finalizer the garbage collector ran
there (an unclosed socket's warning, say) failed in turn, and the "exception ignored" report of
that failure failed too (a test of tool-call blocks nested 5000 deep failed that way beside other
tests). Every boundary that parses JSON from outside (request bodies, tool-call arguments, records)
measures the depth first and refuses deeper text without recursing at all.
"""

from __future__ import annotations

import re

MAX_JSON_DEPTH = 200
"""Deepest nesting of arrays and objects accepted. Real requests, tool schemas and records nest
a few levels (a JSON schema of tool arguments rarely passes 20); 200 leaves the parser far from the
interpreter's recursion limit whatever the caller's own stack depth."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one running to the end of the text. Possessive and ending at the
text's end, so every match is tried once from its quote: a pattern that needed the closing quote
tried again from every later quote of an unterminated string, quadratic (32 KB of ``\\"`` after 201
brackets held serving's event loop 4 s, 1 MB would have held it about an hour)."""
_BRACKETS = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``text``, brackets inside JSON strings not counted
    (nor those after an unterminated string's quote: such text is no JSON anyway). Linear, no recursion."""
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``text`` nests deeper than ``limit`` (checked in C first: fewer brackets than the limit
    cannot nest deeper)."""
    return text.count("[") + text.count("{") > limit and nesting_depth(text) > limit
