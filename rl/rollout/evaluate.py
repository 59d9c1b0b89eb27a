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
import time
from pathlib import Path

from rl.config import Config, ConfigError, DataConfig, EvalConfig
from rl.data import EVAL_KEYS, Prompt, PromptDataset, Status, expand_groups, load_prompts
from rl.parallel import print0
from rl.rollout import SamplingParams
from rl.rollout.collect import Collector, dump_eval


def load_eval_prompts(ev: EvalConfig, data: DataConfig, tokenizer, training: list[Prompt]) -> tuple[list[Prompt], int]:
    """The eval prompts not among the training prompts, and how many were dropped for being there. Read with
    data's keys and templates; errors name eval.source and eval.task_config."""
    source = dataclasses.replace(data, source=ev.source, split=ev.split, num_examples=ev.num_examples, seed=ev.seed,
                                 task_config=ev.task_config if ev.task_config is not None else data.task_config)
    prompts = load_prompts(source, tokenizer, EVAL_KEYS)[0][: ev.num_examples]
    seen = {p.text for p in training}
    held_out = [p for p in prompts if p.text not in seen]
    return held_out, len(prompts) - len(held_out)


def pass_at_k(correct: list[list[float]]) -> float:
    """Share of prompts with at least one correct sample among their k (`correct`: per prompt, k scores in [0, 1])."""
    return sum(max(scores) >= 1.0 for scores in correct) / max(len(correct), 1)


def evaluate(collector: Collector, prompts: list[Prompt], ev: EvalConfig, sampling: SamplingParams,
             weight_version: int, barrier_timeout_s: float, dump_to: Path | None) -> dict[str, float]:
    """eval/accuracy (greedy pass@1), eval/pass@k (k = eval.n_samples at eval.temperature), lengths, time, and
    eval/reward_errors: samples of either pass whose reward raised or timed out, and so count as wrong."""
    start = time.perf_counter()
    greedy = dataclasses.replace(sampling, temperature=1.0, top_k=1, top_p=1.0)
    passes = [(True, collector.generate_and_score(expand_groups(prompts, 1, 0, 0), greedy, weight_version,
                                                  (ev.seed,), barrier_timeout_s, term="correct"))]
    samples = passes[0][1].samples
    stats = {"eval/accuracy": sum(s.reward for s in samples) / len(samples),
             "eval/response_length_mean": sum(s.response_length for s in samples) / len(samples),
             "eval/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
             "eval/num_prompts": len(samples)}
    if collector.generator.episodic:  # accuracy with tools, and how often the model used them
        stats |= {"eval/turns_mean": sum(s.turns for s in samples) / len(samples),
                  "eval/tool_calls_mean": sum(s.tool_calls for s in samples) / len(samples),
                  "eval/tool_call_frac": sum(s.tool_calls > 0 for s in samples) / len(samples)}
    if ev.n_samples > 1:
        sampled = dataclasses.replace(sampling, temperature=ev.temperature)
        passes.append((False, collector.generate_and_score(expand_groups(prompts, ev.n_samples, 0, 0), sampled,
                                                           weight_version, (ev.seed + 1,), barrier_timeout_s,
                                                           term="correct")))
        drawn = passes[1][1].samples
        per_prompt = [[s.reward for s in drawn[i : i + ev.n_samples]] for i in range(0, len(drawn), ev.n_samples)]
        stats[f"eval/pass@{ev.n_samples}"] = pass_at_k(per_prompt)
    if dump_to is not None and collector.dist.is_main:
        dump_eval([(greedy_pass, scored.samples) for greedy_pass, scored in passes], dump_to)
    # Only an engine's first rank scores: the reward metrics hold each engine's count once.
    stats["eval/reward_errors"] = sum(m["reward/num_errors"] + m["reward/num_timeouts"]
                                      for _, scored in passes for m in scored.stats.reward_stats)
    stats["perf/eval_s"] = time.perf_counter() - start
    return stats


def held_out_prompts(cfg: Config, tokenizer, dataset: PromptDataset) -> list:
    """The run's eval prompts less those that are also training prompts; none left is a ConfigError."""
    prompts, overlapping = load_eval_prompts(cfg.eval, cfg.data, tokenizer, dataset.prompts)
    if not prompts:
        raise ConfigError(f"eval.source={cfg.eval.source!r}: every eval prompt also appears among the training "
                          f"prompts; choose another eval.source or eval.seed (a generated task draws item i from "
                          f"seed + i: eval.seed={cfg.eval.seed} must be clear of data.seed={cfg.data.seed} .. "
                          f"+ data.num_examples={cfg.data.num_examples}), or a task with more distinct prompts")
    print0(f"eval: {len(prompts)} held-out prompts ({overlapping} dropped: also training prompts)")
    return prompts
