"""A calculator tool for math word problems: `env.fn = "rl.env.calculator:make_env"`, `env.stop =
["</tool_call>"]`.

The model calls it as Qwen and Hermes chat templates have instruct models call tools:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>

and reads `<tool_response>84</tool_response>` after it. Calls are read as rl/env/tool_calls.py reads every
built-in tool's: one that cannot be read (bad JSON, another tool), or an expression that is not arithmetic, is the
model's mistake: it gets an error message as the response and the episode goes on. The episode ends when the
model answers without a call, scored by math-verify against the row's answer. Expressions are evaluated by
walking their syntax tree, never by eval: numbers, + - * / // % ** and parentheses, with bounded powers so that a
call cannot take the worker's memory or time.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any

from rl.env.tool_calls import tool_step

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 100  # 10 ** 100 is a fine number; 9 ** 9 ** 9 would hold a worker for minutes
MAX_LENGTH = 200  # characters of an expression


def make_env(prompt: Any, label: Any, columns: dict) -> Calculator:
    return Calculator(label)


@dataclass
class Calculator:
    label: Any

    def step(self, text: str, tokens: list[int]) -> tuple[str, bool, float]:
        return tool_step(text, self.label, "calculator", "expression", calculate,
                         lambda response, _: f"\n<tool_response>{response}</tool_response>\n")


def calculate(expression: str) -> str:
    """The tool's answer to one expression, or an error message the model can read."""
    try:
        return format_number(evaluate(expression))
    except (ValueError, ZeroDivisionError, OverflowError, SyntaxError) as e:
        return f"error: {e}"


def evaluate(expression: str) -> float | int:
    """Arithmetic only: anything but numbers, the operators above, unary signs and parentheses is refused."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    return _value(ast.parse(expression.replace("^", "**"), mode="eval").body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > 10**MAX_EXPONENT):
            raise ValueError(f"a power past {MAX_EXPONENT} digits to the power {MAX_EXPONENT}")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def format_number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)
