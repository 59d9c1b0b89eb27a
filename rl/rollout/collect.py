"""Generate -> score -> gather: the one path from prompt groups to scored samples, for training rollouts and
held-out evals alike, and the JSONL dumps of what it produced.

Every rank holds the same list of groups. Each engine (a tensor-parallel group of contiguous ranks, one rank
without TP) generates a contiguous share of whole groups, so the n samples of a prompt stay on one engine
and can share its prefix cache; the engine's first rank scores them in the reward pool (its TP peers hold
the same samples), and the scored samples are gathered so that every rank ends with all of them, in group
order.

Two choices are made once, when the Collector is built. The generator: one response a sample, scored in the reward
pool (`SingleTurn`), or with an environment (`env.fn`, rl/env/__init__.py) the turn loop of
rl/rollout/episodes.py, whose environments score their episodes (`Episodes`). The schedule: synchronous rounds with the dynamic-sampling filter
and its over-sampling refill (`Rounds`), or with partial rollouts or max_staleness the rollout buffer's, which keeps
groups in flight between rollouts within the staleness bound (`Buffered`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rl import parallel
from rl.config import EnvConfig, RolloutConfig
from rl.data import PromptDataset, Sample, Status
from rl.env.reward import BUILT_IN_TERMS, RewardInput, RewardPool, score_column
from rl.env.reward import metrics as reward_metrics
from rl.parallel import print0
from rl.rollout import SamplingParams, derive_seed, generate_rollout
from rl.rollout.buffer import FINISHED, RolloutBuffer, due_in, is_finished, oldest_version, on_schedule, staleness
from rl.rollout.episodes import EpisodeLoop, EpisodeTally, episode_reward_stats
from rl.rollout.stats import RolloutStats


@dataclasses.dataclass
class Scored:
    """One generate -> score -> gather pass: every sample on every rank, and what every rank counted doing it."""

    samples: list[Sample]
    stats: RolloutStats


class SingleTurn:
    """The generator of one response a sample, scored in the reward pool (reward.functions, reward.user_fn)."""

    episodic = False

    def __init__(self, engine, pool: RewardPool | None, tokenizer, ro: RolloutConfig):
        self.engine, self.pool, self.tokenizer, self.ro = engine, pool, tokenizer, ro

    def generate(self, todo: list[list[Sample]], params: SamplingParams, weight_version: int, tally: EpisodeTally,
                 progress: bool, until: Callable[[list[Sample]], bool] | None) -> None:
        generate_rollout(self.engine, todo, params, weight_version, self.tokenizer, progress=progress, until=until)

    def score(self, done: list[Sample], term: str, tally: EpisodeTally) -> list[dict[str, float]]:
        return [score_samples(self.pool, done, term, self.ro.max_new_tokens)] if self.pool is not None and done else []

    def context_tokens(self, starts: list[int], pending: list[Sample]) -> int:
        return sum(attended(n, len(s.tokens) - n) for n, s in zip(starts, pending))

    def batch_metrics(self, samples: list[Sample]) -> dict[str, float]:
        return {}


class Episodes:
    """The generator of multi-turn episodes (rl/rollout/episodes.py): the environments step in the pool's workers and
    score their episodes."""

    episodic = True

    def __init__(self, engine, pool: RewardPool, tokenizer, ro: RolloutConfig, env: EnvConfig):
        self.loop = EpisodeLoop(engine, pool, tokenizer, ro, env)

    def generate(self, todo: list[list[Sample]], params: SamplingParams, weight_version: int, tally: EpisodeTally,
                 progress: bool, until: Callable[[list[Sample]], bool] | None) -> None:
        self.loop.run([s for group in todo for s in group], params, weight_version, tally)

    def score(self, done: list[Sample], term: str, tally: EpisodeTally) -> list[dict[str, float]]:
        return [episode_reward_stats(done, tally)] if done else []

    def context_tokens(self, starts: list[int], pending: list[Sample]) -> int:
        return 0  # a turn's context is not one run of sampled tokens

    def batch_metrics(self, samples: list[Sample]) -> dict[str, float]:
        return {"rollout/turns_mean": sum(s.turns for s in samples) / len(samples),
                "rollout/tool_calls_mean": sum(s.tool_calls for s in samples) / len(samples)}


class Collector:
    """Generate -> score -> gather over the engines, with the generator (one turn, or episodes with env.fn) and
    the schedule (synchronous rounds, or the rollout buffer's with partial rollouts or max_staleness) chosen once,
    here. Held-out evals call `generate_and_score` on the same objects."""

    def __init__(self, engine, pool: RewardPool | None, tokenizer, ro: RolloutConfig, dist: parallel.Dist,
                 progress: bool = False, buffer: RolloutBuffer | None = None, env: EnvConfig | None = None):
        self.engine, self.pool, self.tokenizer, self.ro, self.dist = engine, pool, tokenizer, ro, dist
        self.generator = (Episodes(engine, pool, tokenizer, ro, env) if env is not None and env.fn
                          else SingleTurn(engine, pool, tokenizer, ro))
        self.schedule = Buffered(buffer) if buffer is not None else Rounds()
        self.progress = progress and dist.is_main  # a bar for training rollouts
        self.engine_index = dist.rank // ro.tensor_parallel_size
        self.num_engines = dist.world_size // ro.tensor_parallel_size
        waiting = sequences_per_engine(ro, self.num_engines) - ro.max_batch_size
        if waiting > 0:
            print0(f"rollout: each engine has up to {sequences_per_engine(ro, self.num_engines)} sequences to "
                   f"generate but rollout.max_batch_size={ro.max_batch_size} rows: {waiting} wait for a row while "
                   f"the batch drains; a larger max_batch_size (more KV cache) usually shortens the rollout")

    def rollout(self, dataset: PromptDataset, sampling: SamplingParams, weight_version: int, rollout_id: int,
                barrier_timeout_s: float) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's `rollout_batch_size` groups, every rank the same, in order, and their metrics."""
        if self.pool is not None:  # what TRL-style reward functions see as `trainer_state`
            self.pool.begin_rollout(rollout_id, dataset.epoch + dataset.offset / len(dataset.prompts))
        return self.schedule.rollout(self, dataset, sampling, weight_version, rollout_id, barrier_timeout_s)

    def generate_and_score(self, groups: list[list[Sample]], params: SamplingParams, weight_version: int,
                           seed: tuple[int, ...], barrier_timeout_s: float, term: str = "reward",
                           progress: bool = False) -> Scored:
        """This engine's share of `groups` generated (sampling seed: `seed` + the engine's index, so a rerun
        draws the same), scored (`Sample.reward` is the reward, or one of its terms: "correct" for evals),
        and gathered."""
        mine = parallel.engine_share(groups, self.engine_index, self.num_engines)
        return self.generate_share(mine, params, weight_version, seed, barrier_timeout_s, term, progress)

    def generate_share(self, mine: list[list[Sample]], params: SamplingParams, weight_version: int,
                       seed: tuple[int, ...], barrier_timeout_s: float, term: str = "reward", progress: bool = False,
                       until: Callable[[list[Sample]], bool] | None = None) -> Scored:
        """Generates this engine's groups `mine`, each unfinished sample where it left off (`until`: see
        generate_rollout), scores the groups that are finished, and gathers `mine` from every engine."""
        params = dataclasses.replace(params, seed=derive_seed(*seed, self.engine_index))
        start = time.perf_counter()
        todo = [[s for s in group if s.status not in FINISHED] for group in mine]
        pending = [s for group in todo for s in group]
        # A partial rollout's continued samples (the only ones that start with a response): their KV is computed
        # again under the weights of now.
        prior = [s.response_length for s in pending]
        starts = [len(s.tokens) for s in pending]
        episodes = EpisodeTally()
        counters = dataclasses.replace(self.engine.stats)
        if any(todo):
            self.generator.generate(todo, params, weight_version, episodes, progress, until)
        parallel.step_barrier(self.dist, barrier_timeout_s, "the end of rollout generation")
        rollout_s = time.perf_counter() - start
        did = self.engine.stats - counters
        start = time.perf_counter()
        # A call that may end early scores only its finished groups; the others are scored once they finish.
        done = [s for group in mine if until is None or is_finished(group) for s in group]
        reward_stats = self.generator.score(done, term, episodes)
        generated = sum(sum(s.loss_mask[n:]) for n, s in zip(prior, pending))  # the model's, not an environment's
        counted = RolloutStats(
            reward_stats, rollout_s, reward_s=time.perf_counter() - start, env_s=episodes.env_s,
            env_failures=episodes.errors + episodes.timeouts, prompt_tokens=episodes.prompt_tokens,
            reused_tokens=episodes.reused_tokens, tokens=generated, resumed_tokens=sum(prior),
            decode_steps=did.decode_steps, decode_row_steps=did.decode_row_steps,
            context_tokens=self.generator.context_tokens(starts, pending), prefill_tokens=did.prefill_tokens)
        # Every rank of an engine holds its share and counts its steps; engine order is group order when the shares
        # are contiguous.
        tp = self.ro.tensor_parallel_size
        stats = RolloutStats.across_ranks(parallel.all_gather_objects([counted]), tp)
        return Scored(parallel.gather_engine_outputs([s for group in mine for s in group], tp), stats)

    def score(self, samples: list[Sample], term: str) -> dict[str, float]:
        return score_samples(self.pool, samples, term, self.ro.max_new_tokens)

    def batch(self, kept: list[list[Sample]], dropped: list[list[Sample]], rounds: int, scored: list[Sample],
              stats: RolloutStats) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's `rollout_batch_size` groups, topped up with filtered groups (zero advantage) when too
        few passed, and the rollout's metrics; `scored`: the samples its rounds scored."""
        ro = self.ro
        topped_up = max(ro.rollout_batch_size - len(kept), 0)
        if topped_up:  # out of rounds: top up with filtered groups, which train as zeros
            print0(f"rollout: only {len(kept)}/{ro.rollout_batch_size} groups passed rollout.dynamic_filter "
                   f"in {rounds} rounds; topping up with {topped_up} filtered groups (zero advantage)")
        samples = [s for group in (kept + dropped[:topped_up])[: ro.rollout_batch_size] for s in group]
        metrics = {"rollout/sampling_rounds": rounds,
                   "rollout/filtered_group_frac": len(dropped) / max(len(kept) + len(dropped), 1),
                   "rollout/topped_up_groups": topped_up, "rollout/num_scored": len(scored),
                   **stats.metrics(self.num_engines, episodes=self.generator.episodic,
                                   buffered=self.schedule.buffered)}
        if scored:  # a rollout that trains on groups scored before has no reward of its own
            rewards = [s.reward for s in scored if not math.isnan(s.reward)]  # NaN: every reward function passed
            metrics["rollout/reward_mean_all_scored"] = sum(rewards) / len(rewards) if rewards else math.nan
        return samples, metrics | self.generator.batch_metrics(samples)


class Rounds:
    """The synchronous schedule: rounds of `over_sampling_batch_size` new prompts until `rollout_batch_size` groups
    pass the dynamic filter (groups whose rewards all match carry no signal), topped up with filtered groups when
    the rounds run out."""

    buffered = False

    def rollout(self, c: Collector, dataset: PromptDataset, sampling: SamplingParams, weight_version: int,
                rollout_id: int, barrier_timeout_s: float) -> tuple[list[Sample], dict[str, float]]:
        ro = c.ro
        kept, dropped, stats = [], [], RolloutStats()
        rounds = 0
        while len(kept) < ro.rollout_batch_size and rounds < ro.max_sampling_rounds:
            rounds += 1
            groups = dataset.next_groups(ro.over_sampling_batch_size, ro.n_samples_per_prompt)
            # The sampling stream depends only on (seed, rollout, round, engine): a resumed run redraws it.
            scored = c.generate_and_score(groups, sampling, weight_version, (ro.seed, rollout_id, rounds),
                                          barrier_timeout_s, progress=c.progress)
            stats += scored.stats
            for group in split_by_group(scored.samples):
                (kept if keep_group(group, ro.dynamic_filter) else dropped).append(group)
        scored = [s for group in kept + dropped for s in group]  # the order the reward mean sums in
        return c.batch(kept, dropped, rounds, scored, stats)


class Buffered:
    """The schedule through the rollout buffer (rl/rollout/buffer.py), with partial rollouts or max_staleness > 0:
    groups stay in flight between rollouts, and this schedule keeps every trained sample within the staleness bound."""

    buffered = True

    def __init__(self, buffer: RolloutBuffer):
        self.buffer = buffer

    def rollout(self, c: Collector, dataset: PromptDataset, sampling: SamplingParams, weight_version: int,
                rollout_id: int, barrier_timeout_s: float) -> tuple[list[Sample], dict[str, float]]:
        """Drops what is past the staleness bound, admits new groups as far as the bound allows, generates until
        `rollout_batch_size` finished groups pass the filter and the unfinished groups are on schedule (none due,
        rl/rollout/buffer.py; partial rollouts), or until every group is finished (not partial; only when the finished
        ones run short), and takes the oldest finished groups."""
        ro, buffer = c.ro, self.buffer
        stale = [g for g in buffer.groups if staleness(g, weight_version) > ro.max_staleness]
        buffer.consume(stale)
        if stale:
            print0(f"rollout: dropped {len(stale)} group(s) past rollout.max_staleness={ro.max_staleness}")
        dropped, scored, stats = [], [], RolloutStats()
        rounds = 0
        while rounds < ro.max_sampling_rounds:
            ready = len(buffer.finished())
            schedule = [due_in(g, weight_version, ro.max_staleness) for g in buffer.unfinished()]
            if ready >= ro.rollout_batch_size and on_schedule(schedule, ro.max_staleness, ro.rollout_batch_size):
                break
            rounds += 1
            if ro.partial_rollout or ready < ro.rollout_batch_size:
                count = min(buffer.room(), ro.over_sampling_batch_size - len(buffer.groups))
                buffer.admit(dataset.next_groups(max(count, 0), ro.n_samples_per_prompt))
            round_ = self.continue_groups(c, max(ro.rollout_batch_size - ready, 0), sampling, weight_version,
                                          (ro.seed, rollout_id, rounds), barrier_timeout_s)
            finished = [g for g in split_by_group(round_.samples) if is_finished(g)]
            scored += [s for g in finished for s in g]
            stats += round_.stats
            filtered = [g for g in finished if not keep_group(g, ro.dynamic_filter)]
            buffer.consume(filtered)
            dropped += filtered
        # The oldest first: the due groups are among them (on schedule: at most a batch of them).
        ready = sorted(buffer.finished(), key=lambda g: (oldest_version(g), g[0].group_index))
        kept = ready[: ro.rollout_batch_size]
        buffer.consume(kept)
        samples, metrics = c.batch(kept, dropped, rounds, scored, stats)
        trained = [weight_version - min(s.token_versions, default=weight_version) for s in samples]
        return samples, {**metrics, "rollout/staleness_mean": sum(trained) / len(trained),
                         "rollout/staleness_max": float(max(trained)),
                         "rollout/partial_frac": sum(len(set(s.token_versions)) > 1 for s in samples) / len(samples),
                         "rollout/carried_over": float(len(buffer.groups)), "rollout/dropped_stale": float(len(stale)),
                         "rollout/dropped_stale_frac": len(stale) / (len(stale) + len(kept) + len(dropped))}

    def continue_groups(self, c: Collector, need: int, sampling: SamplingParams, weight_version: int,
                        seed: tuple[int, ...], barrier_timeout_s: float) -> Scored:
        """One round over the buffer's unfinished groups, dealt to the engines in turn (oldest groups to every
        engine alike). With partial rollouts an engine stops once its part of `need` groups is finished and its
        groups are on schedule (its part of a batch each rollout), or skips the round when it owes neither; the
        buffer then holds every engine's groups as they came back."""
        unfinished = self.buffer.unfinished()
        mine = unfinished[c.engine_index :: c.num_engines]
        until = None
        if c.ro.partial_rollout:
            target = math.ceil(need / c.num_engines)
            until = stop_when_finished(mine, target, weight_version, c.ro.max_staleness,
                                       c.ro.rollout_batch_size // c.num_engines)
            if until([]):  # nothing owed: this engine's groups wait for the next rollout
                mine = []
        scored = c.generate_share(mine, sampling, weight_version, seed, barrier_timeout_s, progress=c.progress,
                                  until=until)
        self.buffer.update(split_by_group(scored.samples))
        return scored


def score_samples(pool: RewardPool, samples: list[Sample], term: str, max_new_tokens: int) -> dict[str, float]:
    """Scores `samples` in the reward pool: Sample.reward is the reward or its term `term`, with each function's
    score and what the functions logged; returns the pool's metrics."""
    result = pool.score([RewardInput(s.prompt, s.response, s.label, s.response_length, max_new_tokens, s.metadata,
                                     s.raw_prompt, s.columns, s.tokens[s.prompt_length:], s.group_index)
                         for s in samples])
    values = result.rewards if term == "reward" else result.terms[term]
    functions = [name for name in result.terms if name not in BUILT_IN_TERMS]  # reward.functions, group_fn
    for i, (sample, value, logged) in enumerate(zip(samples, values, result.extra, strict=True)):
        sample.reward, sample.logged = value, logged
        sample.scores = {name: result.terms[name][i] for name in functions}
    return reward_metrics(result)


def stop_when_finished(groups: list[list[Sample]], target: int, weight_version: int, max_staleness: int,
                       per_rollout: int) -> Callable[[list[Sample]], bool]:
    """The early end of a partial rollout's call over `groups` (all unfinished): true once `target` of them are
    finished and the rest are on schedule for batches of `per_rollout` groups (rl/rollout/buffer.py `on_schedule`: none
    due, and no more falling due soon than the next batches can take). Fed the samples finished since the last
    call."""
    left = {g[0].group_index: sum(s.status not in FINISHED for s in g) for g in groups}
    pending = {g[0].group_index: due_in(g, weight_version, max_staleness) for g in groups}
    finished = 0

    def until(samples: list[Sample]) -> bool:
        nonlocal finished
        for s in samples:
            left[s.group_index] -= 1
            if left[s.group_index] == 0:
                finished += 1
                del pending[s.group_index]
        return finished >= target and on_schedule(pending.values(), max_staleness, per_rollout)

    return until


def attended(start: int, new: int) -> int:
    """The contexts `new` tokens sampled after `start` ones were sampled over, summed: the j-th over start + j."""
    return new * start + new * (new - 1) // 2


def split_by_group(samples: list[Sample]) -> list[list[Sample]]:
    """Samples in groups by group_index, in first-seen order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def sequences_per_engine(ro: RolloutConfig, num_engines: int) -> int:
    """The most sequences an engine is handed at once: its share of a sampling round, or of the groups kept in
    flight (through the buffer)."""
    groups = ro.over_sampling_batch_size if ro.over_sampling_batch_size is not None else ro.rollout_batch_size
    return math.ceil(groups / num_engines) * ro.n_samples_per_prompt


def keep_group(group: list[Sample], dynamic_filter: str) -> bool:
    """The dynamic-sampling filter: a group whose rewards are all equal has zero advantage everywhere."""
    if dynamic_filter == "nonzero_std":
        return len({s.reward for s in group if not math.isnan(s.reward)}) > 1  # NaN: unscored, advantage 0
    return True


def rollout_metrics(samples: list[Sample], n_samples_per_prompt: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])  # NaN where every reward function passed: left out
    lengths = torch.tensor([float(s.response_length) for s in samples])
    per_group = rewards.view(-1, n_samples_per_prompt)
    scored = rewards[~rewards.isnan()]
    return {
        "rollout/reward_mean": scored.mean().item() if len(scored) else math.nan,
        "rollout/reward_std": scored.std().item() if len(scored) > 1 else 0.0,
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_group_frac": (per_group.nan_to_num(-math.inf).amax(1) <= per_group.nan_to_num(math.inf)
                                        .amin(1)).float().mean().item(),  # at most one distinct scored reward
        "rollout/num_samples": float(len(samples)),
    }


def dump_rollout(samples: list[Sample], mismatch: dict[int, float], path: Path) -> None:
    """The experience record of one rollout, a JSON line per sample; `mismatch`: Sample.index -> mean
    |trainer - rollout logprob| over the sample's response tokens, before the update. Each reward function's
    own score (before its weight; null where it passed) is a column named by the function, or
    `reward/<name>` where the name is one of the record's own columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            row = {"index": s.index, "group_index": s.group_index, "prompt": s.prompt, "response": s.response,
                   "label": label_of(s), "reward": None if math.isnan(s.reward) else s.reward,  # NaN: nothing scored
                   "advantage": s.advantage, "status": s.status.value, "response_length": s.response_length,
                   "weight_version": s.weight_version, "token_versions": version_runs(s.token_versions),
                   # an episode's turns: [[1, model tokens], [0, environment tokens], ...]
                   "loss_mask": version_runs(s.loss_mask), "turns": s.turns,
                   "tool_calls": s.tool_calls, "logged": s.logged,  # reward functions' log_extra
                   "rollout_logprob_mean": sum(s.rollout_log_probs) / max(len(s.rollout_log_probs), 1),
                   "logprob_abs_diff_mean": mismatch.get(s.index)}
            f.write(json.dumps(row | {score_column(name, row): value for name, value in s.scores.items()}) + "\n")


def label_of(sample: Sample) -> str | None:
    """The label as the dumps write it: text, or null for a row without one."""
    return None if sample.label is None else str(sample.label)


def version_runs(versions: list[int]) -> list[list[int]]:
    """[[version, tokens], ...] in response order: which weights sampled which stretch of a response (or, for
    the loss mask, which stretches the model wrote and which the environment appended)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def dump_eval(passes: list[tuple[bool, list[Sample]]], path: Path) -> None:
    """An eval's generations, a JSON line per sample; `passes`: (greedy or not, its samples)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for greedy, samples in passes:
            for s in samples:
                f.write(json.dumps({"prompt": s.prompt, "response": s.response, "label": label_of(s),
                                    "correct": s.reward, "greedy": greedy, "status": s.status.value,
                                    "response_length": s.response_length,
                                    "weight_version": s.weight_version}) + "\n")
