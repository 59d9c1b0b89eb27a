"""Environments for tests/test_env.py, made in the reward workers by `env.fn`."""

import time
from dataclasses import dataclass


@dataclass
class Counting:
    """Answers each turn with " result <n>" and ends after `turns` steps; the reward is the steps taken."""

    turns: int = 2
    steps: int = 0

    def step(self, text, tokens):
        self.steps += 1
        return f" result {self.steps}", self.steps >= self.turns, float(self.steps)


def counting(prompt, label, columns):
    return Counting()


def counting_ids(prompt, label, columns):
    return CountingIds()


@dataclass
class CountingIds(Counting):
    """Counting, with what it appends as token ids."""

    def step(self, text, tokens):
        _, done, reward = super().step(text, tokens)
        return [self.steps, 30], done, reward


@dataclass
class Faulty:
    """Fails as its row's label says: raises, hangs, returns garbage, ids past the vocabulary or text with a lone
    surrogate (no UTF-8 for it, so no tokenizer takes it); else goes on."""

    label: str

    def step(self, text, tokens):
        if self.label == "raise":
            raise RuntimeError("the environment broke")
        if self.label == "hang":
            time.sleep(600)
        if self.label == "garbage":
            return "not a tuple"
        if self.label == "bad_ids":
            return [10**9], False, 0.0
        if self.label == "surrogate":
            return " result \ud800", False, 1.0
        return " ok", False, 1.0


def faulty(prompt, label, columns):
    return Faulty(label)


@dataclass
class Appending:
    """Appends text after every turn and never ends: the episode runs until a limit; the reward is the parity of
    the turn's length, so groups differ."""

    def step(self, text, tokens):
        return " 1 + 1 =", False, float(len(tokens) % 2)


def appending(prompt, label, columns):
    return Appending()


def clock(prompt, label, columns):
    return Clock()


class Clock:
    """Ends at its first step, with the wall-clock time the step ran as its reward."""

    def step(self, text, tokens):
        return "", True, time.time()
