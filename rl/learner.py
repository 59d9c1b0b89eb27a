"""The learner: the policy, its optimizer and learning-rate schedule, host offloading, and the optional KL
reference and PPO critic, behind one `train(samples)`, one `push(engine)` and one pair of
`state_dict()` / `load_state_dict()`.

`train` builds the rollout's schedule once (global batches, length-balanced DP shares, micro-batches), and
every model's pass runs over those micro-batches: the reference's logprobs (KL), the old logprobs when they
need a pass of their own, the critic's values and its update, and the policy's optimizer steps. Advantages
are computed per group before training (`assign_advantages`), except where they need the train phase's own
passes: the KL folded into the reward (`algo.kl_in_reward`) and GAE, whose per-token advantages come from
the critic's values; those are written into the micro-batches here.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from pathlib import Path

import torch

from rl import parallel
from rl.algo import advantages, needs_old_logprobs
from rl.config import AlgoConfig, Config, TrainConfig
from rl.critic import Critic, critic_metrics, write_gae_advantages
from rl.data import Sample
from rl.flops import peak_bf16_flops, train_flops
from rl.metrics import StepRecord, graphs_compiled, profiled
from rl.packing import use_packed_attention
from rl.parallel import print0
from rl.policy import HostOffloader, build_optimizer, build_policy
from rl.reference import BaseOfPolicy, Reference
from rl.rollout import engine_dtype
from rl.train import (MicroBatch, build_schedule, kl_rows, logprobs_by_sample, mask_truncated, response_kl_sums,
                      skippable_samples, train_metrics, train_on_rollout)
from rl.weights import sync_weights


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
                                   lora=cfg.lora)
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
        if (cfg.rollout.partial_rollout or cfg.rollout.max_staleness) and not cfg.algo.tis_cap:
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
        with record.timed("perf/onload_train_s"):
            if self.offloader:
                self.offloader.onload(dist.device)
        with record.timed("perf/train_s"), profiled(profile), graphs_compiled(record.times,
                                                                               "perf/train_graphs_compiled"):
            masked = mask_truncated(samples) if cfg.algo.mask_truncated else 0
            skip = skippable_samples(samples, cfg.algo)
            steps, step_tokens, step_seqs, padding = build_schedule(samples, cfg.train, dist.rank, dist.world_size,
                                                                    dist.device, cfg.rollout.max_context_len, skip)
            micro_batches = [mb for step in steps for mb in step]
            old, ref, kl, extra = self.reference_pass(samples, micro_batches, record)
            if self.critic:  # GAE: the critic's values of this rank's samples give per-token advantages
                with record.timed("perf/critic_s"):
                    self.critic.onload()
                    values = self.critic.values(micro_batches)
                returns = write_gae_advantages(micro_batches, values, {s.index: s.reward for s in samples}, kl,
                                               cfg.algo)
            local = train_on_rollout(self.policy, self.optimizer, self.scheduler, steps, step_tokens, dist.world_size,
                                     cfg.train, cfg.algo, cfg.rollout.temperature, step_seqs, old, ref)
            if self.critic:
                with record.timed("perf/critic_s"):
                    passes = cfg.train.num_iterations
                    extra |= critic_metrics(parallel.all_gather_objects(
                        [self.critic.update(steps * passes, step_tokens * passes, values, returns, dist.world_size)]),
                        len(steps) * passes)
                    self.critic.offload()
            per_rank = parallel.all_gather_objects([local])
            num_steps = len(steps) * cfg.train.num_iterations
            stats = train_metrics(per_rank, num_steps, cfg.algo) | extra
        stats["train/optimizer_steps"] = num_steps
        stats["train/padding_micro_batches"] = padding
        stats["train/skipped_zero_adv_samples"] = len(skip)
        stats |= train_throughput(self.policy.config, [s for s in samples if s.index not in skip], record.times, dist,
                                  extra_forward=bool(old) or needs_old_logprobs(cfg.train, cfg.algo))
        record.memory_after("train")
        mismatch = {i: m for part in per_rank for i, m in part["sample_mismatch"].items()}
        if cfg.algo.mask_truncated:
            stats["train/masked_truncated_samples"] = masked
        return TrainResult(stats, num_steps, mismatch)

    def reference_pass(self, samples: list[Sample], micro_batches: list[MicroBatch], record: StepRecord):
        """The reference's logprobs (algo.kl_coef > 0) and, with algo.kl_in_reward, the policy's old logprobs, the
        per-token KL and the advantages of the rewards less the KL. Returns (old, ref, kl, extra metrics)."""
        cfg = self.cfg
        old, ref, kl, extra = {}, None, None, {}
        if self.reference is not None:
            with record.timed("perf/ref_logprobs_s"):
                ref = self.reference.logprobs(micro_batches, cfg.rollout.temperature)
        if cfg.algo.kl_in_reward:  # the advantages wait for the KL of each response
            old = logprobs_by_sample(self.policy, micro_batches, cfg.rollout.temperature)
            kl = kl_rows(cfg.algo.kl_estimator, old, ref)
            kl_sums = {i: s for part in parallel.all_gather_objects([response_kl_sums(kl, micro_batches)])
                       for i, s in part.items()}
            extra["train/kl_reward_penalty"] = cfg.algo.kl_coef * sum(kl_sums.values()) / len(samples)
            if not self.critic:
                group_advantages(samples, cfg.algo, kl_sums)
                write_advantages(micro_batches, samples)
        return old, ref, kl, extra

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


def assign_advantages(samples: list[Sample], algo: AlgoConfig) -> None:
    """Each sample's advantage by algo.advantage_estimator, from its group's rewards. GAE (per token, from the
    critic's values) and the KL folded into the reward (it needs the reference's pass) are left to the train
    phase."""
    if algo.advantage_estimator != "gae" and not algo.kl_in_reward:
        group_advantages(samples, algo, {})


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
