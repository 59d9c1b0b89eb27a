"""The learner: the policy, its optimizer and learning-rate schedule, host offloading, and the optional KL
reference and PPO critic, behind one `train(samples)`, one `push(engine)` and one pair of
`state_dict()` / `load_state_dict()`.

`train` builds the rollout's schedule once (global batches, length-balanced DP shares, micro-batches), and
every model's pass runs over those micro-batches: the reference's logprobs (KL), the old logprobs when they
need a pass of their own, the critic's values and its update, and the policy's optimizer steps. The passes
before the update write their rows into the micro-batches (`Learner.fill_micro_batches`), which the losses
read. Every estimator's advantages come from `assign_advantages`: the group estimators before the schedule
(the zero-advantage skip needs them), the KL folded into the reward (`algo.kl_in_reward`) and GAE once the
reference's and the critic's passes have run.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from pathlib import Path

import torch

from rl import parallel
from rl.config import AlgoConfig, Config, TrainConfig
from rl.data import Sample
from rl.model.flops import peak_bf16_flops, train_flops
from rl.parallel import print0
from rl.rollout import engine_dtype
from rl.train.algo import advantages, needs_old_logprobs
from rl.train.critic import Critic, critic_metrics, gae_advantages
from rl.train.measure import StepRecord, graphs_compiled, profiled
from rl.train.packing import use_packed_attention
from rl.train.policy import HostOffloader, build_optimizer, build_policy
from rl.train.reference import BaseOfPolicy, Reference
from rl.train.step import (
    MicroBatch,
    Schedule,
    build_schedule,
    fill_old_logprobs,
    kl_rows,
    mask_truncated,
    response_kl_sums,
    skippable_samples,
    train_metrics,
    train_on_rollout,
)
from rl.train.weights import sync_weights


@dataclasses.dataclass
class TrainResult:
    stats: dict[str, float]  # the row's train/*, critic/* and perf/train_* metrics
    num_steps: int  # optimizer steps of the rollout
    mismatch: dict[int, float]  # Sample.index -> mean |trainer - rollout logprob| before the update


class Learner:
    def __init__(self, cfg: Config, dist: parallel.Dist):
        self.cfg, self.dist = cfg, dist
        t = time.perf_counter()
        self.policy = build_policy(cfg.model, dist.mesh, dist.device, cfg.train.seed, cfg.rollout.max_context_len,
                                   lora=cfg.lora, expert_parallel=cfg.train.expert_parallel)
        print0(f"policy: built, sharded and loaded in {time.perf_counter() - t:.1f} s; host memory peak of rank 0 "
               f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
        self.optimizer, self.scheduler = build_optimizer(self.policy, cfg.train)
        self.reference = None
        if cfg.algo.kl_coef > 0 and cfg.lora.rank and not cfg.model.ref_path:
            self.reference = BaseOfPolicy(self.policy)
            print0("reference: the policy's frozen base (its LoRA adapters switched off), not built again")
        elif cfg.algo.kl_coef > 0:
            t = time.perf_counter()
            self.reference = Reference(cfg.model, dist.mesh, dist.device, cfg.train.seed, cfg.rollout.max_context_len)
            print0(f"reference: {cfg.model.ref_path or 'the initial policy'}, built in {time.perf_counter() - t:.1f} "
                   f"s and parked in host memory")
        self.critic = None
        if cfg.algo.advantage_estimator == "gae":
            self.critic = Critic(cfg.model, cfg.critic, cfg.train, dist.mesh, dist.device, cfg.rollout.max_context_len)
            print0(f"critic: {cfg.critic.path or cfg.model.path} with a value head, lr {cfg.critic.lr}")
        if cfg.train.packing:
            for model in (self.policy, self.reference and self.reference.model, self.critic and self.critic.model):
                if model is not None:
                    use_packed_attention(model)
        self.offloader = HostOffloader(self.policy, self.optimizer) if cfg.train.offload else None
        self.engine_dtype = engine_dtype(cfg.rollout.dtype, dist.device)
        # LoRA: the base never changes, so once the engine holds it a push sends the adapted layers alone, unless the
        # engine drops its weights while asleep (sleep level 2).
        self.push_changed_only = bool(cfg.lora.rank) and cfg.rollout.sleep_level < 2
        if cfg.rollout.buffered and not cfg.algo.tis_cap:
            print0(f"train: rollout.max_staleness={cfg.rollout.max_staleness} with algo.tis_cap=0: tokens sampled by "
                   f"older weights train without an importance weight against them; algo.tis_cap (e.g. 2) adds it")

    # ------------------------------------------------------------------------ state

    @property
    def critic_state(self) -> tuple | None:
        """The critic's model and optimizer, for the checkpoint's tensors (None without a critic)."""
        return (self.critic.model, self.critic.optimizer) if self.critic else None

    def state_dict(self) -> dict:
        """What the checkpoint keeps besides tensors: the learning-rate schedules."""
        return {"scheduler": self.scheduler.state_dict(),
                "critic_scheduler": self.critic.scheduler.state_dict() if self.critic else None}

    def load_state_dict(self, state: dict, saved_config: dict) -> None:
        """The schedules as saved; the optimizer's hyperparameters from this run's config (`apply_optimizer_config`)."""
        if self.critic:
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_optimizer_config(self.optimizer, self.scheduler, self.cfg.train, saved_config.get("train", {}))

    # ------------------------------------------------------------------------ phases

    def offload(self) -> None:
        """Parks the training state in host memory (train.offload) while the engine runs."""
        if self.offloader:
            self.offloader.offload()
        if self.critic:
            self.critic.offload()

    def train(self, samples: list[Sample], record: StepRecord, profile: Path | None) -> TrainResult:
        """One rollout's optimizer steps; `profile`: write the train phase's torch.profiler table there."""
        cfg, dist = self.cfg, self.dist
        assign_advantages(samples, cfg.algo)  # the group estimators: before the truncation mask and the skip
        with record.timed("perf/onload_train_s"):
            if self.offloader:
                self.offloader.onload(dist.device)
        with record.timed("perf/train_s"), profiled(profile), graphs_compiled(record.times,
                                                                               "perf/train_graphs_compiled"):
            masked = mask_truncated(samples) if cfg.algo.mask_truncated else 0
            skip = skippable_samples(samples, cfg.algo)
            schedule = build_schedule(samples, cfg.train, dist.rank, dist.world_size, dist.device,
                                      cfg.rollout.max_context_len, skip)
            extra = self.fill_micro_batches(samples, schedule, record)
            local = train_on_rollout(self.policy, self.optimizer, self.scheduler, schedule, dp_size=dist.world_size,
                                     train=cfg.train, algo=cfg.algo, temperature=cfg.rollout.temperature)
            num_steps = len(schedule.steps) * cfg.train.num_iterations
            if self.critic:
                with record.timed("perf/critic_s"):
                    extra |= critic_metrics(parallel.all_gather_objects([self.critic.update(
                        schedule, dp_size=dist.world_size, passes=cfg.train.num_iterations)]), num_steps)
                    self.critic.offload()
            per_rank = parallel.all_gather_objects([local])
            stats = train_metrics(per_rank, num_steps, cfg.algo) | extra
        stats["train/optimizer_steps"] = num_steps
        stats["train/padding_micro_batches"] = schedule.padding
        stats["train/skipped_zero_adv_samples"] = len(skip) - masked  # the masked ones run no pass either
        stats |= train_throughput(self.policy.config, [s for s in samples if s.index not in skip], record.times, dist,
                                  extra_forward=schedule.micro_batches[0].old_logprobs is not None,
                                  iterations=cfg.train.num_iterations)
        record.memory_after("train")
        mismatch = {i: m for part in per_rank for i, m in part["sample_mismatch"].items()}
        if cfg.algo.mask_truncated:
            stats["train/masked_truncated_samples"] = masked
        return TrainResult(stats, num_steps, mismatch)

    def fill_micro_batches(self, samples: list[Sample], schedule: Schedule, record: StepRecord) -> dict[str, float]:
        """Writes what the losses read besides the rollout into each micro-batch, before the first update: the
        reference's logprobs (algo.kl_coef > 0), the policy's old logprobs where they need a pass of their own
        (`needs_old_logprobs`; the KL of algo.kl_in_reward), the critic's values (GAE), then the advantages that
        wait for those passes (`assign_advantages`). Returns the latter's metrics."""
        cfg, micro_batches, temperature = self.cfg, schedule.micro_batches, self.cfg.rollout.temperature
        if self.reference is not None:
            with record.timed("perf/ref_logprobs_s"):
                ref_rows = self.reference.logprobs(micro_batches, temperature, cfg.train.routing_replay)
                for mb, rows in zip(micro_batches, ref_rows, strict=True):
                    mb.ref_logprobs = rows
        if needs_old_logprobs(cfg.train, cfg.algo) or cfg.algo.kl_in_reward:
            fill_old_logprobs(self.policy, micro_batches, temperature, cfg.train.routing_replay)
        if self.critic:
            with record.timed("perf/critic_s"):
                self.critic.onload()
                for mb, rows in zip(micro_batches, self.critic.values(micro_batches), strict=True):
                    mb.values = rows
        return assign_advantages(samples, cfg.algo, micro_batches)

    def push(self, engine, record: StepRecord) -> dict[str, float]:
        """The trained weights into the engine (the same weights when every step was skipped: a sleeping engine
        may have dropped its copy), the training state back to host memory, and the engine's KV cache back."""
        with record.timed("perf/onload_weights_s"):
            engine.wake_up(["weights"])
        stats = sync_weights(self.policy, engine, self.engine_dtype, self.cfg.weights.bucket_mb, self.push_changed_only)
        with record.timed("perf/offload_train_s"):
            if self.offloader:
                self.offloader.offload()
        engine.reset_prefix_cache()
        with record.timed("perf/onload_kv_s"):
            engine.wake_up(["kv_cache"])
        record.memory_after("weight_sync")
        return stats

    def onload(self) -> None:
        """The policy back on the device, for the gathers of an export."""
        if self.offloader:
            self.offloader.onload(self.dist.device)


