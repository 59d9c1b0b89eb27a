"""Reward functions named by import path in tests/test_reward.py; spawned workers import them."""

import os
import time
import zlib


def exact(prompt, response, label, metadata):
    return 1.0 if response.strip() == str(label) else 0.0


def by_kind(prompt, response, label, metadata):
    """Behaves as metadata["kind"] says: "good" scores exact match, "raise", "hang", "die" or "none" misbehave."""
    kind = metadata.get("kind", "good")
    if kind == "raise":
        raise ZeroDivisionError(f"bad input {response!r}")
    if kind == "hang":
        time.sleep(1000)
    if kind == "die":
        os._exit(3)
    if kind == "none":
        return None
    return exact(prompt, response, label, metadata)


def value_of(prompt, response, label, metadata):
    """Returns metadata["value"] as it is: any type a reward function might return."""
    return metadata["value"]


def raise_on_odd_label(prompt, response, label, metadata):
    """1.0 for an even label; raises for an odd one, so a known share of inputs fails."""
    if int(label) % 2:
        raise ValueError(f"odd label {label}")
    return 1.0


def digit_fraction(prompt, response, label, metadata):
    """A dense reward that random tiny models already vary on: the share of digits in the response."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def spread(prompt, response, label, metadata):
    """A reward no two different responses share (a hash of the text): every group has signal, so every sample
    trains (benchmarks/speed.py's full seed batch, where digit_fraction leaves random weights' groups flat)."""
    return zlib.crc32(response.encode()) / 2**32


def flat_on_multiples_of_4(prompt, response, label, metadata):
    """Zero for every response to a prompt whose answer is a multiple of 4 (a group a dynamic filter drops)."""
    return 0.0 if int(label) % 4 == 0 else digit_fraction(prompt, response, label, metadata)


def trainer_modules(prompt, response, label, metadata):
    """1.0 in a worker that imported nothing of the trainer; else raises, naming what it found."""
    import sys

    found = sorted(name for name in ("torch", "transformers", "rl.main") if name in sys.modules)
    if found:
        raise ImportError(f"reward worker imported {found}")
    return 1.0


def allocate(prompt, response, label, metadata):
    """Allocates metadata["mb"] MB and touches every page, then scores exact match."""
    block = bytearray(metadata["mb"] * 2**20)
    block[:: 4096] = b"x" * len(block[:: 4096])
    return exact(prompt, response, label, metadata)


def chatty(prompt, response, label, metadata):
    """Prints metadata["lines"] lines to stdout, stderr and straight to fd 1, then scores exact match."""
    import sys

    for i in range(metadata["lines"]):
        print(f"chatty {response} stdout {i}")
        print(f"chatty {response} stderr {i}", file=sys.stderr)
    os.write(1, f"chatty {response} fd1\n".encode())
    return exact(prompt, response, label, metadata)


def wrong_signature(text):
    """A reward function written for another trainer's calling convention: fails on every input."""
    return float(bool(text))


def slow_on_eval(prompt, response, label, metadata):
    """digit_fraction, but an eval row (metadata kind "eval") first appends a line to the file $EVAL_MARK and
    takes 0.3 s: a window for a test to signal the run during an eval."""
    if metadata.get("kind") == "eval":
        with open(os.environ["EVAL_MARK"], "a") as f:
            f.write("scored\n")
        time.sleep(0.3)
    return digit_fraction(prompt, response, label, metadata)


# ---------------------------------------------------------------------------- TRL-style batched functions

CALLS: list[dict] = []  # what `record` was called with, for tests that score in-process


def record(**kwargs):
    """Keeps its keyword arguments in CALLS and scores each completion by its number of token ids."""
    CALLS.append(kwargs)
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def from_column(completions, score, **kwargs):
    """The row's `score` column as the reward: a number, or None where the row has none."""
    return list(score)


def batched_by_kind(completions, kind, **kwargs):
    """Behaves as the rows' `kind` column says: "raise", "hang" or "short" (one value too few) misbehave for the
    whole batch; otherwise the share of digits in each completion."""
    if "raise" in kind:
        raise ZeroDivisionError(f"bad batch of {len(completions)}")
    if "hang" in kind:
        time.sleep(1000)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    values = [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]
    return values[:-1] if "short" in kind else values


def longest_in_group(prompt, completions, answer, **kwargs):
    """A group hook: 1.0 for the group's longest completions, 0.0 for the others; checks it was handed one row's
    prompt and answer, not lists of them."""
    if isinstance(answer, list) or not isinstance(prompt, (str, list)):
        raise TypeError(f"handed lists: prompt={prompt!r} answer={answer!r}")
    lengths = [len(c) for c in completions]
    return [float(n == max(lengths)) for n in lengths]


def runs_in_the_barrier(prompt, response, label, metadata):
    """1.0 when the sandbox of this worker runs code behind the barrier (reward.sandbox reached it), else 0.0."""
    from rl.env import sandbox

    return 1.0 if sandbox.isolation() == "barrier" else 0.0
