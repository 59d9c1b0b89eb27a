"""Reward functions written as TRL's documentation writes them for GRPOTrainer's `reward_funcs`: keyword
arguments, a list of completions in, one float per completion out. Nothing here knows of `rl`."""

import re


def reward(completions, **kwargs):
    """Share of digits in each completion (chat format: a completion is a list holding one message)."""
    contents = [completion[0]["content"] for completion in completions]
    return [sum(ch.isdigit() for ch in content) / max(len(content), 1) for content in contents]


def answer_in_completion(completions, answer, **kwargs):
    """1.0 where the row's answer appears in the completion's text."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.search(re.escape(str(a)), c) else 0.0 for c, a in zip(contents, answer)]
