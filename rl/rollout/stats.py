"""The counters of rollouts and evals: what one generate -> score -> gather pass counts on each rank, combined
across ranks in one gather, added over a rollout's rounds, and turned into metrics in one place.

Each field says once how ranks combine it (`across_ranks`): "max" for seconds (the slowest rank's), "sum" for
every rank's own count (a list sums by concatenation, in rank order), "engine" for an engine's count, which every
rank of a tensor-parallel group holds alike and so is summed once per engine. Rounds add field by field.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from rl.env.reward import reduce_metrics as reduce_reward_metrics


def counter(across_ranks: str, default: float = 0):
    """A RolloutStats field and how ranks combine it: "max", "sum" or "engine"."""
    return dataclasses.field(default=default, metadata={"across_ranks": across_ranks})


@dataclasses.dataclass
class RolloutStats:
    """What generate -> score -> gather passes counted: one rank's, every rank's (`across_ranks`), or a rollout's
    rounds added up (`+`)."""

    # each scoring rank's reward metrics (rl/env/reward.py), one dict per rank and pass
    reward_stats: list[dict[str, float]] = dataclasses.field(default_factory=list, metadata={"across_ranks": "sum"})
    rollout_s: float = counter("max", 0.0)  # generating, episodes included
    reward_s: float = counter("max", 0.0)  # scoring
    env_s: float = counter("max", 0.0)  # of rollout_s, waiting on environments
    env_failures: int = counter("sum")  # environment steps that raised, hung or returned garbage
    prompt_tokens: int = counter("sum")  # of the episodes' turns, and those whose KV the engine reused
    reused_tokens: int = counter("sum")
    tokens: int = counter("engine")  # the model generated (loss_mask ones; an environment's tokens are not its)
    resumed_tokens: int = counter("engine")  # response tokens of continued samples, whose KV was computed again
    decode_steps: int = counter("engine")  # the engines' decode steps, and the rows they ran summed over steps
    decode_row_steps: int = counter("engine")
    context_tokens: int = counter("engine")  # the contexts generated tokens were sampled over, summed (no episodes)
    prefill_tokens: int = counter("engine")  # the tokens the engines prefilled (an engine that counts them)

    def __add__(self, other: RolloutStats) -> RolloutStats:
        return RolloutStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in dataclasses.fields(self)})

    @staticmethod
    def across_ranks(per_rank: list[RolloutStats], tensor_parallel_size: int) -> RolloutStats:
        """One pass's stats from every rank's, in rank order (`parallel.all_gather_objects`)."""
        combined = {}
        for f in dataclasses.fields(RolloutStats):
            values = [getattr(stats, f.name) for stats in per_rank]
            how = f.metadata["across_ranks"]
            combined[f.name] = max(values) if how == "max" else functools.reduce(operator.add, values)
            if how == "engine":
                combined[f.name] //= tensor_parallel_size
        return RolloutStats(**combined)

    def metrics(self, num_engines: int, episodes: bool, buffered: bool) -> dict[str, float]:
        """A rollout's metrics from its counters. A counter an engine does not keep (it stays 0) logs nothing;
        environment metrics come with episodes, resumed tokens with the rollout buffer."""
        stats = {**reduce_reward_metrics(self.reward_stats), "perf/rollout_s": self.rollout_s,
                 "perf/reward_s": self.reward_s}
        if self.tokens:  # a rollout that trains on groups generated before has no speed of its own
            stats["perf/rollout_tokens_per_s"] = self.tokens / max(self.rollout_s, 1e-9)
        if episodes:
            stats |= {"rollout/tool_errors": float(self.env_failures), "perf/env_s": self.env_s}
        if buffered:
            stats["rollout/resumed_tokens"] = float(self.resumed_tokens)
        if self.decode_steps:  # the long tail in numbers: decode steps an engine ran, and the rows a step ran
            stats["rollout/decode_steps"] = self.decode_steps / num_engines
            stats["rollout/decode_rows_mean"] = self.decode_row_steps / self.decode_steps
        if self.context_tokens:  # what a token's attention read: long contexts cost bandwidth a decode step
            stats["rollout/context_mean"] = self.context_tokens / self.tokens
        if self.prefill_tokens:  # prompts, continued samples' responses so far, environments' appended tokens
            stats["rollout/prefill_tokens"] = float(self.prefill_tokens)
        if self.prompt_tokens:  # episodes on an engine that counts reuse (the native one)
            stats["rollout/prefill_tokens_reused_frac"] = self.reused_tokens / self.prompt_tokens
        return stats
