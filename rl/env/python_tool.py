"""A Python tool for math word problems: `env.fn = "rl.env.python_tool:make_env"`, `env.stop = ["</tool_call>"]`,
and SYSTEM_PROMPT as the rows' system prompt (it describes the tool as Qwen2.5's chat template does).

The model calls it as Qwen and Hermes chat templates have instruct models call tools (read by
rl/env/tool_calls.py, as the calculator's calls are):

    <tool_call>{"name": "python", "arguments": {"code": "print(48 / 2 + 48)"}}</tool_call>

Each call's code runs in rl/env/sandbox.py's jail: a fresh interpreter (nothing carries over from one call to the
next) that sees none of the host's files, processes or sockets, as nobody, TIMEOUT_S seconds of wall clock and of
CPU, MEMORY_MB of address space, a small disk of its own, no network, no new processes. The response is what the code printed; after an error, also the end of its traceback; after the
timeout, a line saying so; MAX_RESPONSE_CHARS at most. It is appended as Qwen2.5's template renders a tool
message, so that an instruct model reads it as it was trained to: the assistant's turn closed, a user turn
holding `<tool_response>...</tool_response>`, a new assistant turn opened. A call that cannot be read is the
model's mistake (an error message as the response); the episode ends at the first turn without a call, scored
by math-verify against the row's answer.

The same tool also takes its code as a Markdown block the model writes in its own turn (`make_code_block_env`,
`env.stop = ["```\n"]`, CODE_BLOCK_PROMPT as the system prompt), the tool-integrated reasoning format Qwen2.5-Math
was trained on and code models write unasked:

    ```python
    print(48 / 2 + 48)
    ```

The turn ends at the block's closing fence (rl/rollout/stop_text.py: the tokens that spell "```\n", however
the model split them), and the code's output follows in the same assistant turn as a block of its own,

    ```output
    72.0
    ```

after which the model goes on (another block, or the answer). A turn that its end-of-turn token closed right after
a block gets the output as the user's next message instead. A turn that ends without a Python block closing it is
the final answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rl.env.answers import math_correct
from rl.env.sandbox import SandboxResult, run_python
from rl.env.tool_calls import tool_step

TIMEOUT_S = 5.0  # per call, below env.timeout_s (10 s by default), which bounds the whole step
MEMORY_MB = 512
MAX_RESPONSE_CHARS = 1000  # of what a call appends: tool output is context the model's later turns pay for

TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Runs Python 3 code in a fresh interpreter and returns what it prints. Use print() to see "
                   "results; nothing is kept between calls.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code to run"}},
                   "required": ["code"]}}}
# Qwen2.5's chat template renders a system message and `tools` as this (tools need no template support then).
SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the math problem. Use the python tool to compute, then give the final "
    "answer in \\boxed{}.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{json.dumps(TOOL)}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


CODE_BLOCK_PROMPT = ("You are a helpful assistant. Solve the math problem with Python: write code in a ```python "
                     "block that prints what you need. It runs, and its output follows in a ```output block. Then "
                     "give the final answer in \\boxed{}.")
# A turn's last Python block, closed at the turn's end; the language tag as models write it.
CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)\n?[ \t]*```[ \t]*(\n?)\s*$", re.DOTALL)


def make_env(prompt: Any, label: Any, columns: dict) -> PythonTool:
    return PythonTool(label)


def make_code_block_env(prompt: Any, label: Any, columns: dict) -> PythonCodeBlocks:
    return PythonCodeBlocks(label)


@dataclass
class PythonTool:
    label: Any
    timeout_s: float = TIMEOUT_S
    memory_mb: int = MEMORY_MB

    def step(self, text: str, tokens: list[int]) -> tuple[str, bool, float]:
        return tool_step(text, self.label, "python", "code", self.run, chat_tool_response)

    def run(self, code: str) -> str:
        return respond(run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb), self.timeout_s)


@dataclass
class PythonCodeBlocks(PythonTool):
    """The tool called by a ```python block that ends the model's turn (module docstring)."""

    def step(self, text: str, tokens: list[int]) -> tuple[str, bool, float]:
        block = last_code_block(text)
        if block is None:
            return "", True, math_correct(text, self.label)
        code, turn_open = block
        output = f"```output\n{self.run(code)}\n```\n"
        if turn_open:  # stopped at the fence (env.stop): the output goes on in the model's turn
            return output, False, 0.0
        return f"\n<|im_start|>user\n{output}<|im_end|>\n<|im_start|>assistant\n", False, 0.0


def last_code_block(text: str) -> tuple[str, bool] | None:
    """(code, whether the turn is still open) of a Python block that ends the turn; None without one. The turn is
    open when a newline follows the fence: the turn stopped at "```\n" (env.stop) rather than at the model's
    end-of-turn token, which closes it right after "```" (a newline before it would have stopped it first)."""
    start = text.rfind("```py")
    match = CODE_BLOCK.match(text, start) if start >= 0 else None
    if match is None or "```" in match.group(1):
        return None
    return match.group(1), bool(match.group(2))


def respond(result: SandboxResult, timeout_s: float) -> str:
    """What the model reads after a call: the output, then what went wrong, if anything."""
    parts = [result.stdout.strip("\n")] if result.stdout.strip() else []
    if result.timed_out:
        parts.append(f"error: the code ran past {timeout_s:g} s and was stopped")
    elif result.exit_code != 0:
        parts.append(result.stderr.strip("\n") or f"error: exit code {result.exit_code}")
    elif not parts:
        parts = ["(no output: print() what you want to see)"]
    return clipped("\n".join(parts), MAX_RESPONSE_CHARS)


def clipped(text: str, limit: int) -> str:
    """The start and the end of a long text (an error's last line is at the end)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters ...]\n{text[-half:]}"


def chat_tool_response(response: str, turn_open: bool = True) -> str:
    """A tool message as Qwen2.5's chat template renders it, between the model's call and its next turn; the
    model's turn closed first unless its end-of-turn token already closed it (`turn_open` false)."""
    return (f"{'<|im_end|>' if turn_open else ''}\n<|im_start|>user\n<tool_response>\n{response}\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n")
