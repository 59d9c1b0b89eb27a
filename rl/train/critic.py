"""The value model of PPO with GAE (algo.advantage_estimator = "gae"), trained beside the policy.

It is the policy's body with a zero-initialised one-output head (`build_policy(value_head=True)`),
sharded with FSDP2 like the policy, with its own AdamW (`critic.lr`), and parked in host memory
with the policy while the engine runs (`train.offload`). Per rollout: one forward gives the old
values of every sample of this rank; GAE turns them and the rewards into per-token advantages
(whitened over the global batch, across ranks) and returns; then the critic takes the same
optimizer steps as the policy on the clipped value loss, a token mean over each global batch.
Values are aligned with the policy's logprobs: row t is V(prefix up to t), the state in which
token t + 1 was chosen.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rl import parallel
from rl.config import AlgoConfig, CriticConfig, ModelConfig, TrainConfig
from rl.train.algo import aggregate, gae, masked_sum, value_loss
from rl.train.packing import packed_forward, unpack
from rl.train.policy import HostOffloader, build_optimizer, build_policy
from rl.train.step import MicroBatch, Schedule, causal_forward, optimizer_steps, rows_of


def values_of(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(B, T-1) float32: the value of each prefix that chose a target token."""
    if mb.documents is None:
        return causal_forward(model, mb.input_ids).logits[:, :-1, 0].float()
    return unpack(packed_forward(model, mb.input_ids, mb.documents).logits[:, :-1, 0].float(), mb.documents)


def outcome_rewards(mb: MicroBatch, rewards: dict[int, float], kl: torch.Tensor | None, kl_coef: float
                    ) -> torch.Tensor:
    """(B, T-1) token rewards: each response's reward on its last trained token, minus kl_coef x the per-token
    KL (B, T-1) when it is folded into the reward."""
    mask = mb.loss_mask
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)  # the last trained position
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0], device=mask.device), last] = torch.tensor(
        [rewards[i] for i in mb.indices], dtype=out.dtype, device=out.device)
    out = out * (mask.sum(-1, keepdim=True) > 0)  # a row with no trained token (padding) gets nothing
    if kl is not None:
        out = out - kl_coef * kl * mask
    return out


class Critic:
    def __init__(self, model_cfg: ModelConfig, cfg: CriticConfig, train: TrainConfig, mesh, device: torch.device,
                 max_context_len: int):
        path = cfg.path or model_cfg.path
        build = ModelConfig(path=path, random_init=model_cfg.random_init and not cfg.path,
                            attn_implementation=model_cfg.attn_implementation,
                            gradient_checkpointing=model_cfg.gradient_checkpointing)
        self.model = build_policy(build, mesh, device, train.seed, max_context_len, value_head=True)
        self.optimizer, self.scheduler = build_optimizer(self.model, critic_train_config(train, cfg))
        self.cfg, self.device = cfg, device
        self.parking = HostOffloader(self.model, self.optimizer) if train.offload else None

    def onload(self) -> None:
        if self.parking:
            self.parking.onload(self.device)

    def offload(self) -> None:
        if self.parking:
            self.parking.offload()

    def values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Each micro-batch's (B, T-1) values before the update."""
        return rows_of(self.model, micro_batches, values_of)

    def update(self, schedule: Schedule, *, dp_size: int, passes: int) -> dict[str, float]:
        """The critic's optimizer steps on the clipped value loss, as many as the policy's (the schedule's, `passes`
        times), from each micro-batch's old `values` towards its `returns`; returns this rank's sums and grad norms."""
        self.model.train()
        sums = {k: torch.zeros((), device=self.device) for k in ("vf_loss_sum", "vf_clipped", "value_sum",
                                                                  "value_sq_sum", "return_sum", "return_sq_sum",
                                                                  "residual_sq_sum", "tokens")}

        def loss(step_index: int, mb: MicroBatch, global_tokens: int) -> torch.Tensor:
            v = values_of(self.model, mb)
            old, ret = mb.values, mb.returns
            token_loss, clipped = value_loss(v, old, ret, self.cfg.value_clip)
            mb_loss = aggregate(token_loss, mb.loss_mask, "token_mean", global_tokens, 0, 1.0)
            sums["vf_loss_sum"] += mb_loss.detach()
            sums["vf_clipped"] += masked_sum(clipped, mb.loss_mask)
            sums["value_sum"] += masked_sum(old, mb.loss_mask)
            sums["value_sq_sum"] += masked_sum(old * old, mb.loss_mask)
            sums["return_sum"] += masked_sum(ret, mb.loss_mask)
            sums["return_sq_sum"] += masked_sum(ret * ret, mb.loss_mask)
            sums["residual_sq_sum"] += masked_sum((ret - old) ** 2, mb.loss_mask)
            sums["tokens"] += mb.loss_mask.sum()
            return mb_loss

        grad_norms, skipped = optimizer_steps(self.model, self.optimizer, self.scheduler, schedule.steps * passes,
                                              schedule.step_tokens * passes, dp_size, self.cfg.clip_grad, loss)
        out = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["skipped_steps"] = sum(skipped)
        return out


