"""The RL loop, top to bottom: `torchrun --nproc-per-node N -m rl.main --config FILE [--section.key=value ...]`.

Every rank runs this same program: it generates its share of prompt groups with its
own engine, scores them, gathers the rollout, trains its length-balanced share with
FSDP2, and pushes the new weights into its engine (seed steps 1-55, with Ray actors
and HTTP calls replaced by function calls and collectives).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rl import parallel
from rl.algo import grpo_advantages
from rl.config import Config, ConfigError, check_paths, dump, load_config, resolve
from rl.data import PromptDataset, Sample, Status
from rl.invariant import make_batch_invariant
from rl.metrics import make_logger, memory_phase
from rl.parallel import print0
from rl.reward import RewardInput, RewardPool
from rl.reward import metrics as reward_metrics
from rl.reward import reduce_metrics as reduce_reward_metrics
from rl.policy import PolicyOffloader, build_optimizer, load_hf_model, shard_policy
from rl.rollout import SamplingParams, build_engine, engine_dtype, generate_rollout
from rl.train import build_schedule, train_metrics, train_on_rollout
from rl.weights import sync_weights


def score(pool: RewardPool, samples: list[Sample], max_new_tokens: int) -> dict[str, float]:
    inputs = [RewardInput(s.prompt, s.response, s.label, s.response_length, max_new_tokens, s.metadata)
              for s in samples]
    result = pool.score(inputs)
    for sample, reward in zip(samples, result.rewards, strict=True):
        sample.reward = reward
    return reward_metrics(result)


def keep_group(group: list[Sample], dynamic_filter: str) -> bool:
    """Seed step 27's filter: a group whose rewards are all equal has zero advantage everywhere."""
    if dynamic_filter == "nonzero_std":
        return len({s.reward for s in group}) > 1
    return True


