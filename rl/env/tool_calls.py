"""Tool calls as Qwen and Hermes chat templates have instruct models write them, read the same way for every
built-in tool:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

A turn's last call counts (a call cut off by the end of the turn is read up to there); its JSON may sit in a code
fence, be followed by other text, and hold its arguments as a JSON string, as small models write them. A turn
without the tags calls the tool when it holds a JSON object that names the tool, in a code fence or as the whole
turn: Qwen2.5-Coder-1.5B-Instruct, given Qwen's tool prompt, wrote 4 of 32 sampled first turns so and none with
the tags. A call
that cannot be read (not JSON, another tool's name, the argument missing or not a string) is the model's
mistake: `read_call` turns it into an error message the model sees as the tool's response, and the episode goes
on. A turn without a call is the final answer, scored by math-verify against the row's answer (`tool_step`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from rl.env.answers import math_correct

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
FENCE = re.compile(r"^\s*```[a-z]*\s*|\s*```\s*$")
JSON_BLOCK = re.compile(r"```(?:json)?\s*([{\[].*?)\s*```", re.DOTALL)


class CallError(ValueError):
    """A call the tool cannot run; its message is what the model reads."""


def last_call(text: str, tool: str) -> str | None:
    """The body of the turn's last <tool_call>; without one, the last JSON call naming `tool` written without the
    tags (in a code fence, or as the whole turn); None when the turn makes no call."""
    calls = CALL.findall(text)
    if calls:
        return calls[-1]
    for body in reversed([text, *JSON_BLOCK.findall(text)]):
        try:
            request = first_object(body)
        except json.JSONDecodeError:
            continue
        if isinstance(request, dict) and request.get("name") == tool:
            return body
    return None


def first_object(body: str) -> Any:
    """The first JSON value of a call's body (fences and trailing text aside); a list of one call is that call."""
    request, _ = json.JSONDecoder().raw_decode(FENCE.sub("", body).strip())
    return request[0] if isinstance(request, list) and len(request) == 1 else request


def read_call(call: str, tool: str, argument: str) -> str:
    """The string argument `argument` of a call to `tool`; CallError, with a message for the model, otherwise."""
    try:
        request = first_object(call)
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
              wrap: Callable[[str, bool], str]) -> tuple[str, bool, float]:
    """One turn of a tool-using episode (rl/env/__init__.py's step): the final answer scored, or the last call answered
    (`run` on its argument, or the reading error) and `wrap`ped as the text to append. `wrap`'s second argument:
    whether the model's turn is still open (it stopped at </tool_call>, env.stop) rather than ended by the model's
    end-of-turn token, as a call written without the tags ends."""
    call = last_call(text, tool)
    if call is None:
        return "", True, math_correct(text, label)
    try:
        response = run(read_call(call, tool, argument))
    except CallError as e:
        response = str(e)
    return wrap(response, text.rstrip().endswith("</tool_call>")), False, 0.0
