"""The agent's judge and tool execution on hand-built episodes."""

from __future__ import annotations

import pytest

from apps.agent.judge import ToolUse, execute_call, judge_episode, last_number
from apps.default_model.tool_corpus import ToolTask

TASK = ToolTask(question="What is 17 plus 25?", expression="17 + 25", result="42", answer="17 plus 25 is 42.")
RIGHT_CALL = ToolUse("calculator", '{"expression": "17 + 25"}', "42")


@pytest.mark.parametrize("uses, answer, reward", [
    ([RIGHT_CALL], "17 plus 25 is 42.", 1.0),
    ([RIGHT_CALL], "The answer is 42.0", 1.0),
    ([RIGHT_CALL], "It is 41.", 0.0),                      # the result was not copied
    ([RIGHT_CALL], "42 is what 17 plus 25 makes.", 0.0),   # the last number stated is 25
    ([RIGHT_CALL], "I do not know.", 0.0),
    ([], "17 plus 25 is 42.", 0.0),                        # no call: right by luck earns nothing
    ([ToolUse("calculator", '{"expression": "17 + 52"}', "69")], "17 plus 25 is 42.", 0.0),  # wrong call
    ([ToolUse("calculator", "{oops", "error: the arguments are not JSON")], "It is 42.", 0.0),
    ([ToolUse("calculator", '{"expression": "17 + 52"}', "69"), RIGHT_CALL], "It is 42.", 1.0),  # corrected
])
def test_reward_needs_a_right_call_and_the_result_stated_last(uses, answer, reward):
    assert judge_episode(TASK, uses, answer).reward == reward


def test_verdict_says_what_went_wrong():
    verdict = judge_episode(TASK, [ToolUse("calculator", '{"expression": "17 + 52"}', "69")], "It is 69.")
    assert (verdict.called, verdict.call_correct, verdict.answer_correct) == (True, False, False)
    verdict = judge_episode(TASK, [], "It is 42.")
    assert (verdict.called, verdict.call_correct, verdict.answer_correct) == (False, False, True)


def test_last_number():
    assert last_number("5 minus 12 is -7.") == -7.0
    assert last_number("7 divided by 2 is 3.5.") == 3.5
    assert last_number("no digits") is None


def test_last_number_reads_the_forms_answers_write():
    """A thousands separator read 1,820 as 820; a Unicode minus, an exponent's digits and a
    fraction's denominator read as 42."""
    assert last_number("35 * 52 = 1,820.") == 1820.0
    assert last_number("It is 12,345,678.5") == 12345678.5
    assert last_number("It is \u221242.") == -42.0
    assert last_number("It is 4.2e+42") == 4.2e42
    assert last_number("It is 1/42") is None and last_number("2^42") is None
    assert last_number("1, 2, 3") == 3.0  # a list, not a thousands group


def test_execute_call_runs_only_the_calculator_on_a_json_object():
    assert execute_call("calculator", '{"expression": "900 * 621"}') == "558900"
    assert execute_call("calculator", '{"expression": "__import__(\'os\')"}').startswith("error: not allowed")
    assert execute_call("search", '{"q": "x"}') == "error: unknown tool 'search'"
    assert execute_call("calculator", "[1, 2]") == "error: the arguments must be a JSON object"
    assert execute_call("calculator", "17 + 25") == "error: the arguments are not JSON"