def collect_rollout(dataset: PromptDataset, engine, pool: RewardPool, sampling: SamplingParams, tokenizer,
                    weight_version: int, cfg: Config, dist: parallel.Dist) -> tuple[list[Sample], dict[str, float]]:
    """Draws rounds of `over_sampling_batch_size` prompts until `rollout_batch_size` groups pass the
    dynamic filter (seed steps 16-28). Each rank generates and scores a contiguous share of every
    round; the scored groups are gathered so all ranks filter and keep the same ones, in order."""
    ro = cfg.rollout
    tp = ro.tensor_parallel_size
    kept, dropped, per_rank_reward_stats = [], [], []
    rollout_s = reward_s = 0.0
    rounds = 0
    while len(kept) < ro.rollout_batch_size and rounds < ro.max_sampling_rounds:
        rounds += 1
        groups = dataset.next_groups(ro.over_sampling_batch_size, ro.n_samples_per_prompt)
        mine = parallel.shard_groups(groups, dist.rank // tp, dist.world_size // tp)
        t = time.perf_counter()
        local = generate_rollout(engine, mine, sampling, weight_version, tokenizer,
                                 progress=cfg.log.progress and dist.is_main)
        rollout_s += parallel.all_reduce_max(time.perf_counter() - t)
        t = time.perf_counter()
        per_rank_reward_stats += parallel.all_gather_objects([score(pool, local, ro.max_new_tokens)])
        reward_s += time.perf_counter() - t
        scored = parallel.gather_engine_outputs(local, tp)  # engine order == group order: shards are contiguous
        for start in range(0, len(scored), ro.n_samples_per_prompt):
            group = scored[start : start + ro.n_samples_per_prompt]
            (kept if keep_group(group, ro.dynamic_filter) else dropped).append(group)
    drop_frac = len(dropped) / (len(kept) + len(dropped))
    if len(kept) < ro.rollout_batch_size:  # out of rounds: top up with filtered groups, which train as zeros
        print0(f"rollout: only {len(kept)}/{ro.rollout_batch_size} groups passed rollout.dynamic_filter "
               f"in {rounds} rounds; topping up with filtered groups")
        kept += dropped[: ro.rollout_batch_size - len(kept)]
    samples = [s for group in kept[: ro.rollout_batch_size] for s in group]  # extra groups are discarded
    stats = {**reduce_reward_metrics(per_rank_reward_stats), "rollout/sampling_rounds": rounds,
             "rollout/filtered_group_frac": drop_frac, "perf/rollout_s": rollout_s, "perf/reward_s": reward_s}
    return samples, stats


def assign_advantages(samples: list[Sample], std_normalization: bool) -> None:
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.tensor([s.group_index for s in samples])
    for sample, adv in zip(samples, grpo_advantages(rewards, groups, std_normalization).tolist()):
        sample.advantage = adv


def rollout_metrics(samples: list[Sample], n_samples_per_prompt: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([float(s.response_length) for s in samples])
    group_std = rewards.view(-1, n_samples_per_prompt).std(dim=1)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_group_frac": (group_std == 0).float().mean().item(),
        "rollout/num_samples": float(len(samples)),
    }


def main(argv: list[str]) -> None:
    cfg = load_config(argv)  # config errors surface before any process group or model exists
    check_paths(cfg)
    dist = parallel.init_distributed()
    cfg = resolve(cfg, dist.world_size)
    if cfg.model.batch_invariant and dist.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("model.batch_invariant runs the native engine's Triton kernels in the trainer too: it needs "
                          "a CUDA device (on a CPU only under TRITON_INTERPRET=1, for tests)")
    out_dir = Path(cfg.log.output_dir)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(dump(cfg))
    print0(f"rl: world_size={dist.world_size} device={dist.device.type}\n{dump(cfg)}")

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    print0(f"data: {len(dataset.prompts)} prompts, {dataset.num_filtered} dropped by max_prompt_len")
    reward_pool = RewardPool(cfg.reward)
    logger = make_logger(dist.is_main, cfg.log.output_dir, cfg.to_dict(), cfg.log.wandb,
                         cfg.log.wandb_project, cfg.log.run_name)

    policy = load_hf_model(cfg.model, cfg.train.seed)
    if cfg.model.batch_invariant:
        policy = make_batch_invariant(policy, cfg.rollout.max_context_len)
    policy = shard_policy(policy, dist.mesh, dist.device, cfg.model.gradient_checkpointing)
    optimizer, scheduler = build_optimizer(policy, cfg.train)
    engine = build_engine(cfg.rollout, cfg.model.path, policy.config, dist.device, dist.rank, cfg.model.batch_invariant)
    dtype = engine_dtype(cfg.rollout.dtype, dist.device)
    eos = tokenizer.eos_token_id
    sampling = SamplingParams.from_config(cfg.rollout, [eos] if isinstance(eos, int) else eos or [])

    sync_weights(policy, engine, dtype, cfg.weights.bucket_mb)  # seed step 8: first push is version 1
    weight_version = 1
    offloader = PolicyOffloader(policy, optimizer) if cfg.train.offload else None
    if offloader:
        offloader.offload()
    try:
        for rollout_id in range(cfg.train.num_rollout):
            step_start = time.perf_counter()
            # B. rollout (seed steps 14-32)
            samples, rollout_stats = collect_rollout(dataset, engine, reward_pool, sampling, tokenizer,
                                                     weight_version, cfg, dist)
            assign_advantages(samples, cfg.algo.grpo_std_normalization)
            memory = memory_phase("rollout", dist.device)

            # C. the engine yields its memory
            t = time.perf_counter()
            engine.sleep(cfg.rollout.sleep_level)
            offload_s = time.perf_counter() - t
            memory |= memory_phase("asleep", dist.device)

            # D. train
            t = time.perf_counter()
            if offloader:
                offloader.onload(dist.device)
            onload_train_s = time.perf_counter() - t
            t = time.perf_counter()
            steps, step_tokens, padding = build_schedule(samples, cfg.train, dist.rank, dist.world_size, dist.device)
            local_stats = train_on_rollout(policy, optimizer, scheduler, steps, step_tokens, dist.world_size,
                                           cfg.train, cfg.algo, cfg.rollout.temperature)
            train_stats = train_metrics(parallel.all_gather_objects([local_stats]), len(steps))
            train_stats["train/padding_micro_batches"] = padding
            train_s = time.perf_counter() - t
            memory |= memory_phase("train", dist.device)

            # E. weights into the engine, version + 1
            t = time.perf_counter()
            engine.wake_up(["weights"])
            onload_weights_s = time.perf_counter() - t
            sync_stats = sync_weights(policy, engine, dtype, cfg.weights.bucket_mb)
            weight_version += 1
            t = time.perf_counter()
            if offloader:
                offloader.offload()
            offload_train_s = time.perf_counter() - t
            engine.reset_prefix_cache()
            t = time.perf_counter()
            engine.wake_up(["kv_cache"])
            onload_kv_s = time.perf_counter() - t
            memory |= memory_phase("weight_sync", dist.device)

            metrics = {"rollout_id": rollout_id, "weight_version": weight_version,
                       **rollout_metrics(samples, cfg.rollout.n_samples_per_prompt), **rollout_stats,
                       **train_stats, **sync_stats, **memory, "perf/offload_s": offload_s, "perf/train_s": train_s,
                       "perf/onload_train_s": onload_train_s, "perf/offload_train_s": offload_train_s,
                       "perf/onload_weights_s": onload_weights_s, "perf/onload_kv_s": onload_kv_s,
                       "perf/step_s": time.perf_counter() - step_start,
                       "data/epoch": dataset.epoch, "data/prompts_filtered": dataset.num_filtered}
            metrics["perf/rollout_tokens_per_s"] = (
                metrics["rollout/response_length_mean"] * len(samples) / max(metrics["perf/rollout_s"], 1e-9))
            logger.log(metrics)
    finally:
        logger.close()
        reward_pool.close()
    engine.close()  # vLLM's model-parallel groups go before the process group they live in
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
