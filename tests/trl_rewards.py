"""Reward functions written as TRL's documentation writes them for GRPOTrainer's `reward_funcs`: keyword
arguments, a list of completions in, one float per completion out. Nothing here knows of `rl`."""

import asyncio
import re
from fractions import Fraction


def reward(completions, **kwargs):
    """Share of digits in each completion (chat format: a completion is a list holding one message)."""
    contents = [completion[0]["content"] for completion in completions]
    return [sum(ch.isdigit() for ch in content) / max(len(content), 1) for content in contents]


def answer_in_completion(completions, answer, **kwargs):
    """1.0 where the row's answer appears in the completion's text."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.search(re.escape(str(a)), c) else 0.0 for c, a in zip(contents, answer)]


# The shapes of the examples in TRL's GRPOTrainer documentation (written here anew): a function of the token ids,
# one of the text, one against a column, multi-task functions that pass (None) on the other task's rows, async
# functions, and functions reading `trainer_state` or logging through `log_metric` / `log_extra`.


def longer_is_better(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def think_then_answer(completions, **kwargs):
    """1.0 for a completion shaped <think>...</think><answer>...</answer>."""
    shape = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)
    return [1.0 if shape.match(completion[0]["content"]) else 0.0 for completion in completions]


def boxed_matches_solution(completions, solution, **kwargs):
    """1.0 where the completion's \\boxed{...} holds the row's solution."""
    found = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    return [1.0 if m is not None and m.group(1) == s else 0.0 for m, s in zip(found, solution)]


def math_task(completions, task, solution, **kwargs):
    """Scores the math rows only; None on the others."""
    return [None if t != "math" else float(s in c[0]["content"]) for c, t, s in zip(completions, task, solution)]


def digits_unless_empty(completions, **kwargs):
    """1.0 for a completion holding a digit, 0.0 for one without; None (no opinion) for an empty one."""
    contents = [completion[0]["content"] for completion in completions]
    return [None if not c else float(any(ch.isdigit() for ch in c)) for c in contents]


def code_task(completions, task, **kwargs):
    """Scores the code rows only (a fenced block is worth 1); None on the others."""
    return [None if t != "code" else float("```" in c[0]["content"]) for c, t in zip(completions, task)]


MET: dict = {}  # the async functions of one call, by the call's `completions` list: which have started


async def meets(name, other, completions):
    """1.0 when the `other` function started while this one waited (the two ran concurrently), else 0.0."""
    started = MET.setdefault(id(completions), set())
    started.add(name)
    for _ in range(1000):
        if other in started:
            return [1.0] * len(completions)
        await asyncio.sleep(0)
    return [0.0] * len(completions)


async def async_judge(completions, **kwargs):
    return await meets("judge", "checker", completions)


async def async_checker(completions, **kwargs):
    return await meets("checker", "judge", completions)


def curriculum(completions, trainer_state, **kwargs):
    """Length pays more as training goes on: the share of the run's steps taken, times the completion's length."""
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress * len(completion[0]["content"]) for completion in completions]


def logs_what_it_sees(completions, trainer_state, log_metric, log_extra, **kwargs):
    """Logs the step, the epoch and the mean length, and each completion's length as a column; scores nothing."""
    lengths = [len(completion[0]["content"]) for completion in completions]
    log_metric("global_step", trainer_state.global_step)
    log_metric("epoch", trainer_state.epoch)
    log_metric("mean_length", sum(lengths) / len(lengths))
    log_extra("length", lengths)
    log_extra("half", [Fraction(n, 2) for n in lengths])  # no JSON type: the dumps hold its number
    log_extra("shape", [{n} for n in lengths])  # nor this: its text
    return [None] * len(completions)


def get_overlong_penalty(max_completion_len, soft_punish_cache):
    """A factory, as TRL's get_soft_overlong_punishment: 0 up to max - cache tokens, then down to -1 at max and -1
    past it."""
    free = max_completion_len - soft_punish_cache

    def overlong_penalty(completion_ids, **kwargs):
        lengths = [len(ids) for ids in completion_ids]
        return [0.0 if n <= free else -1.0 if n > max_completion_len else (free - n) / soft_punish_cache
                for n in lengths]

    return overlong_penalty


async def bad_helper_use(completions, kind, log_metric, log_extra, **kwargs):
    """Misuses a helper, or raises, by the row's `kind`."""
    if kind[0] == "metric":
        log_metric("m", "high")
    elif kind[0] == "extra":
        log_extra("c", [1])
    else:
        raise ValueError("async failure")
    return [0.0] * len(completions)
