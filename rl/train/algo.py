"""Advantages, policy losses, KL estimators and off-policy weights as pure tensor functions.

Nothing here knows about ranks or micro-batches: the train loop (rl/train/step.py) hands in
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

Each variant kind is one table, name -> (its pure function, one line on it): ADVANTAGE_ESTIMATORS, POLICY_LOSSES,
LOSS_AGGREGATIONS, KL_ESTIMATORS, TIS_LEVELS and TIS_MODES. The config's validation, `--help` and the docs read
the names and lines from them (rl/config.py), so a new variant is its function and one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from rl.config import AlgoConfig, TrainConfig


class Variant(NamedTuple):
    """A row of a variant table: the function that computes it, and one line for --help and docs/."""
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    doc: str


class Estimator(NamedTuple):
    """A row of ADVANTAGE_ESTIMATORS: `fn` maps (rewards, group_index, scored, std_normalization, weights, eps)
    to per-sample advantages; None for gae, which is per token from the critic (`gae`)."""
    fn: Callable[..., torch.Tensor] | None
    doc: str
    group_baseline: bool  # a baseline from the sample's group: needs >= 2 samples per prompt

# ---------------------------------------------------------------------------- advantages


def advantages(estimator: str, rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool = True,
               token_counts: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """rewards (N,), NaN where unscored; group_index (N,), token_counts (N,) trained tokens per sample ->
    advantages (N,), 0 where unscored."""
    row = ADVANTAGE_ESTIMATORS.get(estimator)
    if row is None or row.fn is None:
        raise ValueError(f"advantages: no per-sample estimator {estimator!r} (gae is per token: rl.train.algo.gae)")
    rewards = rewards.double()
    scored = ~torch.isnan(rewards)  # (N,)
    weights = torch.ones_like(rewards) if token_counts is None else token_counts.double()
    out = row.fn(rewards, group_index, scored, std_normalization, weights, eps)
    return torch.where(scored, out, torch.zeros_like(out)).float()


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor, std_normalization: bool,
                    weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,): reward less its group mean, over the group's unbiased std + eps when `std_normalization`."""
    return _group_centred(rewards, group_index, std_normalization, eps, scored)


def grpo_batch_std_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor,
                              std_normalization: bool, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,): reward less its group mean, over the unbiased std of every scored reward of the rollout + eps (TRL's
    scale_rewards = "batch": one scale for the batch, so a group of near-equal rewards is not blown up)."""
    centred = _group_centred(rewards, group_index, False, eps, scored)
    std = rewards[scored].std() if int(scored.sum()) > 1 else torch.zeros((), dtype=rewards.dtype)
    return centred / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor,
                       std_normalization: bool, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,): reward less its group mean, never over the std (Dr. GRPO)."""
    return _group_centred(rewards, group_index, False, eps, scored)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor, std_normalization: bool,
                    weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,): reward less the mean of the other samples of its group."""
    sizes = _group_sizes(group_index, scored)
    # r - mean of the others = (G r - sum) / (G - 1) = G / (G - 1) x (r - mean); a group of one keeps 0
    scale = torch.where(sizes > 1, sizes / (sizes - 1).clamp(min=1), torch.zeros_like(sizes))
    return _group_centred(rewards, group_index, False, eps, scored) * scale


def reinforce_plus_plus_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor,
                                   std_normalization: bool, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(N,): the scored rewards whitened over the batch, each counted `weights` times (REINFORCE++)."""
    out = torch.zeros_like(rewards)
    if scored.any():
        out[scored] = whiten(rewards[scored], weights[scored])
    return out


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scored: torch.Tensor,
                                            std_normalization: bool, weights: torch.Tensor, eps: float
                                            ) -> torch.Tensor:
    """(N,): the group mean subtracted, then whitened over the batch."""
    centred = _group_centred(rewards, group_index, False, eps, scored)
    return reinforce_plus_plus_advantages(centred, group_index, scored, std_normalization, weights, eps)


