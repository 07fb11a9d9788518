"""The tool-use part of the default model's corpus: arithmetic questions answered with the calculator.

Each example is one agent trajectory: with the calculator tool offered, the user asks
an arithmetic question; the assistant calls the tool with the expression, the tool
answers with the value, and the assistant states it. The model is far too small to do
arithmetic; it learns the call format and to copy digits -- the operands into the
call, the tool's result into the answer. The agent scenario (apps/agent/) draws its
tasks from the same generator with another seed. Everything is seeded and deterministic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from apps.default_model.calculator import CALCULATOR_TOOL, run_calculator

TOOL_CORPUS_SHARE = 0.12
"""Tool-use examples as a share of all training examples: small, so the style corpus the
drift experiments rely on stays dominant."""


@dataclass(frozen=True)
class Operation:
    symbol: str
    """How the expression writes it."""
    words: tuple[str, ...]
    """How a question or answer says it."""


OPERATIONS: tuple[Operation, ...] = (
    Operation("+", ("plus",)),
    Operation("-", ("minus",)),
    Operation("*", ("times", "multiplied by")),
    Operation("/", ("divided by",)),
)
QUESTIONS: tuple[str, ...] = ("What is {a} {op} {b}?", "What's {a} {op} {b}?", "How much is {a} {op} {b}?",
                              "Calculate {a} {op} {b}.", "Please work out {a} {op} {b}.", "{a} {op} {b} = ?")
"""Question phrasings; {a}, {b} operands, {op} the operation's words."""
ANSWERS: tuple[str, ...] = ("{a} {op} {b} is {r}.", "The answer is {r}.", "{a} {op} {b} equals {r}.", "It is {r}.")
"""Final answers; the result {r} is always the last number, which is what the agent's judge reads."""
MAX_OPERAND = 99
"""Operands of +, - and * are drawn from 2..MAX_OPERAND: two digits, each a token the model copies."""
MAX_DIVISOR = 12
"""Divisions are exact: a divisor in 2..MAX_DIVISOR times a quotient in 2..MAX_OPERAND."""


@dataclass(frozen=True)
class ToolTask:
    """An arithmetic question and its true result."""

    question: str
    expression: str
    result: str
    """The calculator's answer to ``expression``, as the tool writes it."""
    answer: str
    """A correct final answer, as the corpus writes it."""


def draw_task(rng: random.Random) -> ToolTask:
    """One question with its expression, result and a final answer, drawn from ``rng``."""
    operation = rng.choice(OPERATIONS)
    if operation.symbol == "/":
        b = rng.randint(2, MAX_DIVISOR)
        a = b * rng.randint(2, MAX_OPERAND)
    else:
        a, b = rng.randint(2, MAX_OPERAND), rng.randint(2, MAX_OPERAND)
        if operation.symbol == "-" and a < b:
            a, b = b, a
    words = rng.choice(operation.words)
    expression = f"{a} {operation.symbol} {b}"
    result = run_calculator({"expression": expression})
    fill = {"a": a, "b": b, "op": words, "r": result}
    return ToolTask(question=rng.choice(QUESTIONS).format(**fill), expression=expression, result=result,
                    answer=rng.choice(ANSWERS).format(**fill))


def generate_tool_corpus(seed: int, count: int) -> list[ToolTask]:
    """``count`` tool-use examples, deterministic in ``seed``."""
    rng = random.Random(f"tool-corpus:{seed}")
    return [draw_task(rng) for _ in range(count)]


def tool_corpus_size(style_examples: int, share: float = TOOL_CORPUS_SHARE) -> int:
    """Tool examples to add to ``style_examples`` so they make ``share`` of the total."""
    return round(style_examples * share / (1.0 - share))


def tool_call_text(expression: str) -> str:
    """The assistant's call, as the chat template renders a ``tool_calls`` entry."""
    call = {"name": CALCULATOR_TOOL["function"]["name"], "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"


def task_messages(task: ToolTask) -> list[dict]:
    """The whole trajectory as chat messages (OpenAI shape; the call's arguments as an object,
    which is how the chat template renders them)."""
    call = {"type": "function",
            "function": {"name": CALCULATOR_TOOL["function"]["name"], "arguments": {"expression": task.expression}}}
    return [{"role": "user", "content": task.question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": task.result},
            {"role": "assistant", "content": task.answer}]


TOOLS: list[dict] = [CALCULATOR_TOOL]
"""The tools every tool-use example offers."""
