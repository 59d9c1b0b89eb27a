"""Advantages, policy losses, KL estimators and off-policy weights as pure tensor functions.

Nothing here knows about ranks or micro-batches: the train loop (rl/train.py) hands in
per-token tensors and global denominators, and picks each function by a plain config
value (`AlgoConfig`). Shapes: per-sample tensors are (N,); per-token ones are (B, T) with
`mask` 1 on the trained response tokens.

Advantage estimators (`algo.advantage_estimator`), all per sample except GAE:
- grpo: reward minus its group mean, divided by the *unbiased* group std + 1e-6 when
  `grpo_std_normalization` is on; a group of one is only centred.
- dr_grpo: reward minus its group mean (Dr. GRPO: no std, which favours easy/hard groups).
- rloo: reward minus the mean of the *other* samples of its group = G/(G-1) x centred.
- reinforce_plus_plus: the reward whitened over the global batch (REINFORCE++).
- reinforce_plus_plus_baseline: the group mean subtracted, then whitened over the batch.
  Whitening weighs each sample by its number of trained tokens, because the advantage is
  broadcast to every token and the statistics are those of the token batch.
A NaN reward marks a response that every reward function passed on (returned None for): as in TRL, it is left
out of its group's (and the batch's) statistics and its advantage is 0, so it neither moves the baseline nor
the policy. GAE counts it as reward 0 (its advantage comes from the critic, not from a group).
`gae` and `value_loss` are the per-token estimator and the critic's loss of PPO with a value model.
"""

from __future__ import annotations

import torch

from rl.config import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, AlgoConfig, TrainConfig

# ---------------------------------------------------------------------------- advantages