def critic_train_config(train: TrainConfig, cfg: CriticConfig) -> TrainConfig:
    return dataclasses.replace(train, lr=cfg.lr, lr_warmup_steps=cfg.lr_warmup_steps, weight_decay=cfg.weight_decay)


def gae_advantages(micro_batches: list[MicroBatch], rewards: dict[int, float], kl: list[torch.Tensor] | None,
                   algo: AlgoConfig) -> None:
    """Writes each micro-batch's `advantages`, the per-token GAE advantages of its `values`, whitened over the
    global batch (the mean and variance of every trained token on every rank), and its `returns`, what the
    critic trains towards. `kl`: each micro-batch's per-token KL, with algo.kl_in_reward."""
    raw = []
    for k, mb in enumerate(micro_batches):
        adv, mb.returns = gae(outcome_rewards(mb, rewards, kl[k] if kl else None, algo.kl_coef), mb.values,
                              mb.loss_mask, algo.gamma, algo.lam)
        raw.append(adv)
    real = [(mb, adv) for mb, adv in zip(micro_batches, raw) if mb.loss_mask.any()]
    stats = torch.stack([sum((masked_sum(a, mb.loss_mask) for mb, a in real), torch.zeros(())),
                         sum((masked_sum(a * a, mb.loss_mask) for mb, a in real), torch.zeros(())),
                         sum((mb.loss_mask.sum() for mb, _ in real), torch.zeros(()))]).double().tolist()
    total = [sum(x) for x in zip(*parallel.all_gather_objects([stats]))]
    n = max(total[2], 1.0)
    mean = total[0] / n
    var = max(total[1] / n - mean * mean, 0.0) * n / max(n - 1, 1.0)  # unbiased, over the batch's tokens
    for mb, adv in zip(micro_batches, raw):
        mb.advantages = (adv - mean) / math.sqrt(var + 1e-8) * mb.loss_mask


def critic_metrics(per_rank: list[dict[str, float]], num_steps: int) -> dict[str, float]:
    tokens = max(sum(m["tokens"] for m in per_rank), 1)

    def mean(key):
        return sum(m[key] for m in per_rank) / tokens

    return_var = mean("return_sq_sum") - mean("return_sum") ** 2
    return {"critic/vf_loss": sum(m["vf_loss_sum"] for m in per_rank) / num_steps,
            "critic/vf_clip_frac": mean("vf_clipped"),
            "critic/values_mean": mean("value_sum"),
            "critic/returns_mean": mean("return_sum"),
            # 1 - E[(R - V)^2] / Var(R): how much of the return the old values explain
            "critic/explained_var": 1 - mean("residual_sq_sum") / return_var if return_var > 0 else 0.0,
            "critic/grad_norm": per_rank[0]["grad_norm"],
            "critic/skipped_steps": per_rank[0]["skipped_steps"]}
