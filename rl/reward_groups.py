"""Scoring one prompt's group at once: TRL-style batched reward functions and the group hook.

Owns the calling conventions of `reward.functions` and `reward.group_fn`; `RewardPool` sends each prompt's
group to a worker, which calls `score_group`. A batched function is called as TRL's GRPOTrainer calls one:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

one entry per response: `prompts` as the rows hold them, `completions` as strings, or for chat-format prompts
as one assistant message each (`[{"role": "assistant", "content": text}]`), and every other column of the
rows as a keyword list (`answer=[...]`). TRL's `trainer_state` is not passed. The group hook sees one group:

    group_fn(prompt=..., completions=[...], completion_ids=[...], **the row's columns) -> list[float | None]

How it departs from TRL, which calls each function once on the whole batch: here a function is called once per
prompt group, so that a function that raises or hangs costs that group (0.0 for each of its responses, counted)
and not the step. A function must score each response on its own; a scorer that compares a group's
responses (a judge ranking them, a reward model normalising within the group) is the group hook, whose call
is guaranteed to hold exactly one group. As in TRL, None means "not mine to score" (a task another function
scores): it adds nothing to the weighted sum and is left out of that function's mean.
"""

from __future__ import annotations

import math
from typing import Any

from rl.config import RewardConfig
from rl.reward import RewardInput, combine_terms, function_names, load_function, real_number


def completion_of(inp: RewardInput) -> Any:
    """The response as TRL hands it over: text for a text prompt, one assistant message for a chat prompt."""
    if isinstance(inp.raw_prompt, list):
        return [{"role": "assistant", "content": inp.response}]
    return inp.response


def batched_kwargs(inputs: list[RewardInput]) -> dict[str, list]:
    """The keyword lists of a batched call. Columns come first so that a column named like an argument of
    ours (say `completions`) cannot replace it."""
    names = dict.fromkeys(name for inp in inputs for name in inp.columns)
    columns = {name: [inp.columns.get(name) for inp in inputs] for name in names}
    return {**columns, "prompts": [inp.raw_prompt for inp in inputs],
            "completions": [completion_of(inp) for inp in inputs],
            "completion_ids": [list(inp.completion_ids) for inp in inputs]}


def checked_values(returned: Any, count: int, what: str) -> list[float | None]:
    """`returned` as `count` finite floats or None; anything else raises, naming the function."""
    if isinstance(returned, (str, bytes, dict)) or not hasattr(returned, "__len__"):
        raise TypeError(f"{what} returned {type(returned).__name__} {returned!r:.200}, expected a list of floats")
    if len(returned) != count:
        raise ValueError(f"{what} returned {len(returned)} values for {count} completions")
    values = []
    for value in returned:
        number = None if value is None else real_number(value)
        if value is not None and (number is None or not math.isfinite(number)):
            raise TypeError(f"{what} returned {type(value).__name__} {value!r:.200} among its values, expected a "
                            f"finite float or None")
        values.append(number)
    return values


def call_functions(inputs: list[RewardInput], cfg: RewardConfig) -> list[list[float | None]]:
    """Each batched function's values, then the group hook's, in `function_names` order."""
    kwargs = batched_kwargs(inputs)
    values = []
    for path in cfg.functions:
        returned = load_function(path, "reward.functions")(**kwargs)
        values.append(checked_values(returned, len(inputs), f"reward.functions {path}"))
    if cfg.group_fn:
        first = inputs[0]  # every input of a group holds the same row
        returned = load_function(cfg.group_fn, "reward.group_fn")(
            **first.columns, prompt=first.raw_prompt, completions=kwargs["completions"],
            completion_ids=kwargs["completion_ids"])
        values.append(checked_values(returned, len(inputs), f"reward.group_fn {cfg.group_fn}"))
    return values


def score_group(inputs: list[RewardInput], cfg: RewardConfig) -> list[dict[str, float | None]]:
    """The terms of each response of one group: their weighted sum as "correct", the format and length terms,
    the total under "reward", and under "functions" each function's value (None where it passed)."""
    weights = [*(cfg.function_weights or [1.0] * len(cfg.functions)), *([cfg.group_weight] if cfg.group_fn else [])]
    names = function_names(cfg)
    per_function = call_functions(inputs, cfg)
    scored = []
    for i, inp in enumerate(inputs):
        mine = [values[i] for values in per_function]
        correct = sum(w * v for w, v in zip(weights, mine) if v is not None)
        scored.append({**combine_terms(correct, inp, cfg), "functions": dict(zip(names, mine))})
    return scored
