"""The code task's reward: the response's code runs against its row's unit tests in the sandbox (rl/sandbox.py).

    reward.user_fn = "rl.code_reward:all_tests_pass"

A row holds `tests`, Python run after the candidate's code (asserts, or HumanEval's `def check(...)` and its
call), and may hold `setup`, code placed before the candidate's: the imports and helper functions the problem's
statement defines, as HumanEval's prompts do, so that a response that leaves them out still runs. The response's
code is its fenced ```python blocks (bare ``` ones too) joined in order, or the whole response when it has none;
an unclosed last block (a truncated response) counts up to the end.

The candidate is imported as a module (solution.py: setup, then its code), so an `if __name__ == "__main__":`
block of its own does not run, and the tests run as the main program after `from solution import *`. The score
is all-pass: 1.0 when that program runs to its end (a mark printed after the tests: what the program prints past
the sandbox's 64 KB is dropped, the mark with it) and exits 0 within TIMEOUT_S seconds, else 0.0 (a wrong answer,
an exception, a syntax error, an exit before the tests, a hang, a crash, memory past MEMORY_MB). Not the fraction
of tests passed: HumanEval's tests are one function of asserts that stops at the first failure.

The sandbox's wall-clock limit sits inside the reward worker's (`reward.timeout_s`, which should exceed TIMEOUT_S
by a few seconds of interpreter start-up): a response that hangs scores 0 here and its worker goes on, instead of
the worker being killed and replaced and the response counted as a timeout. Standard library only, like the
worker that imports it.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from rl.sandbox import run_python

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


def passes(code: str, tests: str, setup: str = "", timeout_s: float = TIMEOUT_S) -> bool:
    """Whether `tests` run to their end against `code` (imported as solution.py after `setup`). The end is a
    mark printed after the last test, drawn afresh for each call, so code that exits 0 before the tests run
    (`sys.exit(0)` or `os._exit(0)` on import) fails."""
    mark = secrets.token_hex(16)
    solution = f"{setup}\n\n{code}\n" if setup else f"{code}\n"
    result = run_python(f"from solution import *\n\n{tests}\n\nprint({mark!r})\n", files={"solution.py": solution},
                        timeout_s=timeout_s, memory_mb=MEMORY_MB)
    return result.ok and mark in result.stdout


def all_tests_pass(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """reward.user_fn: 1.0 when the response's code passes every test of its row (metadata["tests"]), else 0.0."""
    tests = metadata.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError(f"the row has no 'tests' column of Python code (its columns: {sorted(metadata)})")
    return float(passes(extract_code(response), tests, metadata.get("setup") or ""))