def advantages(estimator: str, rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool = True,
               token_counts: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """rewards (N,), NaN where unscored; group_index (N,), token_counts (N,) trained tokens per sample ->
    advantages (N,), 0 where unscored."""
    rewards = rewards.double()
    scored = ~torch.isnan(rewards)  # (N,)
    if estimator in ("grpo", "dr_grpo"):
        out = _group_centred(rewards, group_index, std_normalization and estimator == "grpo", eps, scored)
    elif estimator == "rloo":
        sizes = _group_sizes(group_index, scored)
        # r - mean of the others = (G r - sum) / (G - 1) = G / (G - 1) x (r - mean); a group of one keeps 0
        scale = torch.where(sizes > 1, sizes / (sizes - 1).clamp(min=1), torch.zeros_like(sizes))
        out = _group_centred(rewards, group_index, False, eps, scored) * scale
    elif estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        weights = torch.ones_like(rewards) if token_counts is None else token_counts.double()
        if estimator == "reinforce_plus_plus_baseline":
            rewards = _group_centred(rewards, group_index, False, eps, scored)
        out = torch.zeros_like(rewards)
        if scored.any():
            out[scored] = whiten(rewards[scored], weights[scored])
    else:
        raise ValueError(f"advantages: no per-sample estimator {estimator!r} (gae is per token: rl.algo.gae)")
    return torch.where(scored, out, torch.zeros_like(out)).float()


def _group_sizes(group_index: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """(N,): how many scored members each sample's group has."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.float64)
    return counts.index_add_(0, inverse, scored.double())[inverse]


def _group_centred(rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool, eps: float,
                   scored: torch.Tensor) -> torch.Tensor:
    """Each scored reward less its group's scored mean (over the group's scored std); 0 where unscored."""
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        members = (group_index == g) & scored
        if not members.any():
            continue
        centred = rewards[members] - rewards[members].mean()
        if std_normalization and int(members.sum()) > 1:
            centred = centred / (centred.std() + eps)  # torch.std is unbiased (n - 1), as GRPO's reference form
        out[members] = centred
    return out


def whiten(values: torch.Tensor, weights: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with each value counted `weights` times (a per-sample value
    broadcast to its tokens); the variance is the unbiased one over the weighted count."""
    total = weights.sum()
    mean = (values * weights).sum() / total
    var = ((values - mean) ** 2 * weights).sum() / (total - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's tokens, (B, T) -> (advantages, returns).

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, with V and A zero
    past the last trained token; returns = A + V are the value targets. Advantages are raw (the
    caller whitens them over the global batch, which spans ranks)."""
    values, token_rewards = values * mask, torch.nan_to_num(token_rewards, nan=0.0) * mask  # unscored: 0
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, adv + values


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss 0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2) and the
    indicator of tokens where the clipped branch is the larger one (value_clip <= 0: unclipped)."""
    unclipped = (values - returns) ** 2
    if value_clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


# ---------------------------------------------------------------------------- policy losses


def policy_loss(kind: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and clip indicator, both (B, T), for `algo.policy_loss`:

    - ppo (the clipped policy loss): max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A) with r the token
      ratio; with `eps_clip_c` (dual clip, > 1) a negative-advantage token's loss is capped at
      -eps_clip_c A, so a huge ratio cannot push it without bound.
    - gspo: the same clip on the sequence ratio s = exp(mean over the sequence's tokens of log r)
      (a geometric mean), applied to every token as sg(s) r / sg(r): the gradient of token t is
      s A grad log p_t, and the sequence's tokens share one clip decision.
    - cispo: -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) A log p: the importance weight is clipped
      but every token keeps its gradient (no token is dropped the way PPO's clip drops it).
    A token is "clipped" when its gradient is cut (ppo, gspo) or its weight capped (cispo).
    """
    log_ratio = logprobs - old_logprobs
    if kind == "cispo":
        ratio = torch.exp(log_ratio.detach())
        weight = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
        return -weight * advantages * logprobs, (weight != ratio).float()
    if kind == "gspo":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.detach() + logprobs - logprobs.detach()
    elif kind != "ppo":
        raise ValueError(f"unknown policy loss {kind!r} (one of {', '.join(POLICY_LOSSES)})")
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    cut = clipped > unclipped
    if eps_clip_c is not None:
        capped = torch.minimum(loss, -eps_clip_c * advantages)
        cut = torch.where(advantages < 0, cut | (capped < loss), cut)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, cut.float()


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float, global_seqs: float,
              norm: float) -> torch.Tensor:
    """This micro-batch's share of a global-batch loss, so that the shares of all micro-batches and ranks
    sum to the loss of the whole batch (`algo.loss_agg`):

    - token_mean: sum over every token of the batch / its number of tokens (long answers weigh more).
    - seq_mean_token_mean: each sequence's token mean, averaged over the batch's sequences.
    - seq_mean_token_sum_norm: each sequence's token sum / `norm` (a constant, Dr. GRPO's max
      response length), averaged over the sequences: no length bias in either direction.
    `global_tokens` / `global_seqs` count the batch's trained tokens / sequences with at least one.
    """
    if mode == "token_mean":
        return (values * mask).sum() / max(global_tokens, 1)
    per_seq = (values * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        per_seq = per_seq / norm
    else:
        raise ValueError(f"unknown loss aggregation {mode!r} (one of {', '.join(LOSS_AGGREGATIONS)})")
    return per_seq.sum() / max(global_seqs, 1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


# ---------------------------------------------------------------------------- KL and off-policy weights


def kl_penalty(kind: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimators of KL(pi || ref) from tokens sampled from pi, d = log pi - log ref:

    k1 = d (unbiased, any sign); k2 = d^2 / 2 (its gradient is the true KL's gradient);
    k3 = exp(-d) + d - 1 (unbiased, >= 0); low_var_kl = k3 clamped to [-10, 10] (a token whose
    reference probability collapsed cannot dominate the batch).
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(-d) + d - 1
        return k3.clamp(-10, 10) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r} (one of {', '.join(KL_ESTIMATORS)})")


def approx_kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, >= 0."""
    return kl_penalty("k3", logprobs, ref_logprobs)


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
                level: str, mode: str = "truncate") -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights for tokens the engine sampled under other weights than the trainer's old policy:
    the engine-trainer mismatch, and with partial rollouts or max_staleness the older weight versions too.
    The decoupled PPO objective: the ratio is taken against the trainer's old policy (the weights at the
    step's start), and each token's loss is weighted by w = pi_old / pi_engine (level "token"), or each
    sequence's by the product over its tokens (level "sequence"). Mode "truncate" caps w at `cap`; mode
    "mask" keeps w up to `cap` and gives 0 above it (the token or sequence leaves the loss). Returns
    (weights, indicator of w > cap), both (B, T), no gradient."""
    log_w = ((old_logprobs - rollout_logprobs) * mask).detach()
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"unknown TIS level {level!r} (token or sequence)")
    w = torch.exp(log_w)
    over = w > cap
    if mode == "truncate":
        return w.clamp(max=cap), over.float()
    if mode == "mask":
        return w.masked_fill(over, 0.0), over.float()
    raise ValueError(f"unknown TIS mode {mode!r} (truncate or mask)")


def needs_old_logprobs(train: TrainConfig, algo: AlgoConfig) -> bool:
    """Whether the policy's old logprobs need a forward pass of their own before the first update.

    The old-logprob reuse rule: with one optimizer step per rollout, the policy has not moved when the loss is
    computed, so current.detach() is the old logprob. Rollout logprobs as the old ones need no pass;
    KL folded into the reward needs the old logprobs before the advantages exist."""
    if algo.use_rollout_logprobs:
        return False
    return train.num_steps_per_rollout > 1 or (algo.kl_coef > 0 and algo.kl_in_reward)


def can_reuse_old_logprobs(train: TrainConfig, algo: AlgoConfig) -> bool:
    return not algo.use_rollout_logprobs and not needs_old_logprobs(train, algo)
