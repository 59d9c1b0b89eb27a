"""Guess the number, a multi-turn game with feedback each turn: `env.fn = "rl.env.guess_number:make_env"`.

The row's answer is the secret, its `low` and `high` columns the range (1 and 100 when absent), `max_guesses` the
guesses allowed (7 when absent: enough for a binary search of 1..100, as `rows` gives each range). Each model turn
is a guess, its last whole number; the game answers "<n> is too low." or "<n> is too high." as a user turn, in
ChatML (the model's turn ended with its end-of-turn token, so no env.stop is needed), until the model names the
secret (reward 1) or runs out of guesses (reward 0). A turn without a number, or one outside the range, costs a
guess and is told so. A model learns to halve the range it was told; one that guesses at random finds the secret
in 7 guesses of 1..100 about 7% of the time. env.max_turns should be at least the rows' max_guesses.

Rows, offline: `python -m rl.env.guess_number DIR` writes DIR/train.jsonl and DIR/eval.jsonl (`rows`, seeded).
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"\d+")
PROMPT = ("Let's play a game. I have picked a whole number from {low} to {high}. Guess it: answer each turn with "
          "one number and nothing else, and I will tell you whether the secret is higher or lower. You have "
          "{max_guesses} guesses.")


def make_env(prompt: Any, label: Any, columns: dict) -> GuessNumber:
    return GuessNumber(int(label), int(columns.get("low", 1)), int(columns.get("high", 100)),
                       int(columns.get("max_guesses", 7)))


@dataclass
class GuessNumber:
    secret: int
    low: int = 1
    high: int = 100
    max_guesses: int = 7
    guesses: int = 0

    def step(self, text: str, tokens: list[int]) -> tuple[str, bool, float]:
        self.guesses += 1
        numbers = NUMBER.findall(text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            return "", True, 1.0
        if self.guesses >= self.max_guesses:
            return "", True, 0.0
        left = self.max_guesses - self.guesses
        if guess is None or not self.low <= guess <= self.high:
            feedback = f"That is not a number from {self.low} to {self.high}."
        else:
            feedback = f"{guess} is too {'low' if guess < self.secret else 'high'}."
        return user_turn(f"{feedback} {left} guess{'es' if left > 1 else ''} left."), False, 0.0


def user_turn(text: str) -> str:
    """What follows the model's turn (which ended with <|im_end|>) in ChatML: a user turn, then the assistant's."""
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def rows(n: int, seed: int, lows: range) -> list[dict]:
    """n games, drawn from `seed`: a range starting in `lows`, 20 to 200 numbers wide, guesses enough for a binary
    search of it, a secret in it; the prompt as a chat message, the secret as the answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        low = rng.choice(lows)
        high = low + rng.randint(19, 199)
        max_guesses = (high - low + 1).bit_length()
        prompt = PROMPT.format(low=low, high=high, max_guesses=max_guesses)
        out.append({"prompt": [{"role": "user", "content": prompt}], "answer": str(rng.randint(low, high)),
                    "low": low, "high": high, "max_guesses": max_guesses})
    return out


def write_rows(out: Path, train: int = 2000, eval_: int = 100) -> None:
    """DIR/train.jsonl and DIR/eval.jsonl; the eval's ranges start where no training range does, so that its
    prompts are held out (an eval prompt that is also a training prompt would be dropped)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, n, seed, lows in (("train", train, 0, range(1, 500)), ("eval", eval_, 1, range(500, 1000))):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(n, seed, lows))


if __name__ == "__main__":
    write_rows(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/train.jsonl and {sys.argv[1]}/eval.jsonl")
