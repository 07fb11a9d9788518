"""Nesting measured before parsing (online_sao/json_depth.py)."""

import json
import sys

import pytest

from online_sao.json_depth import MAX_JSON_DEPTH, nesting_depth, too_deep
from online_sao.schemas import RecordError, decode


@pytest.mark.parametrize("text, depth", [
    ("", 0), ("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ("[[[]],[]]", 3),
    ('["[[[[", "{{{"]', 1),            # brackets inside strings do not count
    ('["a\\"[[[", 2]', 1),             # nor after an escaped quote
    ("]]][[", 2),                      # closing more than opened never goes below 0
    ('[["a\\"[[', 2),                   # an unterminated string runs to the end: its brackets do not count
    ('[["x\\\\"]]', 2),                # an escaped backslash ends before the closing quote
])
def test_nesting_depth_on_hand_written_texts(text, depth):
    assert nesting_depth(text) == depth


def test_the_limit_is_inclusive():
    assert not too_deep("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert too_deep("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    assert not too_deep(json.dumps([[i] for i in range(500)]))  # many brackets, depth 2


def test_measuring_never_recurses_where_the_parser_would():
    """With the stack 60 frames from the interpreter's limit the parser fails on 5000 brackets;
    the measure answers. (The parser recursing to the limit left finalizers run at the bottom of the
    stack to fail in turn: a flaky test.)"""
    text = "[" * 5000
    limit = sys.getrecursionlimit()
    frames = len(__import__("inspect").stack(0))
    sys.setrecursionlimit(frames + 60)
    try:
        with pytest.raises(RecursionError):
            json.loads(text)
        assert too_deep(text)
    finally:
        sys.setrecursionlimit(limit)


def test_a_record_nested_too_deeply_is_refused_by_its_depth():
    with pytest.raises(RecordError, match=f"^not a JSON record: nested deeper than {MAX_JSON_DEPTH} levels$"):
        decode(b'{"kind": "reward", "x": ' + b"[" * 5000 + b"}")


def test_an_unterminated_string_after_many_brackets_is_measured_in_one_pass():
    """201 brackets, then a quote and escaped quotes to the end: the string pattern was tried again from
    every quote (quadratic: 32 KB held serving's event loop 4 s); the brackets before it still count."""
    text = "[" * (MAX_JSON_DEPTH + 1) + '"' + '\\"' * 100_000
    assert nesting_depth(text) == MAX_JSON_DEPTH + 1 and too_deep(text)
