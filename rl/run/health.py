"""Run health: faults the loop survives but counts, faults that stop it, and loud warnings.

Reads each step's flat metrics row (never tensors) and keeps a few counters across
steps, which a checkpoint saves with the run:
- optimizer steps skipped for a non-finite loss or grad norm (`train.max_bad_steps` in a
  row stop the run);
- steps in which every reward failed (`reward.max_failed_steps` in a row stop the run; so does the run's first
  scored step failing whole, which means a broken function, not a flaky one, and would otherwise train on zeros
  and exit 0 in a short run);
- warnings, each one line naming the metric, its value and its healthy band, counted in
  `health/warnings` (a metric out of its band for many rollouts in a row prints every 10th):
  the entropy collapsing to zero or rising to uniform, the grad norm staying at zero while
  advantages are not, and the health metric table (`BANDS` and the trend checks below).
A stop raises `RunStopped`: one line for the user, no traceback, a non-zero exit.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

from rl.config import RunStopped
from rl.parallel import print0

# The health metric table as bands on one row: (metric, low, high, what leaving the band means). A metric a
# run does not log (MFU without a known peak, staleness in the synchronous loop) is not checked. The rest of the
# table's staleness row (pinned at the bound) is a trend: `check_staleness`.
BANDS = (
    ("rollout/dropped_stale_frac", None, 0.2, "generation falls behind: groups past rollout.max_staleness were "
     "dropped untrained (a resume with a lower rollout.max_staleness?)"),
    ("train/clip_frac", None, 0.5, "updates too aggressive (healthy: 5-20% of tokens clipped)"),
    ("rollout/truncated_frac", None, 0.5, "response length exploding: half the responses hit max_new_tokens"),
    ("train/kl_ref_seq", None, 50.0, "the policy drifts from the reference too fast (healthy: 1-10 per response); "
     "raise algo.kl_coef or lower train.lr?"),
    ("perf/train_mfu", 0.20, None, "training far below the device's peak (healthy: > 35%): communication, host overhead, or a "
     "model and batch too small for the device?"),
)
TREND_WINDOW = 10  # rollouts of history the trend checks compare with


class Health:
    def __init__(self, max_bad_steps: int, max_failed_steps: int, vocab_size: int, max_staleness: int = 0,
                 rollout_samples: int = 0):
        self.max_bad_steps, self.max_failed_steps = max_bad_steps, max_failed_steps
        self.max_staleness = max_staleness
        self.rollout_samples = rollout_samples  # the samples a rollout trains: rollout_batch_size x n_samples
        self.uniform_entropy = math.log(vocab_size)
        self.bad_steps = 0  # optimizer steps skipped in a row
        self.failed_steps = 0  # rollout steps in a row where every reward failed
        self.ever_scored = False  # some reward of this run (before a resume too) was scored without failing
        self.zero_grad_steps = 0
        self.first_entropy: float | None = None
        self.warnings: collections.Counter[str] = collections.Counter()
        self.out_of_band: dict[str, int] = {}  # rollouts in a row each check has warned
        self.warned_now: set[str] = set()
        self.history: dict[str, list[float]] = {}  # the last TREND_WINDOW values of the trend metrics
        # The rewards scored since the all-scored mean was last judged: (their sum, how many, over how many rollouts).
        self.scored = (0.0, 0, 0)
        # This process's first train phase compiles kernels (model.compile) and fills caches, and a later one
        # that compiles a new kind of micro-batch (`perf/train_graphs_compiled`) is seconds slower: neither's
        # speed is judged.
        self.warmed_up = False

    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": self.bad_steps, "failed_steps": self.failed_steps, "ever_scored": self.ever_scored,
                "zero_grad_steps": self.zero_grad_steps,
                "first_entropy": self.first_entropy, "warnings": dict(self.warnings),
                "out_of_band": dict(self.out_of_band), "history": {k: list(v) for k, v in self.history.items()},
                "scored": list(self.scored)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_steps, self.failed_steps = state["bad_steps"], state["failed_steps"]
        self.ever_scored = state.get("ever_scored", True)  # a checkpoint from before the key: it trained on rewards
        self.zero_grad_steps, self.first_entropy = state["zero_grad_steps"], state["first_entropy"]
        self.warnings = collections.Counter(state["warnings"])
        self.out_of_band = dict(state.get("out_of_band", {}))
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}
        self.scored = tuple(state.get("scored", (0.0, 0, 0)))

    def after_rewards(self, scored: int, failed: int) -> None:
        """Every reward of a step failing (raised, timed out, worker died) is survivable a few times. A step that
        scored nothing (it trained on groups scored before) leaves the count as it was."""
        if not scored:
            return
        self.failed_steps = self.failed_steps + 1 if failed == scored else 0
        look = "the reward warnings above name the function that failed and its error"
        if self.failed_steps and not self.ever_scored:
            raise RunStopped(f"reward: every reward of the run's first scored step failed ({failed} of {scored}), "
                             f"so the reward function is broken rather than flaky: {look}")
        self.ever_scored = self.ever_scored or failed < scored
        if self.failed_steps >= self.max_failed_steps:
            raise RunStopped(f"reward: every reward failed in {self.failed_steps} steps in a row "
                             f"(reward.max_failed_steps={self.max_failed_steps}): {look}")

    def after_train(self, row: dict[str, Any], steps: int) -> None:
        """Counts skipped steps (a streak may cross rollouts) and warns on metrics out of their bands."""
        self.warned_now = set()
        try:
            self._after_train(row, steps)
        finally:
            self.warmed_up = True
            for check in list(self.out_of_band):
                if check not in self.warned_now:
                    del self.out_of_band[check]

    def _after_train(self, row: dict[str, Any], steps: int) -> None:
        skipped = int(row["train/skipped_steps"])
        if skipped == steps:
            self.bad_steps += skipped
        else:  # a streak ends inside this rollout: the one that began before it, or one within it
            worst = max(self.bad_steps + int(row["train/leading_skipped_steps"]), int(row["train/longest_skipped_run"]))
            self.bad_steps = worst if worst >= self.max_bad_steps else int(row["train/trailing_skipped_steps"])
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
                      "uniform over the vocabulary (learning rate too high?)", check="entropy uniform")
        elif entropy < 1e-3 and self.first_entropy > 0.1:
            self.warn("train/entropy", entropy, f"> 1e-3 (started at {self.first_entropy:.3f}): the policy has "
                      "collapsed onto single tokens", check="entropy collapsed")
        has_signal = row.get("rollout/zero_std_group_frac", 0.0) < 1.0
        self.zero_grad_steps = self.zero_grad_steps + 1 if grad_norm == 0 and has_signal else 0
        if self.zero_grad_steps >= 2:
            self.warn("train/grad_norm", grad_norm, f"> 0: zero for {self.zero_grad_steps} steps in a row while "
                      "advantages are not, so nothing is learned")
        self.check_bands(row)
        self.check_trends(row)
        self.check_staleness(row)

    def check_staleness(self, row: dict[str, Any]) -> None:
        """The staleness signal: every trained sample at the bound, rollout after rollout, means the
        generation side never gets ahead of training."""
        lag = self._push("rollout/staleness_mean", row)
        if lag is not None and self.max_staleness and len(lag) >= 3 and min(lag[-3:]) >= self.max_staleness:
            self.warn("rollout/staleness_mean", lag[-1], f"< rollout.max_staleness = {self.max_staleness}: every "
                      "trained sample has been at the bound for 3 rollouts, generation is not keeping up (healthy: "
                      "0-2, below the bound): fewer groups in flight (rollout.over_sampling_batch_size) keep samples "
                      "fresher")

    def check_bands(self, row: dict[str, Any]) -> None:
        small = self.small_batch(row)  # every rollout's tokens join the median, judged or not
        speed_judged = self.warmed_up and not row.get("perf/train_graphs_compiled") and not small
        for metric, low, high, meaning in BANDS:
            value = row.get(metric)
            if value is None or not math.isfinite(value) or (metric.startswith("perf/") and not speed_judged):
                continue
            if (low is not None and value < low) or (high is not None and value > high):
                band = f">= {low:g}" if high is None else f"<= {high:g}" if low is None else f"in [{low:g}, {high:g}]"
                self.warn(metric, value, f"{band}: {meaning}")

    def small_batch(self, row: dict[str, Any]) -> bool:
        """A train phase with under half the recent median of tokens: most of its groups scored all alike (83-95%
        of them in a partial rollout of long bundled problems on one H200, 6-29k tokens against a median of 55k),
        so there was little to train, and its speed says nothing of the training's efficiency."""
        tokens = self._push("train/tokens", row)
        return tokens is not None and len(tokens) >= 4 and tokens[-1] < 0.5 * statistics.median(tokens[:-1])

    def check_trends(self, row: dict[str, Any]) -> None:
        """The trend signals: the reward jumping or dropping in one rollout, the response length
        collapsing, the rollout throughput falling and staying low (a leak)."""
        reward, rollouts = self.pool_scored(row)
        if reward is not None:
            *earlier, now = reward
            steps = [b - a for a, b in zip(earlier, earlier[1:])]
            if len(steps) >= 8:
                sigma = statistics.pstdev(steps)
                jump = now - earlier[-1]
                if abs(jump) > max(5 * sigma, 1e-6):
                    pooled = f" (over the last {rollouts} rollouts' scored samples)" if rollouts > 1 else ""
                    self.warn("rollout/reward_mean_all_scored", now,
                              f"a change within 5 sigma ({5 * sigma:.3g}) of the last rollouts' steps, not "
                              f"{jump:+.3g}{pooled}: {'reward hacking?' if jump > 0 else 'training collapsing?'}")
        length = self._push("rollout/response_length_mean", row)
        if length is not None and len(length) >= 4:
            typical = statistics.median(length[:-1])
            if length[-1] < 0.2 * typical:
                self.warn("rollout/response_length_mean", length[-1],
                          f">= 20% of the recent median {typical:.4g}: the response length is collapsing")
        speed = self._push("perf/rollout_tokens_per_s", row)
        if speed is not None and len(speed) >= 6:
            typical = statistics.median(speed[:-3])
            if max(speed[-3:]) < 0.5 * typical:
                self.warn("perf/rollout_tokens_per_s", speed[-1],
                          f">= half the earlier median {typical:.4g}: 3 rollouts in a row below it (a memory leak?)")

    def pool_scored(self, row: dict[str, Any]) -> tuple[list[float] | None, int]:
        """The all-scored reward mean to judge, over at least half a batch's samples, and the rollouts it spans. A
        partial rollout that ended after a few decode steps scored only the groups that finished in them, the
        quick ones (152 samples of a 512-sample batch at 0.61 against the batch's ~0.3, on one H200): alone their
        mean is noise and bias, so it is pooled with the next rollouts' until half a batch is scored. A rollout
        that scores half a batch or more with nothing pooled before it (every synchronous one) is judged alone."""
        mean = row.get("rollout/reward_mean_all_scored")
        count = int(row.get("rollout/num_scored", max(self.rollout_samples, 1)))
        if mean is None or not math.isfinite(mean) or count <= 0:
            return None, 0
        total, pooled, rollouts = self.scored
        total, pooled, rollouts = total + mean * count, pooled + count, rollouts + 1
        if pooled < self.rollout_samples / 2:
            self.scored = (total, pooled, rollouts)
            return None, 0
        self.scored = (0.0, 0, 0)
        metric = "rollout/reward_mean_all_scored"
        return self._push(metric, {metric: total / pooled}), rollouts

    def _push(self, metric: str, row: dict[str, Any]) -> list[float] | None:
        value = row.get(metric)
        if value is None or not math.isfinite(value):
            return None
        values = self.history.setdefault(metric, [])
        values.append(float(value))
        del values[: -TREND_WINDOW - 1]
        return values

    def warn(self, metric: str, value: float, expected: str, check: str = "") -> None:
        """Counts the warning; prints it when the check first fails and every 10th rollout it keeps failing."""
        self.warnings[metric] += 1
        check = check or metric
        if check in self.warned_now:
            return
        self.warned_now.add(check)
        self.out_of_band[check] = self.out_of_band.get(check, 0) + 1
        if self.out_of_band[check] % 10 == 1:
            again = f" ({self.out_of_band[check]} rollouts in a row)" if self.out_of_band[check] > 1 else ""
            print0(f"health warning: {metric} = {value:.4g}, expected {expected}{again}")

    def metrics(self) -> dict[str, float]:
        return {"health/warnings": float(sum(self.warnings.values())), "health/bad_steps_in_a_row": self.bad_steps}

    def summary(self) -> str:
        if not self.warnings:
            return "health: no warnings"
        return "health: " + ", ".join(f"{metric} warned {n}x" for metric, n in self.warnings.most_common())
