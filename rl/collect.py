"""Generate -> score -> gather: the one path from prompt groups to scored samples, for training rollouts and
held-out evals alike, and the JSONL dumps of what it produced.

Every rank holds the same list of groups. Each engine (a tensor-parallel group of contiguous ranks, one rank
without TP) generates a contiguous share of whole groups, so the n samples of a prompt stay on one engine
and can share its prefix cache; the engine's first rank scores them in the reward pool (its TP peers hold
the same samples), and the scored samples are gathered so that every rank ends with all of them, in group
order. A training rollout adds rounds on top (the dynamic-sampling filter and its over-sampling refill).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from rl import parallel
from rl.config import RolloutConfig
from rl.data import PromptDataset, Sample, Status
from rl.parallel import print0
from rl.reward import RewardInput, RewardPool
from rl.reward import metrics as reward_metrics
from rl.reward import reduce_metrics as reduce_reward_metrics
from rl.rollout import SamplingParams, derive_seed, generate_rollout


@dataclasses.dataclass
class Scored:
    """One generate -> score -> gather pass: every sample on every rank, each scoring rank's reward metrics,
    and the slowest rank's generation and scoring seconds."""

    samples: list[Sample]
    reward_stats: list[dict[str, float]]
    rollout_s: float
    reward_s: float


class Collector:
    def __init__(self, engine, pool: RewardPool | None, tokenizer, ro: RolloutConfig, dist: parallel.Dist,
                 progress: bool = False):
        self.engine, self.pool, self.tokenizer, self.ro, self.dist = engine, pool, tokenizer, ro, dist
        self.progress = progress and dist.is_main  # a bar for training rollouts
        self.engine_index = dist.rank // ro.tensor_parallel_size
        self.num_engines = dist.world_size // ro.tensor_parallel_size

    def generate_and_score(self, groups: list[list[Sample]], params: SamplingParams, weight_version: int,
                           seed: tuple[int, ...], barrier_timeout_s: float, term: str = "reward",
                           progress: bool = False) -> Scored:
        """This engine's share of `groups` generated (sampling seed: `seed` + the engine's index, so a rerun
        draws the same), scored (`Sample.reward` is the reward, or one of its terms: "correct" for evals),
        and gathered."""
        mine = parallel.engine_share(groups, self.engine_index, self.num_engines)
        params = dataclasses.replace(params, seed=derive_seed(*seed, self.engine_index))
        start = time.perf_counter()
        local = generate_rollout(self.engine, mine, params, weight_version, self.tokenizer,
                                 progress=progress) if mine else []
        parallel.step_barrier(self.dist, barrier_timeout_s, "the end of rollout generation")
        rollout_s = parallel.all_reduce_max(time.perf_counter() - start)
        start = time.perf_counter()
        stats = [self.score(local, term)] if self.pool is not None and local else []
        reward_stats = parallel.all_gather_objects(stats)
        reward_s = time.perf_counter() - start
        # Engine order is group order: the shares are contiguous.
        return Scored(parallel.gather_engine_outputs(local, self.ro.tensor_parallel_size), reward_stats, rollout_s,
                      reward_s)

    def score(self, samples: list[Sample], term: str) -> dict[str, float]:
        result = self.pool.score([RewardInput(s.prompt, s.response, s.label, s.response_length,
                                              self.ro.max_new_tokens, s.metadata, s.raw_prompt, s.columns,
                                              s.tokens[s.prompt_length:], s.group_index) for s in samples])
        values = result.rewards if term == "reward" else result.terms[term]
        for sample, value in zip(samples, values, strict=True):
            sample.reward = value
        return reward_metrics(result)

    def rollout(self, dataset: PromptDataset, sampling: SamplingParams, weight_version: int, rollout_id: int,
                barrier_timeout_s: float) -> tuple[list[Sample], dict[str, float]]:
        """Rounds of `over_sampling_batch_size` prompts until `rollout_batch_size` groups pass the dynamic
        filter (groups whose rewards all match carry no signal), topped up with filtered groups when the
        rounds run out; every rank keeps the same groups, in order."""
        ro = self.ro
        kept, dropped, reward_stats = [], [], []
        rollout_s = reward_s = 0.0
        rounds = 0
        while len(kept) < ro.rollout_batch_size and rounds < ro.max_sampling_rounds:
            rounds += 1
            groups = dataset.next_groups(ro.over_sampling_batch_size, ro.n_samples_per_prompt)
            # The sampling stream depends only on (seed, rollout, round, engine): a resumed run redraws it.
            scored = self.generate_and_score(groups, sampling, weight_version, (ro.seed, rollout_id, rounds),
                                             barrier_timeout_s, progress=self.progress)
            reward_stats += scored.reward_stats
            rollout_s += scored.rollout_s
            reward_s += scored.reward_s
            for start in range(0, len(scored.samples), ro.n_samples_per_prompt):
                group = scored.samples[start : start + ro.n_samples_per_prompt]
                (kept if keep_group(group, ro.dynamic_filter) else dropped).append(group)
        all_scored = [s for group in kept + dropped for s in group]
        drop_frac = len(dropped) / (len(kept) + len(dropped))
        topped_up = max(ro.rollout_batch_size - len(kept), 0)
        if topped_up:  # out of rounds: top up with filtered groups, which train as zeros
            print0(f"rollout: only {len(kept)}/{ro.rollout_batch_size} groups passed rollout.dynamic_filter "
                   f"in {rounds} rounds; topping up with {topped_up} filtered groups (zero advantage)")
            kept += dropped[:topped_up]
        samples = [s for group in kept[: ro.rollout_batch_size] for s in group]  # extra groups are discarded
        stats = {**reduce_reward_metrics(reward_stats), "rollout/sampling_rounds": rounds,
                 "rollout/filtered_group_frac": drop_frac, "rollout/topped_up_groups": topped_up,
                 "rollout/num_scored": len(all_scored),
                 "rollout/reward_mean_all_scored": sum(s.reward for s in all_scored) / len(all_scored),
                 "perf/rollout_s": rollout_s, "perf/reward_s": reward_s,
                 "perf/rollout_tokens_per_s": sum(s.response_length for s in all_scored) / max(rollout_s, 1e-9)}
        return samples, stats


