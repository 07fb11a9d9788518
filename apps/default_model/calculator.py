"""The calculator tool: its OpenAI tool spec and a safe evaluator of its argument.

The default model learns to call this tool (apps/default_model/tool_corpus.py) and the
agent scenario (apps/agent/) executes its calls, both through :func:`run_calculator`, so
the tool results the model was trained on are written exactly as the agent writes them.
The evaluator walks the parsed expression and allows numbers, + - * / and parentheses
only: no names, calls or attributes, so a sampled argument can never run code.
"""

from __future__ import annotations

import ast
import math
import operator

CALCULATOR_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
"""The tool as an OpenAI client sends it (keys in the order serving renders them)."""

MAX_EXPRESSION_CHARS = 64
"""Longer arguments are refused: the corpus's expressions are under 20 characters, and a bound
keeps a sampled argument from making the evaluator work on huge input."""
MAX_MAGNITUDE = 1e12
"""Intermediate values beyond this are refused, so ``9**9**9``-like growth cannot happen
(there is no power operator either) and results stay exact in float."""
RESULT_DECIMALS = 6
"""A non-integral result is rounded to this many decimals."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic the calculator evaluates."""


def evaluate_expression(expression: str) -> float:
    """The value of ``expression`` (numbers, + - * /, parentheses); raises :class:`CalculatorError`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _value(tree.body)


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = float(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_value(node.operand))
    else:
        raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("value out of range")
    return value


def format_number(value: float) -> str:
    """The value rounded to :data:`RESULT_DECIMALS` decimals, without trailing zeros: ``42`` for one
    that rounds to an integer (rounded first: 2.0000001 read ``2.``, and -1e-7 ``-0.``)."""
    rounded = round(value, RESULT_DECIMALS)
    if rounded == int(rounded):
        return str(int(rounded))  # int(-0.0) is 0: no "-0"
    return f"{rounded:.{RESULT_DECIMALS}f}".rstrip("0")


def run_calculator(arguments: dict) -> str:
    """The tool result for a call's ``arguments``: the value, or ``error: ...`` the model reads."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        return "error: the argument 'expression' must be a string"
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as exc:
        return f"error: {exc}"
