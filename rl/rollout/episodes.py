"""The turn loop of multi-turn episodes (rl/env/__init__.py): generate every live episode's next turn, step the
environments, append what they return, until each episode ends.

Each turn is one engine call over the live episodes, each continuing its own sequence (`prior` counts only the
model's tokens, so rollout.max_new_tokens bounds the model's tokens over all turns). Each episode's turn goes to its
environment in the reward workers (RewardPool.env_steps) as soon as the engine reports it finished, so
environments run while the other episodes still generate, and the next turn starts once every step is back
(perf/env_s: the wait after the engine call). What they return is appended untrained (loss mask 0, logprob 0) as
tokens: text tokenized once on its own, never re-rendered from the conversation, so the trained
sequence is exactly the engine's tokens and the environment's. The episode's reward is the environment's.
Each call asks the engine to keep every episode's KV under the episode's key, and the next turn continues from
it: the native engine prefills only the model's last token and what the environment appended (the KV of the rest
is what it computed in the turns before, under the same weights); vLLM ignores keys and serves the prefix from
its prefix cache. An episode waiting on its environment holds only its kept pages, no decode row; an episode that
ends releases them, and the engine evicts kept pages rather than run short (that episode's next turn then
prefills its whole sequence). rollout/prefill_tokens_reused_frac: the share of the turns' prompt tokens whose KV
the native engine reused.
"""

from __future__ import annotations

import dataclasses
import time

from rl.config import EnvConfig, RolloutConfig
from rl.data import Sample, Status
from rl.env import EnvOutcome, EnvStep
from rl.env.reward import RewardPool
from rl.parallel import print0
from rl.rollout import Completion, SamplingParams, append_completions, decode_responses, derive_seed
from rl.rollout.stop_text import StopText