def keep_group(group: list[Sample], dynamic_filter: str) -> bool:
    """The dynamic-sampling filter: a group whose rewards are all equal has zero advantage everywhere."""
    if dynamic_filter == "nonzero_std":
        return len({s.reward for s in group}) > 1
    return True


def rollout_metrics(samples: list[Sample], n_samples_per_prompt: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([float(s.response_length) for s in samples])
    per_group = rewards.view(-1, n_samples_per_prompt)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_group_frac": (per_group.amax(1) == per_group.amin(1)).float().mean().item(),
        "rollout/num_samples": float(len(samples)),
    }


def dump_rollout(samples: list[Sample], mismatch: dict[int, float], path: Path) -> None:
    """The experience record of one rollout, a JSON line per sample; `mismatch`: Sample.index -> mean
    |trainer - rollout logprob| over the sample's response tokens, before the update."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"index": s.index, "group_index": s.group_index, "prompt": s.prompt,
                                "response": s.response, "label": str(s.label), "reward": s.reward,
                                "advantage": s.advantage, "status": s.status.value,
                                "response_length": s.response_length, "weight_version": s.weight_version,
                                "rollout_logprob_mean": sum(s.rollout_log_probs) / max(len(s.rollout_log_probs), 1),
                                "logprob_abs_diff_mean": mismatch.get(s.index)})
                    + "\n")


def dump_eval(passes: list[tuple[bool, list[Sample]]], path: Path) -> None:
    """An eval's generations, a JSON line per sample; `passes`: (greedy or not, its samples)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for greedy, samples in passes:
            for s in samples:
                f.write(json.dumps({"prompt": s.prompt, "response": s.response, "label": str(s.label),
                                    "correct": s.reward, "greedy": greedy, "status": s.status.value,
                                    "response_length": s.response_length,
                                    "weight_version": s.weight_version}) + "\n")
