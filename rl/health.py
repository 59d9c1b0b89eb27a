"""Run health: faults the loop survives but counts, faults that stop it, and loud warnings.

Reads each step's flat metrics row (never tensors) and keeps a few counters across
steps, which a checkpoint saves with the run:
- optimizer steps skipped for a non-finite loss or grad norm (`train.max_bad_steps` in a
  row stop the run);
- steps in which every reward failed (`reward.max_failed_steps` in a row stop the run);
- warnings, each one line naming the metric, its value and what was expected, counted in
  `health/warnings`: the entropy collapsing to zero or rising to uniform, the grad norm
  staying at zero while advantages are not.
A stop raises `RunStopped`: one line for the user, no traceback, a non-zero exit.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from rl.parallel import print0


class RunStopped(RuntimeError):
    """A fault the run cannot continue past; its message is the one line the user sees."""


class Health:
    def __init__(self, max_bad_steps: int, max_failed_steps: int, vocab_size: int, state: dict[str, Any] | None = None):
        self.max_bad_steps, self.max_failed_steps = max_bad_steps, max_failed_steps
        self.uniform_entropy = math.log(vocab_size)
        self.bad_steps = 0  # optimizer steps skipped in a row
        self.failed_steps = 0  # rollout steps in a row where every reward failed
        self.zero_grad_steps = 0
        self.first_entropy: float | None = None
        self.warnings: collections.Counter[str] = collections.Counter()
        if state:
            self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": self.bad_steps, "failed_steps": self.failed_steps, "zero_grad_steps": self.zero_grad_steps,
                "first_entropy": self.first_entropy, "warnings": dict(self.warnings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_steps, self.failed_steps = state["bad_steps"], state["failed_steps"]
        self.zero_grad_steps, self.first_entropy = state["zero_grad_steps"], state["first_entropy"]
        self.warnings = collections.Counter(state["warnings"])

    def after_rewards(self, scored: int, failed: int) -> None:
        """Every reward of a step failing (raised, timed out, worker died) is survivable a few times."""
        self.failed_steps = self.failed_steps + 1 if scored and failed == scored else 0
        if self.failed_steps >= self.max_failed_steps:
            raise RunStopped(f"reward: every reward failed in {self.failed_steps} steps in a row "
                             f"(reward.max_failed_steps={self.max_failed_steps}); the reward warnings above show the "
                             f"error; check reward.user_fn")

    def after_train(self, row: dict[str, Any], steps: int) -> None:
        """Counts skipped steps (the streak crosses rollouts) and warns on a stuck or collapsed policy."""
        skipped, trailing = int(row["train/skipped_steps"]), int(row["train/trailing_skipped_steps"])
        self.bad_steps = self.bad_steps + skipped if skipped == steps else trailing
        if skipped:
            self.warn("train/skipped_steps", skipped, "0 (a non-finite loss or grad norm: the step was skipped)")
        if self.bad_steps >= self.max_bad_steps:
            raise RunStopped(f"train: {self.bad_steps} optimizer steps in a row had a non-finite loss or grad norm "
                             f"(loss={row['train/loss']}, grad_norm={row['train/grad_norm']}; train.max_bad_steps="
                             f"{self.max_bad_steps}); they were skipped, so the weights are those of the last finite "
                             f"step. Lower train.lr or check the rewards and data")
        entropy, grad_norm = row["train/entropy"], row["train/grad_norm"]
        if skipped == steps or not math.isfinite(entropy):
            return
        if self.first_entropy is None:
            self.first_entropy = entropy
        if entropy >= 0.999 * self.uniform_entropy:  # even a random init is below this
            self.warn("train/entropy", entropy, f"well below ln(vocab) = {self.uniform_entropy:.4g}: the policy is "
                      "uniform over the vocabulary (learning rate too high?)")
        elif entropy < 1e-3 and self.first_entropy > 0.1:
            self.warn("train/entropy", entropy, f"> 1e-3 (started at {self.first_entropy:.3f}): the policy has "
                      "collapsed onto single tokens")
        has_signal = row.get("rollout/zero_std_group_frac", 0.0) < 1.0
        self.zero_grad_steps = self.zero_grad_steps + 1 if grad_norm == 0 and has_signal else 0
        if self.zero_grad_steps >= 2:
            self.warn("train/grad_norm", grad_norm, f"> 0: zero for {self.zero_grad_steps} steps in a row while "
                      "advantages are not, so nothing is learned")

    def warn(self, metric: str, value: float, expected: str) -> None:
        self.warnings[metric] += 1
        print0(f"health warning: {metric} = {value:.4g}, expected {expected}")

    def metrics(self) -> dict[str, float]:
        return {"health/warnings": float(sum(self.warnings.values())), "health/bad_steps_in_a_row": self.bad_steps}

    def summary(self) -> str:
        if not self.warnings:
            return "health: no warnings"
        return "health: " + ", ".join(f"{metric} warned {n}x" for metric, n in self.warnings.most_common())
