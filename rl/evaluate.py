"""Held-out evaluation on the awake engine, between rollouts: greedy accuracy and pass@k.

The eval prompts come from their own source and seed (`[eval]`), go through the same
templates as the training prompts, and any prompt whose text also appears among the
training prompts is dropped (counted), so the numbers are on held-out data. Each engine
generates a contiguous share (the last ones may get fewer prompts, or none), the first rank of
each engine scores it with the reward pool's `correct` term, and every rank gets the
same metrics. A sample whose reward raised or timed out counts as wrong, and as one of
`eval/reward_errors`, so a failing reward shows instead of reading as a weak policy.
It needs no weight sync: it runs on the weights the engine already holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from rl import parallel
from rl.config import DataConfig, EvalConfig, RolloutConfig
from rl.data import EVAL_KEYS, Prompt, Sample, Status, expand_groups, load_prompts
from rl.reward import RewardInput, RewardPool
from rl.rollout import SamplingParams, derive_seed, generate_rollout


def load_eval_prompts(ev: EvalConfig, data: DataConfig, tokenizer, training: list[Prompt]) -> tuple[list[Prompt], int]:
    """The eval prompts not among the training prompts, and how many were dropped for being there. Read with
    data's keys and templates; errors name eval.source and eval.task_config."""
    source = dataclasses.replace(data, source=ev.source, num_examples=ev.num_examples, seed=ev.seed,
                                 task_config=ev.task_config if ev.task_config is not None else data.task_config)
    prompts = load_prompts(source, tokenizer, EVAL_KEYS)[0][: ev.num_examples]
    seen = {p.text for p in training}
    held_out = [p for p in prompts if p.text not in seen]
    return held_out, len(prompts) - len(held_out)


def pass_at_k(correct: list[list[float]]) -> float:
    """Share of prompts with at least one correct sample among their k (`correct`: per prompt, k scores in [0, 1])."""
    return sum(max(scores) >= 1.0 for scores in correct) / max(len(correct), 1)


def share(items: list, index: int, parts: int) -> list:
    """Contiguous share `index` of `parts`, ceil(len / parts) items each, the last ones fewer or none
    (every item goes to exactly one share)."""
    step = math.ceil(len(items) / parts)
    return items[index * step : (index + 1) * step]


def generate_and_score(engine, pool: RewardPool | None, prompts: list[Prompt], n: int, params: SamplingParams,
                       weight_version: int, tokenizer, tp: int, dist: parallel.Dist) -> tuple[list[Sample], int]:
    """Every prompt's `n` samples, scored (`Sample.reward` holds the `correct` term), on every rank, in prompt order,
    and how many of them scored 0.0 because the reward raised or timed out (summed over engines)."""
    groups = expand_groups(prompts, n, 0, 0)
    engine_index = dist.rank // tp
    mine = share(groups, engine_index, dist.world_size // tp)
    params = dataclasses.replace(params, seed=derive_seed(params.seed, engine_index))  # engines draw apart
    local = generate_rollout(engine, mine, params, weight_version, tokenizer) if mine else []
    failed = 0
    if pool is not None and local:
        result = pool.score([RewardInput(s.prompt, s.response, s.label, s.response_length, params.max_new_tokens,
                                         s.metadata) for s in local])
        for sample, correct in zip(local, result.terms["correct"], strict=True):
            sample.reward = correct
        failed = result.num_errors + result.num_timeouts
    # Only an engine's first rank scores, so the other ranks add 0.
    return parallel.gather_engine_outputs(local, tp), sum(parallel.all_gather_objects([failed]))


def evaluate(engine, pool: RewardPool | None, prompts: list[Prompt], ev: EvalConfig, ro: RolloutConfig,
             sampling: SamplingParams, weight_version: int, tokenizer, dist: parallel.Dist,
             dump_to: Path | None) -> dict[str, float]:
    """eval/accuracy (greedy pass@1), eval/pass@k (k = eval.n_samples at eval.temperature), lengths, time, and
    eval/reward_errors: samples of either pass whose reward raised or timed out, and so count as wrong."""
    start = time.perf_counter()
    tp = ro.tensor_parallel_size
    greedy = dataclasses.replace(sampling, temperature=1.0, top_k=1, top_p=1.0, seed=ev.seed)
    samples, reward_errors = generate_and_score(engine, pool, prompts, 1, greedy, weight_version, tokenizer, tp, dist)
    stats = {"eval/accuracy": sum(s.reward for s in samples) / len(samples),
             "eval/response_length_mean": sum(s.response_length for s in samples) / len(samples),
             "eval/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
             "eval/num_prompts": len(samples)}
    drawn: list[Sample] = []
    if ev.n_samples > 1:
        sampled = dataclasses.replace(sampling, temperature=ev.temperature, seed=ev.seed + 1)
        drawn, drawn_errors = generate_and_score(engine, pool, prompts, ev.n_samples, sampled, weight_version,
                                                 tokenizer, tp, dist)
        reward_errors += drawn_errors
        per_prompt = [[s.reward for s in drawn[i : i + ev.n_samples]] for i in range(0, len(drawn), ev.n_samples)]
        stats[f"eval/pass@{ev.n_samples}"] = pass_at_k(per_prompt)
    if dump_to is not None and dist.is_main:
        dump_to.parent.mkdir(parents=True, exist_ok=True)
        with dump_to.open("w") as f:
            for greedy_pass, batch in ((True, samples), (False, drawn)):
                for s in batch:
                    f.write(json.dumps({"prompt": s.prompt, "response": s.response, "label": str(s.label),
                                        "correct": s.reward, "greedy": greedy_pass, "status": s.status.value,
                                        "response_length": s.response_length,
                                        "weight_version": s.weight_version}) + "\n")
    stats["eval/reward_errors"] = reward_errors
    stats["perf/eval_s"] = time.perf_counter() - start
    return stats
