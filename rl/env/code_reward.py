"""The code task's reward: the response's code runs against its row's unit tests in the sandbox (rl/env/sandbox.py).

    reward.user_fn = "rl.env.code_reward:all_tests_pass"

A row holds `tests`, Python run after the candidate's code (asserts, or HumanEval's `def check(...)` and its
call), and may hold `setup`, code placed before the candidate's: the imports and helper functions the problem's
statement defines, as HumanEval's prompts do, so that a response that leaves them out still runs. The response's
code is its fenced ```python blocks (bare ``` ones too) joined in order, or the whole response when it has none;
an unclosed last block (a truncated response) counts up to the end.

The candidate and the tests run in two sandboxes joined by pipes (rl/env/code_harness.py): the candidate's side
imports it (solution.py: setup, then its code, so an `if __name__ == "__main__":` block of its own does not run)
and answers calls; the tests' side runs setup and tests, in which each function the candidate was to write (the
tests' free names that setup does not define with a body) asks the candidate's side, whose answers cross as plain
data. The score is all-pass: 1.0 when the tests run to their end, every call answered, and print a mark drawn
afresh for the call, else 0.0 (a wrong answer, an exception, a syntax error, a hang, a crash, memory past
MEMORY_MB, an answer that is not plain data). Not the fraction of tests passed: HumanEval's tests are one function
of asserts that stops at the first failure.

What this closes, besides the jail around each side (rl/env/sandbox.py): an answer cannot lie about equality (an
object whose `__eq__` is always true does not cross; the tests compare objects their own process built), and a
program cannot pass by exiting 0 or printing the mark early (the mark and the expected values are never in the
candidate's process). What it does not: tests that check an argument the candidate mutated in place see their
own copy, and a test that uses a name the candidate's module defines other than a function fails.

The sandbox's wall-clock limit sits inside the reward worker's (`reward.timeout_s`, which should exceed TIMEOUT_S
by a few seconds of interpreter start-up): a response that hangs scores 0 here and its worker goes on, instead of
the worker being killed and replaced and the response counted as a timeout. Standard library only, like the
worker that imports it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

from rl.env.sandbox import SandboxError, finish, kill, start_python

TIMEOUT_S = 5.0  # wall clock (and CPU seconds) for one response's program
MEMORY_MB = 512  # address space of that program; below reward.memory_limit_mb, which bounds the worker's children
# A fence and its info string ("python", "bash", ""), then the block up to the closing fence or the end of the
# text. Every block is matched, whatever its language, so that a closing fence never reads as an opening one.
FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON = ("python", "py", "python3", "")


def extract_code(response: str) -> str:
    """The response's fenced Python blocks joined in order, or the whole response when it has none."""
    blocks = [m.group(2) for m in FENCE.finditer(response) if m.group(1).strip().lower() in PYTHON]
    return "\n\n".join(blocks) if blocks else response


HARNESS = (Path(__file__).parent / "code_harness.py").read_text(encoding="utf-8")


def passes(code: str, tests: str, setup: str = "", timeout_s: float = TIMEOUT_S, entry_point: str = "") -> bool:
    """Whether `tests` run to their end against `code` (imported as solution.py after `setup`) with every call
    answered, each side in its own sandbox (the module docstring); `entry_point`: the function the row asks for,
    where the row names it."""
    mark = secrets.token_hex(16)
    stand_ins, modules = functions_to_write(tests, setup, entry_point)
    solution = f"{setup}\n\n{code}\n" if setup else f"{code}\n"
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    candidate = None
    try:
        candidate = start_python(f"import harness\nharness.serve({requests_r}, {answers_w})\n",
                                 files={"harness.py": HARNESS, "solution.py": solution}, timeout_s=timeout_s,
                                 memory_mb=MEMORY_MB, pass_fds=(requests_r, answers_w), quiet=True)
        judge = start_python(f"import harness\nharness.run_tests({requests_w}, {answers_r}, {stand_ins!r}, "
                             f"{modules!r}, {mark!r})\n",
                             files={"harness.py": HARNESS, "setup.py": setup, "tests.py": tests},
                             timeout_s=timeout_s, memory_mb=MEMORY_MB, pass_fds=(requests_w, answers_r))
    except BaseException:
        if candidate is not None:
            kill(candidate)
        raise
    finally:
        for fd in (requests_r, requests_w, answers_r, answers_w):
            os.close(fd)  # each side holds its own ends: one side's exit is the other's end of file
    try:
        result = finish(judge)
    finally:
        failure = kill(candidate)
    if failure:  # the candidate's jail did not hold: not the candidate's failure to score
        raise SandboxError(failure)
    return result.ok and result.stdout == f"{mark}\n"


def functions_to_write(tests: str, setup: str, entry_point: str = "") -> tuple[list[str], list[str]]:
    """(the names the tests call on the candidate's side, the standard library modules the tests' side imports).
    The first: setup's stubs (`is_stub`), the row's entry point, and the tests' other free names (read, never
    bound in them) that are neither built-ins, nor bound by setup, nor standard modules. A built-in's name is
    never the candidate's unless the row says so: a candidate that defines `abs` would pass `abs(f(x) - y) <
    eps` otherwise. The second: the tests' free names that are standard modules setup does not import (the
    candidate imported them, and `from solution import *` gave them to the tests)."""
    test_tree, setup_tree = ast.parse(tests, "tests"), ast.parse(setup, "setup")
    read = {n.id for n in ast.walk(test_tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stubs = {n.name for n in setup_tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_stub(n)}
    free = read - bound_names(test_tree) - (bound_names(setup_tree) - stubs)
    modules = {name for name in free if name in sys.stdlib_module_names} - stubs - {entry_point}
    written = (free - set(dir(builtins)) - modules) | stubs | ({entry_point} if entry_point else set())
    return sorted(written), sorted(modules)


def bound_names(tree: ast.AST) -> set[str]:
    """Every name a tree binds anywhere: assigned, defined, imported (a star import of a standard module: its
    public names), a parameter, an exception's name."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            names |= star_import(node.module or "")
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def star_import(module: str) -> set[str]:
    """The names `from module import *` binds; only a standard module's are known here without running the row."""
    if module.split(".")[0] not in sys.stdlib_module_names:
        raise ValueError(f"the row's setup or tests import * from {module!r}: name the imports (only a standard "
                         f"module's names are known without running the row)")
    imported = importlib.import_module(module)
    return set(getattr(imported, "__all__", [n for n in vars(imported) if not n.startswith("_")]))


def is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A def that computes nothing: a docstring, `pass`, `...` and imports (HumanEval/115 imports before its
    docstring)."""
    return all(isinstance(s, (ast.Pass, ast.Import, ast.ImportFrom))
               or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in fn.body)


def all_tests_pass(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """reward.user_fn: 1.0 when the response's code passes every test of its row (metadata["tests"]), else 0.0."""
    tests = metadata.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError(f"the row has no 'tests' column of Python code (its columns: {sorted(metadata)})")
    return float(passes(extract_code(response), tests, metadata.get("setup") or "",
                        entry_point=metadata.get("entry_point") or ""))
