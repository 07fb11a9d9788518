"""The calculator tool's evaluator: arithmetic only, never code."""

from __future__ import annotations

import pytest

from apps.default_model.calculator import (MAX_EXPRESSION_CHARS, CalculatorError, evaluate_expression,
                                           format_number, run_calculator)


@pytest.mark.parametrize("expression, value", [
    ("17 + 25", 42.0), ("900 * 621", 558900.0), ("1332 / 18", 74.0), ("5 - 12", -7.0),
    ("(2 + 3) * 4", 20.0), ("-3 * -3", 9.0), ("7 / 2", 3.5), (" 1.5+1.5 ", 3.0), ("2 + 3 * 4", 14.0),
])
def test_evaluates_arithmetic(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('x')", "a + 1", "2 ** 10", "3 % 2", "7 // 2", "[1, 2]",
    "1 if 1 else 2", "True + 1", "'a' * 3", "", "1 +", "lambda: 1", "(1).real",
])
def test_refuses_everything_but_numbers_and_four_operators(expression):
    with pytest.raises(CalculatorError):
        evaluate_expression(expression)


def test_refuses_division_by_zero_long_input_and_huge_values():
    with pytest.raises(CalculatorError, match="division by zero"):
        evaluate_expression("1 / (2 - 2)")
    with pytest.raises(CalculatorError, match="longer"):
        evaluate_expression("1 + " * (MAX_EXPRESSION_CHARS // 4) + "1")
    with pytest.raises(CalculatorError, match="out of range"):
        evaluate_expression("999999 * 999999 * 999999")


def test_formats_integers_without_decimals_and_rounds_the_rest():
    assert format_number(42.0) == "42"
    assert format_number(-7.0) == "-7"
    assert format_number(3.5) == "3.5"
    assert format_number(1 / 3) == "0.333333"
    # within half a millionth of an integer: the integer (it read "2.", "0." and "-0.")
    assert format_number(2.0000001) == "2" and format_number(1e-7) == "0" and format_number(-1e-7) == "0"


def test_tool_result_is_the_value_or_an_error_the_model_reads():
    assert run_calculator({"expression": "17 + 25"}) == "42"
    assert run_calculator({"expression": "import os"}).startswith("error: ")
    assert run_calculator({"expr": "1 + 1"}) == "error: the argument 'expression' must be a string"
    assert run_calculator({"expression": 3}).startswith("error: ")
