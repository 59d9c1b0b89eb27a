"""Tool calls as Qwen and Hermes chat templates have instruct models write them, read the same way for every
built-in tool:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

A turn's last call counts (a call cut off by the end of the turn is read up to there); its JSON may sit in a code
fence, be followed by other text, and hold its arguments as a JSON string, as small models write them. A call
that cannot be read (not JSON, another tool's name, the argument missing or not a string) is the model's
mistake: `read_call` turns it into an error message the model sees as the tool's response, and the episode goes
on. A turn without a call is the final answer, scored by math-verify against the row's answer (`tool_step`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from rl.answers import math_correct

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
FENCE = re.compile(r"^\s*```[a-z]*\s*|\s*```\s*$")


class CallError(ValueError):
    """A call the tool cannot run; its message is what the model reads."""


def last_call(text: str) -> str | None:
    """The body of the turn's last <tool_call>, or None when the turn makes no call."""
    calls = CALL.findall(text)
    return calls[-1] if calls else None


def read_call(call: str, tool: str, argument: str) -> str:
    """The string argument `argument` of a call to `tool`; CallError, with a message for the model, otherwise."""
    body = FENCE.sub("", call).strip()  # a JSON object, or one inside a ```json fence
    try:
        request, _ = json.JSONDecoder().raw_decode(body)  # text after the object is not the call's
    except json.JSONDecodeError as e:
        raise CallError(f"error: the call is not JSON ({e.msg})") from None
    if not isinstance(request, dict) or request.get("name") != tool:
        raise CallError(f'error: the only tool is "{tool}"')
    arguments = request.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    value = arguments.get(argument) if isinstance(arguments, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise CallError(f'error: arguments must hold "{argument}", a string')
    return value


def tool_step(text: str, label: Any, tool: str, argument: str, run: Callable[[str], str],
              wrap: Callable[[str], str]) -> tuple[str, bool, float]:
    """One turn of a tool-using episode (rl/env.py's step): the final answer scored, or the last call answered
    (`run` on its argument, or the reading error) and `wrap`ped as the text to append."""
    call = last_call(text)
    if call is None:
        return "", True, math_correct(text, label)
    try:
        response = run(read_call(call, tool, argument))
    except CallError as e:
        response = str(e)
    return wrap(response), False, 0.0
