"""What the policy acts on: reward functions and their workers (reward.py, groups.py, worker.py), the sandbox for
model-written code (sandbox.py, jail.py, code_*.py), and environments, whose protocol is here: multi-turn episodes
in which the model's turns alternate with an environment's (built-in ones: python_tool.py, calculator.py,
guess_number.py).

An environment is user code named by `env.fn = "pkg.module:make_env"`, called once per episode with the row
it starts from, and returning an episode: any picklable object with

    step(text, tokens) -> (append, done, reward)

`text`/`tokens`: the model's latest turn (decoded, and the ids the engine sampled). `append`: what follows it
in the sequence, as text (tokenized once, on its own, never re-templating what came before) or as token ids;
`done`: whether the episode ended; `reward`: the episode's reward (the last step's counts, also when a limit
cuts the episode short).

How it departs from a gym loop held in one process: episodes live in the reward workers (rl/env/worker.py)
and no worker holds one between steps. Each step ships the pickled episode to whichever worker is free and
takes it back pickled, so a step that raises, hangs past `env.timeout_s` or returns garbage ends only its own
episode (reward 0, counted) and the trainer never runs, or even imports, environment code. This module is
what a worker needs: the standard library and nothing of the trainer.
"""

from __future__ import annotations

import math
import numbers
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class EnvStep:
    """One step of one episode, sent to a worker; `episode` None: the first step, which makes the episode."""

    prompt: Any  # the row's prompt as the row holds it (text or chat messages)
    label: Any
    columns: dict = field(default_factory=dict)
    episode: bytes | None = None
    text: str = ""
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class EnvOutcome:
    episode: bytes  # the episode after the step, pickled
    append: str | list[int]
    done: bool
    reward: float


def step_episode(step: EnvStep, make_env: Callable[..., Any]) -> EnvOutcome:
    """Runs one step in a worker; anything but (str | list[int], bool, finite float) raises, naming the fault."""
    if step.episode is None:
        episode = make_env(prompt=step.prompt, label=step.label, columns=step.columns)
    else:
        episode = pickle.loads(step.episode)
    returned = episode.step(step.text, list(step.tokens))
    if not isinstance(returned, tuple) or len(returned) != 3:
        raise TypeError(f"env step returned {type(returned).__name__} {returned!r:.200}, expected (append, done, "
                        f"reward)")
    append, done, reward = returned
    if not (isinstance(append, str) or isinstance(append, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in append)):
        raise TypeError(f"env step returned append={append!r:.200}, expected text or a list of token ids")
    if isinstance(append, str) and not encodable(append):  # a lone surrogate ("\ud800"): no tokenizer takes it
        raise ValueError(f"env step returned append={append!r:.200}, text that is not valid Unicode (a lone "
                         f"surrogate has no UTF-8)")
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"env step returned reward={reward!r:.200}, expected a finite float")
    return EnvOutcome(pickle.dumps(episode), append, bool(done), float(reward))


def encodable(text: str) -> bool:
    """Whether `text` has a UTF-8 encoding, which tokenizers need (Python strings may hold lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