ADVANTAGE_ESTIMATORS = {
    "grpo": Estimator(grpo_advantages, "reward minus its group mean, over the unbiased group std + 1e-6 "
                                       "(algo.grpo_std_normalization = false: centred only)", True),
    "grpo_batch_std": Estimator(grpo_batch_std_advantages, "reward minus its group mean, over the unbiased std of "
                                                           "the rollout's rewards + 1e-6 (TRL's scale_rewards = "
                                                           "'batch')", True),
    "dr_grpo": Estimator(dr_grpo_advantages, "reward minus its group mean, no std (Dr. GRPO)", True),
    "rloo": Estimator(rloo_advantages, "reward minus the mean of the other samples of its group", True),
    "reinforce_plus_plus": Estimator(reinforce_plus_plus_advantages,
                                     "reward whitened over the global batch, every trained token counted "
                                     "(REINFORCE++)", False),
    "reinforce_plus_plus_baseline": Estimator(reinforce_plus_plus_baseline_advantages,
                                              "group mean subtracted, then whitened over the batch", True),
    "gae": Estimator(None, "PPO with a critic ([critic]): per-token GAE (algo.gamma, algo.lam) from a value model, "
                           "whitened over the batch", False),
}


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
    """Per-token loss and clip indicator, both (B, T), by `algo.policy_loss` (POLICY_LOSSES). A token is
    "clipped" when its gradient is cut (ppo, gspo) or its weight capped (cispo)."""
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r} (one of {', '.join(POLICY_LOSSES)})")
    return POLICY_LOSSES[kind].fn(logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high, eps_clip_c)


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             eps_clip: float, eps_clip_high: float, eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped policy loss, (B, T): max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A) with r the token
    ratio; with `eps_clip_c` (dual clip, > 1) a negative-advantage token's loss is capped at -eps_clip_c A, so
    a huge ratio cannot push it without bound."""
    return _clipped(logprobs - old_logprobs, advantages, eps_clip, eps_clip_high, eps_clip_c)


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_clip: float, eps_clip_high: float, eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clip on the sequence ratio s = exp(mean over the sequence's tokens of log r) (a geometric mean),
    applied to every token as sg(s) r / sg(r): the gradient of token t is s A grad log p_t, and the sequence's
    tokens share one clip decision."""
    log_ratio = logprobs - old_logprobs
    seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return _clipped(seq.detach() + logprobs - logprobs.detach(), advantages, eps_clip, eps_clip_high, eps_clip_c)


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               eps_clip: float, eps_clip_high: float, eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) A log p: the importance weight is clipped but every token
    keeps its gradient (no token is dropped the way PPO's clip drops it)."""
    ratio = torch.exp((logprobs - old_logprobs).detach())
    weight = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return -weight * advantages * logprobs, (weight != ratio).float()


def _clipped(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
             eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped loss and cut indicator of a per-token log ratio, (B, T) each."""
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


POLICY_LOSSES = {
    "ppo": Variant(ppo_loss, "token-level clip max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A); "
                             "algo.eps_clip_c (> 1) adds the dual clip"),
    "gspo": Variant(gspo_loss, "the clip on the sequence ratio exp(mean log r), one decision per sequence; "
                               "use tiny clips (3e-4 / 4e-4)"),
    "cispo": Variant(cispo_loss, "-sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) A log p: the weight is capped, "
                                 "no token loses its gradient"),
}


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float, global_seqs: float,
              norm: float) -> torch.Tensor:
    """This micro-batch's share of a global-batch loss by `algo.loss_agg` (LOSS_AGGREGATIONS), so that the
    shares of all micro-batches and ranks sum to the loss of the whole batch. `global_tokens` / `global_seqs`
    count the batch's trained tokens / sequences with at least one."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r} (one of {', '.join(LOSS_AGGREGATIONS)})")
    return LOSS_AGGREGATIONS[mode].fn(values, mask, global_tokens, global_seqs, norm)


def token_mean(values: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_seqs: float, norm: float
               ) -> torch.Tensor:
    """Sum over every token of the batch / its number of tokens (long answers weigh more)."""
    return (values * mask).sum() / max(global_tokens, 1)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_seqs: float,
                        norm: float) -> torch.Tensor:
    """Each sequence's token mean, averaged over the batch's sequences."""
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return per_seq.sum() / max(global_seqs, 1)


def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_seqs: float,
                            norm: float) -> torch.Tensor:
    """Each sequence's token sum / `norm` (a constant, Dr. GRPO's max response length), averaged over the
    sequences: no length bias in either direction."""
    per_seq = (values * mask).sum(-1) / norm  # (B,)
    return per_seq.sum() / max(global_seqs, 1)


LOSS_AGGREGATIONS = {
    "token_mean": Variant(token_mean, "sum over all trained tokens of the global batch / their number"),
    "seq_mean_token_mean": Variant(seq_mean_token_mean, "each sequence's token mean, averaged over sequences"),
    "seq_mean_token_sum_norm": Variant(seq_mean_token_sum_norm,
                                       "each sequence's token sum / algo.loss_agg_norm, averaged over sequences "
                                       "(Dr. GRPO)"),
}


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


# ---------------------------------------------------------------------------- KL and off-policy weights


