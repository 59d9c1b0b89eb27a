"""Scoring one prompt's group at once: TRL-style batched reward functions and the group hook.

Owns the calling conventions of `reward.functions` and `reward.group_fn`; `RewardPool` sends each prompt's
group to a worker, which calls `score_group`. A batched function is called as TRL's GRPOTrainer calls one:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=..., log_metric=...,
       log_extra=..., **columns) -> list[float | None]

one entry per response: `prompts` as the rows hold them, `completions` as strings, or for chat-format prompts
as one assistant message each (`[{"role": "assistant", "content": text}]`), and every other column of the
rows as a keyword list (`answer=[...]`). `trainer_state` is rl.env.reward.TrainerState (global_step, max_steps,
epoch); `log_metric(name, value)` logs reward/logged/<name> (the step's calls averaged), `log_extra(column,
values)` one value per completion into the sample dumps. An `async def` function (or one returning an awaitable)
is awaited; the async functions of one call run concurrently, on one event loop per worker that lives as long
as the worker. A "pkg.module:factory(key=value, ...)" entry is the function its factory returns. The group hook
sees one group, with the same helpers:

    group_fn(prompt=..., completions=[...], completion_ids=[...], trainer_state=..., log_metric=...,
             log_extra=..., **the row's columns) -> list[float | None]

How it departs from TRL, which calls each function once on the whole batch: here a function is called once per
prompt group, so that a function that raises or hangs costs that group (0.0 for each of its responses, counted)
and not the step. A function must score each response on its own; a scorer that compares a group's
responses (a judge ranking them, a reward model normalising within the group) is the group hook, whose call
is guaranteed to hold exactly one group; a value given to log_metric is one call's, that is one group's, and the
step logs the mean of its calls. As in TRL, None means "not mine to score" (a task another function scores): it
adds nothing to the weighted sum and is left out of that function's mean; a response every function passes on
has no reward at all (rl.env.reward.gather: NaN, advantage 0).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from rl.config import RewardConfig
from rl.env.reward import RewardInput, TrainerState, combine_terms, function_names, function_weights, real_number
from rl.functions import load_function


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


@dataclass
class CallLog:
    """What the functions of one call log through TRL's helpers: `metric` (log_metric) and `extra` (log_extra)."""

    count: int  # completions in the call
    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def metric(self, name: str, value: float) -> None:
        number = real_number(value)
        if not isinstance(name, str) or number is None or not math.isfinite(number):
            raise TypeError(f"log_metric(name, value) takes a name and a finite number, got {name!r}, {value!r:.100}")
        self.metrics.setdefault(name, []).append(number)

    def extra(self, column: str, values: list) -> None:
        if not isinstance(column, str) or isinstance(values, (str, bytes)) or len(values) != self.count:
            raise ValueError(f"log_extra(column, values) takes a name and one value per completion ({self.count}), "
                             f"got {column!r} and {values!r:.100}")
        self.columns[column] = [plain(value) for value in values]


def plain(value: Any) -> Any:
    """A log_extra value as the sample dumps can write it: text, a bool or a number as they are, a numpy or torch
    scalar as its number, anything else as its text."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    number = real_number(value)
    return number if number is not None else str(value)


@functools.cache  # one loop per worker, for its life: an async client a function keeps stays on its loop
def event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop()


async def noted(awaitable: Any, what: str) -> Any:
    try:
        return await awaitable
    except Exception as e:
        e.add_note(f"in {what}")
        raise


def call_functions(inputs: list[RewardInput], cfg: RewardConfig, state: TrainerState, log: CallLog
                   ) -> list[list[float | None]]:
    """Each batched function's values, then the group hook's, in `function_names` order; the async ones awaited
    together once the others have run, as TRL awaits them."""
    helpers = {"trainer_state": state, "log_metric": log.metric, "log_extra": log.extra}
    kwargs = {**batched_kwargs(inputs), **helpers}
    calls = [(f"reward.functions {path}", load_function(path, "reward.functions"), kwargs) for path in cfg.functions]
    if cfg.group_fn:
        first = inputs[0]  # every input of a group holds the same row
        calls.append((f"reward.group_fn {cfg.group_fn}", load_function(cfg.group_fn, "reward.group_fn"),
                      {**first.columns, "prompt": first.raw_prompt, "completions": kwargs["completions"],
                       "completion_ids": kwargs["completion_ids"], **helpers}))
    returned = []
    for what, fn, arguments in calls:
        try:
            returned.append(fn(**arguments))
        except Exception as e:
            e.add_note(f"in {what}")  # the failure log names the function
            raise
    waiting = [i for i, r in enumerate(returned) if inspect.isawaitable(r)]
    if waiting:
        async def together() -> list:
            return await asyncio.gather(*(noted(returned[i], calls[i][0]) for i in waiting), return_exceptions=True)
        for i, result in zip(waiting, event_loop().run_until_complete(together())):
            if isinstance(result, BaseException):
                raise result
            returned[i] = result
    return [checked_values(r, len(inputs), what) for r, (what, _, _) in zip(returned, calls)]


def score_group(inputs: list[RewardInput], cfg: RewardConfig, state: TrainerState | None = None
                ) -> list[dict[str, Any]]:
    """The terms of each response of one group: their weighted sum as "correct", the format and length terms,
    the total under "reward", under "functions" each function's value (None where it passed), under "extra" what
    log_extra gave it, and on the first response under "logged" the call's log_metric values."""
    weights = function_weights(cfg)
    names = function_names(cfg)
    log = CallLog(len(inputs))
    per_function = call_functions(inputs, cfg, state or TrainerState(), log)
    scored = []
    for i, inp in enumerate(inputs):
        mine = [values[i] for values in per_function]
        correct = sum(w * v for w, v in zip(weights, mine) if v is not None)
        scored.append({**combine_terms(correct, inp, cfg), "functions": dict(zip(names, mine)),
                       "extra": {column: values[i] for column, values in log.columns.items()}})
    if scored:
        scored[0]["logged"] = log.metrics
    return scored