def assign_advantages(samples: list[Sample], algo: AlgoConfig, micro_batches: list[MicroBatch] | None = None
                      ) -> dict[str, float]:
    """Every estimator's advantages, each as soon as its inputs exist: `Learner.train` calls this before the
    schedule and again once the passes before the update have filled the micro-batches.

    Before (no `micro_batches`): the group estimators of algo.advantage_estimator from each group's rewards, into
    Sample.advantage, where algo.mask_truncated's order and the zero-advantage skip want them. After: the KL folded
    into the reward (algo.kl_in_reward: each response's summed KL to the reference, gathered over ranks, times
    kl_coef off its reward, then the group estimator, written into the micro-batches) and GAE (per token, from the
    critic's values: `gae_advantages`). Returns the metrics of the latter."""
    waits = algo.advantage_estimator == "gae" or algo.kl_in_reward  # for the reference's or the critic's pass
    if micro_batches is None and not waits:
        group_advantages(samples, algo, {})
    if micro_batches is None or not waits:  # nothing (more) for this call
        return {}
    kl, kl_sums, extra = None, {}, {}
    if algo.kl_in_reward:
        kl = [kl_rows(algo.kl_estimator, mb) for mb in micro_batches]
        kl_sums = {i: s for part in parallel.all_gather_objects([response_kl_sums(kl, micro_batches)])
                   for i, s in part.items()}
        extra["train/kl_reward_penalty"] = algo.kl_coef * sum(kl_sums.values()) / len(samples)
    if algo.advantage_estimator == "gae":
        gae_advantages(micro_batches, {s.index: s.reward for s in samples}, kl, algo)
    else:
        group_advantages(samples, algo, kl_sums)
        write_advantages(micro_batches, samples)
    return extra