def kl_penalty(kind: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi, by `algo.kl_estimator` (KL_ESTIMATORS)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r} (one of {', '.join(KL_ESTIMATORS)})")
    return KL_ESTIMATORS[kind].fn(logprobs - ref_logprobs)


def kl_k1(d: torch.Tensor) -> torch.Tensor:
    """d = log pi - log ref: unbiased, any sign."""
    return d


def kl_k2(d: torch.Tensor) -> torch.Tensor:
    """d^2 / 2: its gradient is the true KL's gradient."""
    return 0.5 * d * d


def kl_k3(d: torch.Tensor) -> torch.Tensor:
    """exp(-d) + d - 1: unbiased, >= 0."""
    return torch.exp(-d) + d - 1


def kl_low_var(d: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10]: a token whose reference probability collapsed cannot dominate the batch."""
    return kl_k3(d).clamp(-10, 10)


KL_ESTIMATORS = {
    "k1": Variant(kl_k1, "log pi - log ref (unbiased, any sign)"),
    "k2": Variant(kl_k2, "(log pi - log ref)^2 / 2 (its gradient is the true KL's)"),
    "k3": Variant(kl_k3, "exp(-k1) + k1 - 1 (unbiased, >= 0)"),
    "low_var_kl": Variant(kl_low_var, "k3 clamped to [-10, 10]"),
}


def approx_kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, >= 0."""
    return kl_penalty("k3", logprobs, ref_logprobs)


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
                level: str, mode: str = "truncate", low: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights for tokens the engine sampled under other weights than the trainer's old policy:
    the engine-trainer mismatch, and with partial rollouts or max_staleness the older weight versions too.
    The decoupled PPO objective: the ratio is taken against the trainer's old policy (the weights at the
    step's start), and each token's loss is weighted by w = pi_old / pi_engine, per token or per sequence
    (`level`, TIS_LEVELS); `mode` (TIS_MODES) says what becomes of a w outside the band [`low`, `cap`] (`low` 0: no
    lower bound; the bounds are ratios, compared with w itself, not its log). Returns (weights, indicator of w
    outside the band), both (B, T), no gradient."""
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r} ({' or '.join(TIS_LEVELS)})")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r} ({' or '.join(TIS_MODES)})")
    log_w = TIS_LEVELS[level].fn(((old_logprobs - rollout_logprobs) * mask).detach(), mask)
    w = torch.exp(log_w)
    outside = (w > cap) | (w < low)
    return TIS_MODES[mode].fn(w, outside, cap), outside.float()


def token_log_weights(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): each token's own log pi_old / pi_engine."""
    return log_w


def sequence_log_weights(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): the sequence's summed log ratio (the product of its token ratios) on each of its tokens."""
    return log_w.sum(-1, keepdim=True).expand_as(mask)


def geometric_log_weights(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): the sequence's mean log ratio (the geometric mean of its token ratios) on each of its tokens: one
    weight a sequence that does not grow or shrink with its length."""
    return (log_w.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(mask)


def truncate_weights(w: torch.Tensor, over: torch.Tensor, cap: float) -> torch.Tensor:
    return w.clamp(max=cap)


def mask_weights(w: torch.Tensor, over: torch.Tensor, cap: float) -> torch.Tensor:
    return w.masked_fill(over, 0.0)


TIS_LEVELS = {
    "token": Variant(token_log_weights, "each token's loss weighted by its own w = pi_old / pi_engine"),
    "sequence": Variant(sequence_log_weights, "each sequence's tokens weighted by the product of its token ratios"),
    "geometric": Variant(geometric_log_weights, "each sequence's tokens weighted by the geometric mean of its token "
                                                "ratios, exp(mean log w)"),
}
TIS_MODES = {
    "truncate": Variant(truncate_weights, "weight min(w, tis_cap)"),
    "mask": Variant(mask_weights, "weight w inside [tis_cap_low, tis_cap], else the token (or sequence) is left "
                                  "out"),
}


def needs_old_logprobs(train: TrainConfig, algo: AlgoConfig) -> bool:
    """Whether the policy's old logprobs need a forward pass of their own before the first update.

    The old-logprob reuse rule: with one optimizer step per rollout, the policy has not moved when the loss is
    computed, so current.detach() is the old logprob. Rollout logprobs as the old ones need no pass;
    KL folded into the reward needs the old logprobs before the advantages exist."""
    if algo.use_rollout_logprobs:
        return False
    several = train.num_steps_per_rollout * train.num_iterations > 1
    return several or (algo.kl_coef > 0 and algo.kl_in_reward)


def can_reuse_old_logprobs(train: TrainConfig, algo: AlgoConfig) -> bool:
    return not algo.use_rollout_logprobs and not needs_old_logprobs(train, algo)
