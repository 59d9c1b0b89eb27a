"""The RL loop, top to bottom: `torchrun --nproc-per-node N -m rl.main --config FILE [--section.key=value ...]`.

Every rank runs this same program: it generates its share of prompt groups with its
own engine, scores them, gathers the rollout, trains its length-balanced share with
FSDP2, and pushes the new weights into its engine (seed steps 1-55, with Ray actors
and HTTP calls replaced by function calls and collectives).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from rl import checkpoint, launch, parallel
from rl.algo import advantages, needs_old_logprobs
from rl.checks import check_model_and_tokenizer
from rl.config import (AlgoConfig, Config, ConfigError, RolloutConfig, TrainConfig, check_paths, dump, load_config,
                       resolve)
from rl.data import PromptDataset, Sample, Status
from rl.evaluate import evaluate, load_eval_prompts
from rl.flops import peak_bf16_flops, train_flops
from rl.export import export_policy
from rl.health import Health, RunStopped
from rl.metrics import graphs_compiled, keep_rows_before, make_logger, memory_phase, profiled, timed
from rl.parallel import print0
from rl.policy import PolicyOffloader, build_optimizer, build_policy
from rl.reward import RewardInput, RewardPool
from rl.reward import metrics as reward_metrics
from rl.reward import reduce_metrics as reduce_reward_metrics
from rl.rollout import SamplingParams, build_engine, derive_seed, engine_dtype, generate_rollout
from rl.critic import Critic, critic_metrics, gae_advantages
from rl.reference import Reference
from rl.train import (build_schedule, compute_old_logprobs, kl_rows, response_kl_sums, train_metrics,
                      train_on_rollout)
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


def collect_rollout(dataset: PromptDataset, engine, pool: RewardPool | None, sampling: SamplingParams, tokenizer,
                    weight_version: int, rollout_id: int, ro: RolloutConfig, progress: bool, dist: parallel.Dist,
                    barrier_timeout_s: float) -> tuple[list[Sample], dict[str, float]]:
    """Draws rounds of `over_sampling_batch_size` prompts until `rollout_batch_size` groups pass the
    dynamic filter (seed steps 16-28). Each engine generates a contiguous share of every round and
    its first rank scores it (the ranks of a TP group hold the same samples); the scored groups are
    gathered so all ranks filter and keep the same ones, in order."""
    tp = ro.tensor_parallel_size
    engine_index = dist.rank // tp
    kept, dropped, per_rank_reward_stats = [], [], []
    rollout_s = reward_s = 0.0
    rounds = 0
    while len(kept) < ro.rollout_batch_size and rounds < ro.max_sampling_rounds:
        rounds += 1
        groups = dataset.next_groups(ro.over_sampling_batch_size, ro.n_samples_per_prompt)
        mine = parallel.shard_groups(groups, engine_index, dist.world_size // tp)
        # The sampling stream depends only on (seed, rollout, round, engine): a resumed run redraws it.
        seeded = dataclasses.replace(sampling, seed=derive_seed(ro.seed, rollout_id, rounds, engine_index))
        t = time.perf_counter()
        local = generate_rollout(engine, mine, seeded, weight_version, tokenizer,
                                 progress=progress and dist.is_main)
        parallel.step_barrier(dist, barrier_timeout_s, "the end of rollout generation")
        rollout_s += parallel.all_reduce_max(time.perf_counter() - t)
        t = time.perf_counter()
        per_rank_reward_stats += parallel.all_gather_objects(
            [score(pool, local, ro.max_new_tokens)] if pool is not None else [])
        reward_s += time.perf_counter() - t
        scored = parallel.gather_engine_outputs(local, tp)  # engine order == group order: shards are contiguous
        for start in range(0, len(scored), ro.n_samples_per_prompt):
            group = scored[start : start + ro.n_samples_per_prompt]
            (kept if keep_group(group, ro.dynamic_filter) else dropped).append(group)
    all_scored = [s for group in kept + dropped for s in group]
    drop_frac = len(dropped) / (len(kept) + len(dropped))
    topped_up = max(ro.rollout_batch_size - len(kept), 0)
    if topped_up:  # out of rounds: top up with filtered groups, which train as zeros
        print0(f"rollout: only {len(kept)}/{ro.rollout_batch_size} groups passed rollout.dynamic_filter "
               f"in {rounds} rounds; topping up with {topped_up} filtered groups (zero advantage)")
        kept += dropped[:topped_up]
    samples = [s for group in kept[: ro.rollout_batch_size] for s in group]  # extra groups are discarded
    stats = {**reduce_reward_metrics(per_rank_reward_stats), "rollout/sampling_rounds": rounds,
             "rollout/filtered_group_frac": drop_frac, "rollout/topped_up_groups": topped_up,
             "rollout/num_scored": len(all_scored),
             "rollout/reward_mean_all_scored": sum(s.reward for s in all_scored) / len(all_scored),
             "perf/rollout_s": rollout_s, "perf/reward_s": reward_s,
             "perf/rollout_tokens_per_s": sum(s.response_length for s in all_scored) / max(rollout_s, 1e-9)}
    return samples, stats


def assign_advantages(samples: list[Sample], algo: AlgoConfig, kl_sums: dict[int, float] | None = None) -> None:
    """Seed step 30 with the estimator of algo.advantage_estimator; `kl_sums` (algo.kl_in_reward): each
    response's summed KL to the reference, subtracted from its reward (times kl_coef) first."""
    if algo.advantage_estimator == "gae":  # per token, from the critic's values in the train phase
        return
    kl_sums = kl_sums or {}
    rewards = torch.tensor([s.reward - algo.kl_coef * kl_sums.get(s.index, 0.0) for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in samples])
    tokens = torch.tensor([float(sum(s.loss_mask)) for s in samples])
    for sample, adv in zip(samples, advantages(algo.advantage_estimator, rewards, groups, algo.grpo_std_normalization,
                                               tokens).tolist()):
        sample.advantage = adv


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