class EpisodeLoop:
    """Runs episodes to their end on one engine, stepping their environments in `pool`'s workers."""

    def __init__(self, engine, pool: RewardPool, tokenizer, ro: RolloutConfig, env: EnvConfig):
        self.engine, self.pool, self.tokenizer, self.ro, self.env = engine, pool, tokenizer, ro, env
        # env.stop ends a turn wherever the model's tokens spell it (every engine: rl/rollout/engine.py)
        self.stop_text = StopText.from_tokenizer(env.stop, tokenizer) if env.stop else None

    def run(self, samples: list[Sample], params: SamplingParams, weight_version: int, tally: EpisodeTally) -> None:
        """Turns until every episode is done or out of turns, tokens or context: each turn generates the
        live episodes' next turns at once, steps their environments, and appends what they return untrained."""
        params = dataclasses.replace(params, stop_text=self.stop_text)
        # Keyed by identity: a sample's index need not be unique (samples built outside a dataset leave it -1).
        episodes: dict[int, bytes | None] = {id(s): None for s in samples}
        for s in samples:
            s.reward, s.turns, s.tool_calls = 0.0, 0, 0
        try:
            self.take_turns(samples, params, weight_version, episodes, tally)
        finally:  # whatever ended the episodes, the engine keeps none of them
            self.engine.release(id(s) for s in samples)
        for s, text in zip(samples, decode_responses(self.tokenizer, samples), strict=True):
            s.response = text

    def take_turns(self, samples: list[Sample], params: SamplingParams, weight_version: int,
                   episodes: dict[int, bytes | None], tally: EpisodeTally) -> None:
        """Up to env.max_turns turns of the episodes still live, each one engine call and one environment step."""
        live = samples
        for turn in range(self.env.max_turns):
            for s in live:
                if not self.room_for_turn(s, params.max_new_tokens):
                    s.status = Status.TRUNCATED
            live = [s for s in live if s.status != Status.TRUNCATED]
            if not live:
                break
            # A stream of its own for each turn: the same seed again would replay the first turn's draws.
            seeded = params if params.seed is None else dataclasses.replace(params, seed=derive_seed(params.seed, turn))
            # Each turn goes to its environment as soon as the engine has it, so the environments run while the
            # other episodes still generate; the next turn starts once every step is back.
            stepping, order = self.pool.env_steps(self.env.timeout_s), []

            def step_finished(finished: dict[int, Completion]) -> None:
                for i, out in finished.items():
                    stepping.add([EnvStep(live[i].raw_prompt, live[i].label, live[i].columns, episodes[id(live[i])],
                                          self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                                          tuple(out.token_ids))])
                    order.append(i)

            # Each episode's KV stays in the engine under its key, so that its next turn prefills only the
            # model's last token and what the environment appended.
            completions = self.engine.generate([s.tokens for s in live], seeded, on_finish=step_finished,
                                               prior=[sum(s.loss_mask) for s in live],  # the model's tokens
                                               keep=[id(s) for s in live])
            tally.count_prefill(live, completions)
            step_finished({i: completions[i] for i in sorted(set(range(len(live))) - set(order))})  # unheard of
            append_completions(live, completions, weight_version, self.tokenizer)
            start = time.perf_counter()
            stepped, errors, timeouts = stepping.finish()
            tally.env_s += time.perf_counter() - start
            outcomes = [None] * len(live)
            for i, outcome in zip(order, stepped):
                outcomes[i] = outcome
            tally.errors, tally.timeouts = tally.errors + errors, tally.timeouts + timeouts
            last = turn == self.env.max_turns - 1
            going_on = [self.take_step(s, out, episodes, weight_version, tally, last) for s, out in zip(live, outcomes)]
            self.engine.release(id(s) for s, on in zip(live, going_on) if not on)  # their pages go to the others
            live = [s for s, on in zip(live, going_on) if on]

    def take_step(self, sample: Sample, out: EnvOutcome | None, episodes: dict[int, bytes | None],
                  weight_version: int, tally: EpisodeTally, last: bool) -> bool:
        """Applies one environment step to its episode; whether the episode goes on (`last`: no turn follows)."""
        sample.turns += 1
        if out is None:  # the step failed (counted in the pool): the episode ends with reward 0
            sample.reward = 0.0
            return False
        sample.reward, episodes[id(sample)] = out.reward, out.episode
        if out.done or sample.status == Status.TRUNCATED:  # ended, or the model spent its max_new_tokens
            return False
        if last:  # out of turns with the environment still waiting for one
            sample.status = Status.TRUNCATED
            return False
        ids = self.tokenizer.encode(out.append, add_special_tokens=False) if isinstance(out.append, str) else out.append
        if any(t >= len(self.tokenizer) for t in ids):
            print0(f"env: an environment returned token ids past the vocabulary ({len(self.tokenizer)}); its "
                   f"episode ends with reward 0")
            sample.reward, tally.errors = 0.0, tally.errors + 1
            return False
        sample.append_response_tokens(ids, [0.0] * len(ids), trainable=False, version=weight_version)
        sample.tool_calls += 1
        return True

    def room_for_turn(self, sample: Sample, max_new_tokens: int) -> bool:
        """Whether an episode may take another turn: model tokens left, env.max_tokens not reached, and room in
        the engine's context for a turn of all the model tokens left."""
        model_tokens = sum(sample.loss_mask)
        return (model_tokens < max_new_tokens and sample.response_length < self.env.max_tokens
                and len(sample.tokens) - model_tokens + max_new_tokens <= self.ro.max_context_len)


@dataclasses.dataclass
class EpisodeTally:
    """One rank's environment steps in one generate pass: seconds waited, steps that raised and that timed out;
    and the prompt tokens of its turns, those whose KV the engine reused from the turn before among them."""

    env_s: float = 0.0
    errors: int = 0
    timeouts: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0

    def count_prefill(self, samples: list[Sample], completions: list[Completion]) -> None:
        """Counts the prompts of one turn, those of an engine that says what it reused (the native one)."""
        for sample, out in zip(samples, completions, strict=True):
            if out.reused_tokens is not None:
                self.prompt_tokens += len(sample.tokens)
                self.reused_tokens += out.reused_tokens


def episode_reward_stats(samples: list[Sample], episodes: EpisodeTally) -> dict[str, float]:
    """The reward metrics of episodes the environments scored: a failed step counts as a failed reward."""
    return {"reward/correct_mean": sum(s.reward for s in samples) / len(samples),
            "reward/num_inputs": float(len(samples)), "reward/num_errors": float(episodes.errors),
            "reward/num_timeouts": float(episodes.timeouts)}