def group_advantages(samples: list[Sample], algo: AlgoConfig, kl_sums: dict[int, float]) -> None:
    """Writes Sample.advantage; `kl_sums`: each response's summed KL to the reference, subtracted from its reward
    (times kl_coef) first."""
    rewards = torch.tensor([s.reward - algo.kl_coef * kl_sums.get(s.index, 0.0) for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in samples])
    tokens = torch.tensor([float(sum(s.loss_mask)) for s in samples])
    for sample, adv in zip(samples, advantages(algo.advantage_estimator, rewards, groups, algo.grpo_std_normalization,
                                               tokens).tolist()):
        sample.advantage = adv


def write_advantages(micro_batches: list[MicroBatch], samples: list[Sample]) -> None:
    """Replaces the micro-batches' advantages with the samples' (over each row's trained tokens; a padding
    micro-batch, which trains none, gets zeros)."""
    by_index = {s.index: s.advantage for s in samples}
    for mb in micro_batches:
        per_row = torch.tensor([by_index[i] for i in mb.indices], dtype=mb.advantages.dtype, device=mb.loss_mask.device)
        mb.advantages = per_row[:, None] * mb.loss_mask


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


def train_throughput(config, samples: list[Sample], times: dict[str, float], dist: parallel.Dist,
                     extra_forward: bool, iterations: int = 1) -> dict[str, float]:
    """The policy's training speed: tokens per second of the train phase (each of train.num_iterations passes
    counts its tokens), and its model FLOPs utilisation (rl/model/flops.py: matmuls of forward + backward a pass, plus a
    forward when the old logprobs took a pass of their own) over the time and the peak of all devices (CUDA
    devices of rl.model.flops.PEAK_BF16_FLOPS only). The reference's and the critic's passes are another model's work:
    their time is left out."""
    seconds = times["perf/train_s"] - times.get("perf/ref_logprobs_s", 0.0) - times.get("perf/critic_s", 0.0)
    lengths = [len(s.tokens) for s in samples]
    out = {"perf/train_tokens_per_s": iterations * sum(lengths) / max(seconds, 1e-9)}
    peak = peak_bf16_flops(dist.device)
    if peak and seconds > 0:
        flops = train_flops(config, lengths, passes=iterations + (1 / 3 if extra_forward else 0))
        out["perf/train_mfu"] = flops / (seconds * dist.world_size * peak)
    return out
