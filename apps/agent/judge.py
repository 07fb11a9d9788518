"""The agent's tools and the judge of an episode: 1 when the calculator was called right and the
final answer states the result, else 0."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from apps.default_model.calculator import CALCULATOR_TOOL, run_calculator
from apps.default_model.tool_corpus import ToolTask

NUMBER = re.compile(r"(?P<sign>[-\u2212]?)(?P<whole>\d{1,3}(?:,\d{3})+|\d+)(?P<fraction>\.\d+)?"
                    r"(?P<exponent>[eE][-+]?\d+)?")
"""A number as answers write it: a sign (ASCII or the Unicode minus), digits with or without thousands
separators (``1,820``), a fraction, an exponent (``4.2e+42`` is one number, not 42)."""
PART_OF_AN_EXPRESSION = "/^"
"""What before a number makes it the denominator or power of an expression (``1/42``), not the value
the answer states."""
SUCCESS_REWARD, FAILURE_REWARD = 1.0, 0.0
"""The rewards of a solved task and of any other (the agent sends no other values)."""
RESULT_TOLERANCE = 1e-6
"""A stated number counts as the result when it is this close (``42.0`` states ``42``)."""
CALCULATOR = CALCULATOR_TOOL["function"]["name"]


@dataclass(frozen=True)
class ToolUse:
    """One call the model made and what the agent answered it."""

    name: str
    arguments: str
    """As the model wrote them (JSON text)."""
    result: str


def execute_call(name: str, arguments: str) -> str:
    """The tool result for one call: the calculator's answer, or an ``error: ...`` the model reads."""
    if name != CALCULATOR:
        return f"error: unknown tool {name!r}"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if not isinstance(parsed, dict):
        return "error: the arguments must be a JSON object"
    return run_calculator(parsed)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (:data:`NUMBER`), or None: also when it ends an expression
    (:data:`PART_OF_AN_EXPRESSION`), which states no one number."""
    found = list(NUMBER.finditer(text))
    if not found:
        return None
    last = found[-1]
    if last.start() > 0 and text[last.start() - 1] in PART_OF_AN_EXPRESSION:
        return None
    sign = "-" if last["sign"] else ""
    return float(f"{sign}{last['whole'].replace(',', '')}{last['fraction'] or ''}{last['exponent'] or ''}")


@dataclass(frozen=True)
class Verdict:
    called: bool
    """The model called a tool in a form the server parsed."""
    call_correct: bool
    """The last call's result is the task's result."""
    answer_correct: bool
    """The final answer's last number is the task's result."""

    @property
    def reward(self) -> float:
        return SUCCESS_REWARD if self.called and self.call_correct and self.answer_correct else FAILURE_REWARD


def judge_episode(task: ToolTask, uses: list[ToolUse], final_answer: str) -> Verdict:
    """Judge one episode; an absent, malformed or wrong call gives reward 0 whatever the answer says."""
    expected = float(task.result)
    stated = last_number(final_answer)
    call_correct = bool(uses) and uses[-1].result == task.result
    answer_correct = stated is not None and math.isclose(stated, expected, rel_tol=0.0, abs_tol=RESULT_TOLERANCE)
    return Verdict(called=bool(uses), call_correct=call_correct, answer_correct=answer_correct)
