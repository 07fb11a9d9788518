"""The tool-use part of the corpus: correct results, the call the parser reads, a small share."""

from __future__ import annotations

import json
import re

from apps.default_model.tool_corpus import (TOOL_CORPUS_SHARE, TOOLS, generate_tool_corpus, task_messages,
                                            tool_call_text, tool_corpus_size)
from serving.tool_calls import HermesToolCallParser

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def test_deterministic_in_the_seed():
    assert generate_tool_corpus(0, 50) == generate_tool_corpus(0, 50)
    assert generate_tool_corpus(1, 50) != generate_tool_corpus(0, 50)


def test_results_are_right_and_stated_last():
    operators = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
                 "/": lambda a, b: a // b}
    tasks = generate_tool_corpus(0, 400)
    assert {t.expression.split()[1] for t in tasks} == set(operators)
    for task in tasks:
        left, symbol, right = task.expression.split()
        a, b = int(left), int(right)
        if symbol == "/":
            assert a % b == 0
        assert task.result == str(operators[symbol](a, b))
        assert NUMBER.findall(task.answer)[-1] == task.result
        assert left in task.question and right in task.question


def test_the_call_is_what_the_hermes_parser_reads():
    task = generate_tool_corpus(0, 1)[0]
    [call] = HermesToolCallParser().parse(tool_call_text(task.expression), TOOLS).calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": task.expression}
    assert tool_call_text("17 + 25") == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "17 + 25"}}</tool_call>')


def test_messages_are_one_agent_trajectory():
    task = generate_tool_corpus(0, 1)[0]
    roles = [m["role"] for m in task_messages(task)]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_share_of_the_training_examples():
    style = 3048
    tools = tool_corpus_size(style)
    assert abs(tools / (style + tools) - TOOL_CORPUS_SHARE) < 0.001
    assert 0.10 <= TOOL_CORPUS_SHARE <= 0.15
