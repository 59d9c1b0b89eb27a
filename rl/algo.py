"""Advantages and policy losses as pure tensor functions (no distributed code).

GRPO follows the seed (step 30): rewards are centred on their group mean and, when
`grpo_std_normalization` is on, divided by the *unbiased* group std plus 1e-6; a
group of one is only centred. The PPO-clip loss (step 40) takes per-token
log-probabilities and returns per-token losses so the caller chooses the
aggregation (token mean over the global batch here).
"""

from __future__ import annotations

import torch

from rl.config import AlgoConfig, TrainConfig


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards (N,), group_index (N,) -> advantages (N,), normalised within each group."""
    rewards = rewards.float()
    advantages = torch.empty_like(rewards)
    for g in torch.unique(group_index):
        members = group_index == g
        centred = rewards[members] - rewards[members].mean()
        if std_normalization and int(members.sum()) > 1:
            centred = centred / (centred.std() + eps)  # torch.std is unbiased (n - 1), as in the seed
        advantages[members] = centred
    return advantages


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  eps_clip: float, eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss and clip indicator, all (B, T).

    loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A); a token is
    "clipped" when the clipped branch is the larger one, i.e. its gradient is cut.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def approx_kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, >= 0."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def can_reuse_old_logprobs(train: TrainConfig, algo: AlgoConfig) -> bool:
    """Seed step 38: with one optimizer step per rollout and no KL or rollout logprobs, the
    policy has not moved when the loss is computed, so current.detach() is the old logprob
    and a separate forward pass over the batch can be skipped."""
    return (train.num_steps_per_rollout == 1
            and not algo.use_rollout_logprobs
            and algo.advantage_estimator != "gspo")
