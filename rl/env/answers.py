"""Answers and the built-in reward terms: pure functions of one response, imported by the reward workers.

`extract_answer` finds a response's final answer (the last `\\boxed{}`, else what follows `####`, else the
last number); `math_correct` checks it against the label with math_verify, which also reads the answer out of
a label that is a whole solution (GSM8K's "#### 72", MATH's `\\boxed{}`); `format_score` is a regex match and
`length_penalty` DAPO's soft overlong punishment. Standard library only at import: math_verify and sympy load
on the first check, so a worker scoring with the user's functions never pays for them.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# ---------------------------------------------------------------------------- answers


def find_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` or `\\fbox{...}`, nested braces included."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):  # a truncated response may leave the last box open
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                content = text[start:i].strip()
                if content:
                    return content
                break
    return None


def clean_number(text: str) -> str:
    """'1,234.' -> '1234': drops a trailing period and thousands separators of a plain number."""
    text = text.strip().rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    return text


def find_last_number(text: str) -> str | None:
    # A minus only counts when it is not a binary minus ("3-5" ends in 5, not -5).
    pattern = r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    numbers_found = re.findall(pattern, text)
    return clean_number(numbers_found[-1]) if numbers_found else None


def extract_answer(text: str) -> str | None:
    """The final answer: last `\\boxed{}`, else what follows the last `####`, else the last number."""
    boxed = find_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        after = clean_number(text.rsplit("####", 1)[1].strip().split("\n", 1)[0])
        if after:
            return after
    return find_last_number(text)


# ---------------------------------------------------------------------------- terms


def normalize_text(text: str) -> str:
    return re.sub(r"\s+", "", clean_number(str(text))).strip("$").lower()


def parse_math(text: str, timeout_s: int | None) -> list:
    """math_verify's parse of a bare answer: `$...$` makes it read as LaTeX, not as prose."""
    from math_verify import parse  # imported here so the parent and user-fn workers never pay for sympy

    if "$" not in text:
        parsed = parse(f"${text}$", parsing_timeout=timeout_s)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=timeout_s)


def math_correct(response: str, label: Any) -> float:
    """1.0 if the response's final answer equals `label` under math_verify, else 0.0. A label may be a whole
    solution: math_verify finds GSM8K's "#### 72" and MATH's \\boxed{} answer in it."""
    from math_verify import verify

    answer = extract_answer(response)
    if answer is None:
        return 0.0
    gold_text = clean_number(str(label))
    # math_verify times itself out with SIGALRM, which only the main thread may set;
    # elsewhere the caller (RewardPool) is the one bounding the time.
    timeout_s = 5 if threading.current_thread() is threading.main_thread() else None
    gold, pred = parse_math(gold_text, timeout_s), parse_math(answer, timeout_s)
    if not gold or not pred:
        return float(normalize_text(gold_text) == normalize_text(answer))
    return float(verify(gold, pred, timeout_seconds=timeout_s))


def format_score(response: str, pattern: str) -> float:
    return float(re.search(pattern, response, re.DOTALL) is not None)


def length_penalty(response_length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 up to max - buffer, a linear ramp to -1 at max."""
    if response_length >= max_new_tokens:
        return -1.0  # checked first so buffer=0 still punishes a truncated response
    start = max_new_tokens - buffer
    if response_length <= start:
        return 0.0
    return -(response_length - start) / buffer