def main(argv: list[str]) -> None:
    stop = launch.StopRequests(os.environ.get("RL_STOP_FILE"), os.environ.get("RANK", "0"))
    cfg = load_config(argv)  # config errors surface before any process group or model exists
    check_paths(cfg)
    dist = parallel.init_distributed()
    cfg = resolve(cfg, dist.world_size)
    if cfg.model.batch_invariant and dist.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("model.batch_invariant runs the native engine's Triton kernels in the trainer too: it needs "
                          "a CUDA device (on a CPU only under TRITON_INTERPRET=1, for tests)")
    out_dir = Path(cfg.log.output_dir)
    restarts = launch.restart_count()
    restart_stats = {"run/restarts": restarts}
    if restarts:  # torchrun started every rank again after one died: resume from the newest checkpoint
        restart_stats["run/restart_cause"] = launch.restart_cause(launch.previous_attempt_errors())
        print0(f"rl: restart {restarts} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}, after: "
               f"{restart_stats['run/restart_cause']}")
    lock, resume_from = claim_output_dir(cfg, dist, restarted=restarts > 0)
    print0(f"rl: world_size={dist.world_size} device={dist.device.type}\n{dump(cfg)}")

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    eos_ids = check_model_and_tokenizer(cfg.model, cfg.rollout, AutoConfig.from_pretrained(cfg.model.path), tokenizer)
    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    print0(f"data: {len(dataset.prompts)} prompts, {dataset.num_filtered} dropped by max_prompt_len")
    # Only the first rank of each engine scores: the ranks of a TP group hold the same samples.
    reward_pool = RewardPool(cfg.reward) if dist.rank % cfg.rollout.tensor_parallel_size == 0 else None

    eval_prompts: list = []
    if cfg.eval.source:
        eval_prompts, overlapping = load_eval_prompts(cfg.eval, cfg.data, tokenizer, dataset.prompts)
        if not eval_prompts:
            raise ConfigError(f"eval.source={cfg.eval.source!r}: every eval prompt also appears among the training "
                              f"prompts; choose another eval.source or eval.seed (a generated task draws item i from "
                              f"seed + i: eval.seed={cfg.eval.seed} must be clear of data.seed={cfg.data.seed} .. "
                              f"+ data.num_examples={cfg.data.num_examples}), or a task with more distinct prompts")
        print0(f"eval: {len(eval_prompts)} held-out prompts ({overlapping} dropped: also training prompts)")

    t = time.perf_counter()
    policy = build_policy(cfg.model, dist.mesh, dist.device, cfg.train.seed, cfg.rollout.max_context_len)
    print0(f"policy: built, sharded and loaded in {time.perf_counter() - t:.1f} s; host memory peak of rank 0 "
           f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    optimizer, scheduler = build_optimizer(policy, cfg.train)
    reference = None
    if cfg.algo.kl_coef > 0:
        t = time.perf_counter()
        reference = Reference(cfg.model, dist.mesh, dist.device, cfg.train.seed, cfg.rollout.max_context_len)
        print0(f"reference: {cfg.model.ref_path or 'the initial policy'}, built in {time.perf_counter() - t:.1f} s "
               f"and parked in host memory")
    critic = None
    if cfg.algo.advantage_estimator == "gae":
        critic = Critic(cfg.model, cfg.critic, cfg.train, dist.mesh, dist.device, cfg.rollout.max_context_len)
        print0(f"critic: {cfg.critic.path or cfg.model.path} with a value head, lr {cfg.critic.lr}")
    critic_state = (critic.model, critic.optimizer) if critic else None
    health = Health(cfg.train.max_bad_steps, cfg.reward.max_failed_steps, policy.config.vocab_size)
    start, weight_version = 0, 1  # seed step 8: the first push is version 1
    if resume_from:
        t = time.perf_counter()
        path, state = checkpoint.load_newest(resume_from, policy, optimizer, critic_state)
        if critic:
            critic.scheduler.load_state_dict(state.critic_scheduler)
        scheduler.load_state_dict(state.scheduler)
        dataset.load_state_dict(state.data)
        health.load_state_dict(state.health)
        start, weight_version = state.rollout_id + 1, state.weight_version
        apply_optimizer_config(optimizer, scheduler, cfg.train, state.config.get("train", {}))
        print0(f"checkpoint: resumed from {path} in {time.perf_counter() - t:.1f} s: rollout {start} next, "
               f"weight_version {weight_version}")
    engine = build_engine(cfg.rollout, cfg.model.path, policy.config, dist.device, dist.rank, cfg.model.batch_invariant)
    if resume_from:  # after the engine build, which seeds the global generators (vLLM does)
        checkpoint.restore_rng(path, state)
    dtype = engine_dtype(cfg.rollout.dtype, dist.device)
    sampling = SamplingParams.from_config(cfg.rollout, eos_ids)
    sync_weights(policy, engine, dtype, cfg.weights.bucket_mb)
    offloader = PolicyOffloader(policy, optimizer) if cfg.train.offload else None
    if offloader:
        offloader.offload()
    if critic:
        critic.offload()
    finished = start >= cfg.train.num_rollout
    # A resumed run replaces the rows written after its checkpoint; a finished one keeps all (its final eval too).
    logger = make_logger(dist.is_main, cfg.log.output_dir, cfg.to_dict(), cfg.log.wandb, cfg.log.wandb_project,
                         cfg.log.run_name, start_rollout=None if finished else start)
    barrier_timeout_s = cfg.train.collective_timeout_s
    hf_sources = [Path(cfg.model.path), Path(cfg.model.tokenizer or cfg.model.path)]
    if finished:
        print0(f"rl: the run in {out_dir} already finished rollout {start - 1} (train.num_rollout="
               f"{cfg.train.num_rollout}); pass a larger --train.num_rollout to train further")
    end = cfg.train.num_rollout
    if not finished and stop_requested(stop):  # nothing trained yet: nothing to save
        print0(f"rl: stopped before rollout {start} ({stop.reason() or 'a stop request on another rank'}): nothing "
               f"new to save; run the same command to {'resume' if start else 'start'}")
        end = start
    try:
        for rollout_id in range(start, end):
            step_start, times = time.perf_counter(), {}
            # A. held-out eval of the weights this rollout generates with (rollout 0: before the first update)
            eval_stats = {}
            if eval_prompts and rollout_id % cfg.eval.interval == 0:
                eval_stats = run_eval(engine, reward_pool, eval_prompts, cfg, sampling, weight_version, tokenizer,
                                      dist, rollout_id)
            # B. rollout (seed steps 14-32)
            samples, rollout_stats = collect_rollout(dataset, engine, reward_pool, sampling, tokenizer,
                                                     weight_version, rollout_id, cfg.rollout, cfg.log.progress, dist,
                                                     barrier_timeout_s if rollout_id > start else STARTUP_TIMEOUT_S)
            try:
                health.after_rewards(int(rollout_stats["rollout/num_scored"]),
                                     int(rollout_stats["reward/num_errors"] + rollout_stats["reward/num_timeouts"]))
            except RunStopped:  # the step's rollout row is kept
                logger.log({"rollout_id": rollout_id, "weight_version": weight_version, **rollout_stats,
                            **health.metrics()})
                raise
            assign_advantages(samples, cfg.algo)
            memory = memory_phase("rollout", dist.device)

            # C. the engine yields its memory
            with timed(times, "perf/offload_s"):
                engine.sleep(cfg.rollout.sleep_level)
            memory |= memory_phase("asleep", dist.device)

            # D. train
            with timed(times, "perf/onload_train_s"):
                if offloader:
                    offloader.onload(dist.device)
            profile = out_dir / "profile" / f"train_rollout_{rollout_id}_rank{dist.rank}.txt" \
                if rollout_id == cfg.log.profile_rollout else None
            with timed(times, "perf/train_s"), profiled(profile), graphs_compiled(times, "perf/train_graphs_compiled"):
                steps, step_tokens, step_seqs, padding = build_schedule(samples, cfg.train, dist.rank,
                                                                        dist.world_size, dist.device,
                                                                        cfg.rollout.max_context_len)
                micro_batches = [mb for step in steps for mb in step]
                old, ref, extra_stats = {}, None, {}
                if reference is not None:
                    with timed(times, "perf/ref_logprobs_s"):
                        ref = reference.logprobs(micro_batches, cfg.rollout.temperature)
                if cfg.algo.kl_in_reward:  # the advantages wait for the KL of each response
                    old = compute_old_logprobs(policy, micro_batches, cfg.rollout.temperature)
                    kl = kl_rows(cfg.algo.kl_estimator, old, ref)
                    kl_sums = {i: s for part in parallel.all_gather_objects([response_kl_sums(kl, micro_batches)])
                               for i, s in part.items()}
                    extra_stats["train/kl_reward_penalty"] = cfg.algo.kl_coef * sum(kl_sums.values()) / len(samples)
                    if not critic:
                        assign_advantages(samples, cfg.algo, kl_sums)
                        steps, step_tokens, step_seqs, padding = build_schedule(samples, cfg.train, dist.rank,
                                                                                dist.world_size, dist.device,
                                                                                cfg.rollout.max_context_len)
                if critic:  # GAE: the critic's values of this rank's samples give per-token advantages
                    with timed(times, "perf/critic_s"):
                        critic.onload()
                        values = critic.values(micro_batches)
                    returns = gae_advantages(micro_batches, values, {s.index: s.reward for s in samples},
                                             kl if cfg.algo.kl_in_reward else None, cfg.algo)
                local_stats = train_on_rollout(policy, optimizer, scheduler, steps, step_tokens, dist.world_size,
                                               cfg.train, cfg.algo, cfg.rollout.temperature, step_seqs, old, ref)
                if critic:
                    with timed(times, "perf/critic_s"):
                        extra_stats |= critic_metrics(parallel.all_gather_objects(
                            [critic.update(steps, step_tokens, values, returns, dist.world_size)]), len(steps))
                        critic.offload()
                per_rank = parallel.all_gather_objects([local_stats])
                train_stats = train_metrics(per_rank, len(steps), cfg.algo) | extra_stats
            train_stats["train/padding_micro_batches"] = padding
            train_stats |= train_throughput(policy.config, samples, times, dist,
                                            extra_forward=bool(old) or needs_old_logprobs(cfg.train, cfg.algo))
            memory |= memory_phase("train", dist.device)

            # E. weights into the engine, version + 1 (the same weights and version when every step was skipped:
            # a sleeping engine may have dropped its copy)
            with timed(times, "perf/onload_weights_s"):
                engine.wake_up(["weights"])
            sync_stats = sync_weights(policy, engine, dtype, cfg.weights.bucket_mb)
            weight_version += int(train_stats["train/skipped_steps"] < len(steps))
            with timed(times, "perf/offload_train_s"):
                if offloader:
                    offloader.offload()
            engine.reset_prefix_cache()
            with timed(times, "perf/onload_kv_s"):
                engine.wake_up(["kv_cache"])
            memory |= memory_phase("weight_sync", dist.device)

            if cfg.log.sample_interval and rollout_id % cfg.log.sample_interval == 0 and dist.is_main:
                mismatch = {i: m for stats in per_rank for i, m in stats["sample_mismatch"].items()}
                dump_samples(samples, mismatch, out_dir / "samples" / f"rollout_{rollout_id}.jsonl")
            row = {"rollout_id": rollout_id, "weight_version": weight_version, **restart_stats,
                   **rollout_metrics(samples, cfg.rollout.n_samples_per_prompt), **rollout_stats,
                   **train_stats, **sync_stats, **memory, **times, **eval_stats,
                   "data/epoch": dataset.epoch, "data/prompts_filtered": dataset.num_filtered}
            try:
                health.after_train(row, len(steps))
            finally:
                row |= health.metrics()
                row["perf/step_s"] = time.perf_counter() - step_start
                logger.log(row)
            restart_stats.pop("run/restart_cause", None)  # said once, in the first row after the restart

            if rollout_id == start:  # start-up (loading, compiling, the first rollout) is over
                parallel.set_collective_timeout(barrier_timeout_s, dist.mesh)

            # F. checkpoint: on the interval, after the last rollout, and when asked to stop
            stopping = stop_requested(stop)
            last = rollout_id == cfg.train.num_rollout - 1
            if last or stopping or (cfg.checkpoint.interval and (rollout_id + 1) % cfg.checkpoint.interval == 0):
                save_checkpoint(cfg, rollout_id, weight_version, policy, optimizer, scheduler, dataset, health,
                                hf_sources, dist, critic)
            if stopping and not last:  # a stop at the last rollout still ends the run: final eval and export
                print0(f"rl: stopping after rollout {rollout_id} ({stop.reason() or 'a stop request on another rank'})"
                       f"; run the same command to resume")
                break
        else:
            finished = end == cfg.train.num_rollout
            if finished and eval_prompts and start < cfg.train.num_rollout:  # the trained policy, in a row of its own
                logger.log({"rollout_id": cfg.train.num_rollout, "weight_version": weight_version,
                            **run_eval(engine, reward_pool, eval_prompts, cfg, sampling, weight_version, tokenizer,
                                       dist, cfg.train.num_rollout)})
        if finished and (start < cfg.train.num_rollout or not (out_dir / "final").is_dir()):
            t = time.perf_counter()
            if offloader:  # the gathers run on the device
                offloader.onload(dist.device)
            written = export_policy(policy, hf_sources, out_dir / "final", cfg.checkpoint.export_dtype, dist.is_main)
            print0(f"rl: the trained policy is in {written} (exported in {time.perf_counter() - t:.1f} s)")
        print0(health.summary())
    finally:
        logger.close()
        if reward_pool is not None:
            reward_pool.close()
        checkpoint.wait_for_removals()
        if lock is not None:
            lock.close()
    engine.close()  # vLLM's model-parallel groups go before the process group they live in
    parallel.teardown()


def run_eval(engine, pool, prompts, cfg: Config, sampling: SamplingParams, weight_version: int, tokenizer,
             dist: parallel.Dist, rollout_id: int) -> dict[str, float]:
    stats = evaluate(engine, pool, prompts, cfg.eval, cfg.rollout, sampling, weight_version, tokenizer, dist,
                     Path(cfg.log.output_dir) / "samples" / f"eval_rollout_{rollout_id}.jsonl")
    shown = {k: v for k, v in stats.items() if k != "eval/reward_errors" or v}  # named only when some failed
    print0(f"eval before rollout {rollout_id} (weight_version {weight_version}): "
           + " | ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in shown.items()))
    return stats


def dump_samples(samples: list[Sample], mismatch: dict[int, float], path: Path) -> None:
    """The seed's experience record of one rollout, a JSON line per sample; `mismatch`: Sample.index -> mean
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


def train_throughput(config, samples: list[Sample], times: dict[str, float], dist: parallel.Dist,
                     extra_forward: bool) -> dict[str, float]:
    """The policy's training speed: tokens per second of the train phase, and its model FLOPs utilisation
    (rl/flops.py: matmuls of forward + backward, plus a forward when the old logprobs took a pass of
    their own) over the time and the peak of all devices (CUDA devices of rl.flops.PEAK_BF16_FLOPS only). The
    reference's and the critic's passes are another model's work: their time is left out."""
    seconds = times["perf/train_s"] - times.get("perf/ref_logprobs_s", 0.0) - times.get("perf/critic_s", 0.0)
    lengths = [len(s.tokens) for s in samples]
    out = {"perf/train_tokens_per_s": sum(lengths) / max(seconds, 1e-9)}
    peak = peak_bf16_flops(dist.device)
    if peak and seconds > 0:
        flops = train_flops(config, lengths, passes=1 + (1 / 3 if extra_forward else 0))
        out["perf/train_mfu"] = flops / (seconds * dist.world_size * peak)
    return out


STARTUP_TIMEOUT_S = 1800.0  # the process group's own timeout while models load and kernels compile


def claim_output_dir(cfg: Config, dist: parallel.Dist, restarted: bool):
    """Rank 0 locks the run folder and decides what to resume from; every rank gets the same answer
    (or the same error). A fresh run writes config.json; a resumed one keeps the earlier config beside it.
    `restarted`: torchrun restarted this job, so rows without a checkpoint are this job's own, written
    before its first save; they move aside and the run starts over."""
    lock, candidates, error = None, [], ""
    if dist.is_main:
        try:
            lock = checkpoint.lock_output_dir(cfg.log.output_dir)
            resume = cfg.checkpoint.resume
            if restarted and checkpoint.complete_checkpoints(cfg.log.output_dir):
                resume = "auto"  # the newest checkpoint is this job's own, whatever the first attempt started from
            elif restarted:
                moved, _, moved_to = keep_rows_before(Path(cfg.log.output_dir) / "metrics.jsonl", 0)
                if moved:
                    print0(f"metrics: {moved} row(s) of the attempt before this restart, which saved no checkpoint, "
                           f"moved to {moved_to}; starting over")
            candidates = checkpoint.resume_candidates(cfg.log.output_dir, resume, cfg.model.path)
            keep_config(Path(cfg.log.output_dir), cfg, resumed=bool(candidates))
        except ConfigError as e:
            error = str(e)
        except Exception as e:  # e.g. a filesystem without flock: every rank must hear of it, not wait
            error = f"log.output_dir {cfg.log.output_dir!r}: {type(e).__name__}: {e}"
    error, candidates = parallel.all_gather_objects([(error, [str(p) for p in candidates])])[0]
    if error:
        raise ConfigError(error)
    return lock, [Path(p) for p in candidates]


def keep_config(out_dir: Path, cfg: Config, resumed: bool) -> None:
    path = out_dir / "config.json"
    text = dump(cfg)
    if resumed and path.is_file() and path.read_text() != text:
        earlier = json.loads(path.read_text())
        changed = sorted(f"{section}.{key}" for section, values in cfg.to_dict().items()
                         for key, value in values.items() if earlier.get(section, {}).get(key) != value)
        kept = out_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.json"
        os.replace(path, kept)
        print0(f"config: resuming with changed keys {', '.join(changed)}; the earlier config is kept as {kept}")
    path.write_text(text)


def apply_optimizer_config(optimizer, scheduler, train: TrainConfig, saved: dict) -> None:
    """A resume takes the optimizer's hyperparameters from this run's config, not from the checkpoint:
    lowering train.lr to resume a run that diverged must take effect. The schedule keeps its step."""
    for group in optimizer.param_groups:
        group.update(initial_lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                     weight_decay=train.weight_decay)
    scheduler.base_lrs = [train.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]):
        group["lr"] = train.lr * factor
    changed = [k for k in ("lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")
               if k in saved and saved[k] != getattr(train, k)]
    if changed:
        print0("checkpoint: " + ", ".join(f"train.{k} {saved[k]} -> {getattr(train, k)}" for k in changed)
               + " from this run's config")


def save_checkpoint(cfg: Config, rollout_id: int, weight_version: int, policy, optimizer, scheduler,
                    dataset: PromptDataset, health: Health, hf_sources: list[Path], dist: parallel.Dist,
                    critic: Critic | None) -> None:
    start = time.perf_counter()
    state = checkpoint.TrainerState(rollout_id=rollout_id, weight_version=weight_version, data=dataset.state_dict(),
                                    scheduler=scheduler.state_dict(), health=health.state_dict(),
                                    config=cfg.to_dict(), world_size=dist.world_size,
                                    critic_scheduler=critic.scheduler.state_dict() if critic else None)
    path = checkpoint.save(cfg.log.output_dir, state, policy, optimizer, hf_sources, cfg.checkpoint.keep_last,
                           (critic.model, critic.optimizer) if critic else None)
    print0(f"checkpoint: saved {path} in {time.perf_counter() - start:.1f} s")


def stop_requested(stop: launch.StopRequests) -> bool:
    """Whether any rank was asked to stop (a collective: every rank gets the same answer)."""
    return parallel.all_reduce_max(float(stop.reason() is not None)) > 0


if __name__ == "__main__":
    sys.exit(launch.cli(main, sys.argv[1:]))
