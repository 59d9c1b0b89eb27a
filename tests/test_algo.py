import math

import pytest
import torch

from rl.config import AlgoConfig, TrainConfig
from rl.train.algo import (
    advantages,
    aggregate,
    approx_kl_k3,
    can_reuse_old_logprobs,
    gae,
    kl_penalty,
    policy_loss,
    tis_weights,
    value_loss,
)
from rl.train.step import TokenLogprobs


def test_grpo_seed_group():
    rewards = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.float)
    adv = advantages("grpo", rewards, torch.zeros(8, dtype=torch.long))
    expected = 0.5 / (math.sqrt(8 * 0.25 / 7) + 1e-6)  # unbiased std 0.5345 -> 0.9354
    assert expected == pytest.approx(0.9354, abs=1e-4)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected,
                                          expected, -expected, expected, -expected], abs=1e-6)


def test_grpo_groups_are_independent_and_toggle():
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = advantages("grpo", rewards, groups)
    assert adv[:2].tolist() == [0.0, 0.0]  # all-equal group carries no signal
    assert adv[2].item() == pytest.approx(-1.0 / (math.sqrt(2) + 1e-6))
    assert adv[4].item() == 0.0  # a group of one is only centred
    plain = advantages("grpo", rewards, groups, std_normalization=False)
    assert plain.tolist() == [0.0, 0.0, -1.0, 1.0, 0.0]


def test_ppo_clip_hand_values():
    e = math.e
    logprobs = torch.tensor([[1.0, 1.0, math.log(0.5), math.log(0.5), 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    loss, clipped = policy_loss("ppo", logprobs, old, adv, torch.ones_like(adv), eps_clip=0.2, eps_clip_high=0.2)
    # ratio e, A=+1: max(-e, -1.2) = -1.2, clipped; ratio e, A=-1: max(e, 1.2) = e
    # ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5; ratio 0.5, A=-1: max(0.5, 0.8) = 0.8, clipped; ratio 1: -A
    assert loss[0].tolist() == pytest.approx([-1.2, e, -0.5, 0.8, -2.0], abs=1e-6)
    assert clipped[0].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_ppo_clip_higher():
    loss, clipped = policy_loss("ppo", torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                                torch.ones(1, 1), eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert clipped.item() == 1.0


def test_ppo_gradient_when_ratio_is_one():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss("ppo", logprobs, logprobs.detach(), torch.tensor([[0.9354, -0.9354]]), torch.ones(1, 2),
                          0.2, 0.2)
    assert loss[0].tolist() == pytest.approx([-0.9354, 0.9354])
    loss.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-0.9354, 0.9354])  # d(-ratio*A)/dlogp = -A


def test_reuse_rule_seed_step_38():
    algo = AlgoConfig(eps_clip_high=0.2)
    assert can_reuse_old_logprobs(TrainConfig(num_steps_per_rollout=1), algo)
    assert not can_reuse_old_logprobs(TrainConfig(num_steps_per_rollout=4), algo)
    assert not can_reuse_old_logprobs(TrainConfig(), AlgoConfig(use_rollout_logprobs=True))


def test_k3_is_nonnegative_and_zero_at_equality():
    a = torch.randn(100)
    assert torch.all(approx_kl_k3(a, a + torch.randn(100)) >= 0)
    assert approx_kl_k3(a, a).abs().max() == 0


def test_k3_hand_value_and_argument_order():
    """KL(pi || ref) from tokens drawn from pi: with log pi = 0 and log ref = log 2 the log-ratio is
    log 2, so k3 = 2 - log 2 - 1 = 0.3069; swapped it would be 1/2 + log 2 - 1 = 0.1931."""
    got = approx_kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2)]))
    assert got.item() == pytest.approx(1 - math.log(2), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_log_softmax_and_its_gradient(temperature):
    torch.manual_seed(0)
    logits = torch.randn(11, 37, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (11,))
    weights = torch.randn(11, dtype=torch.float64)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    want_lp = logp.gather(-1, target[:, None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    (want_grad,) = torch.autograd.grad((want_lp * weights).sum(), logits)
    got_lp, got_entropy = TokenLogprobs.apply(logits, target, temperature, 4)  # 3 chunks, the last short
    (got_grad,) = torch.autograd.grad((got_lp * weights).sum(), logits)
    assert torch.allclose(got_lp.double(), want_lp, atol=1e-6)
    assert torch.allclose(got_entropy.double(), want_entropy, atol=1e-5)
    assert torch.allclose(got_grad, want_grad, atol=1e-6)


# ---------------------------------------------------------------------------- the algorithm menu, by hand

GROUP = torch.zeros(4, dtype=torch.long)


def test_rloo_leave_one_out():
    """[1, 0, 0, 1]: a 1 sees the others' mean 1/3 -> 2/3; a 0 sees 2/3 -> -2/3."""
    adv = advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 1.0]), GROUP)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)
    # a group of one has no other sample to compare with
    assert advantages("rloo", torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]


def test_dr_grpo_is_centred_without_std():
    adv = advantages("dr_grpo", torch.tensor([1.0, 0.0, 1.0, 0.0]), GROUP)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5], abs=1e-7)


def test_reinforce_plus_plus_whitens_over_the_batch_by_tokens():
    """Rewards [1, 0] from two groups, with 3 and 1 trained tokens: as a token batch [1, 1, 1, 0], mean 3/4,
    unbiased var (3 (1/4)^2 + (3/4)^2) / 3 = 1/4, so A = (r - 3/4) / (1/2) = [0.5, -1.5]."""
    adv = advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 1]),
                     token_counts=torch.tensor([3.0, 1.0]))
    assert adv.tolist() == pytest.approx([0.5, -1.5], abs=1e-6)


def test_reinforce_plus_plus_baseline_centres_in_the_group_then_whitens():
    """Group 0 [2, 0] -> [1, -1], group 1 [5, 5] -> [0, 0]; over the batch [1, -1, 0, 0] the mean is 0 and the
    unbiased var 2/3, so A = [1, -1, 0, 0] / sqrt(2/3) = +-1.2247."""
    adv = advantages("reinforce_plus_plus_baseline", torch.tensor([2.0, 0.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]),
                     token_counts=torch.ones(4))
    assert adv.tolist() == pytest.approx([1.2247449, -1.2247449, 0.0, 0.0], abs=1e-6)


def test_gae_by_hand():
    """Rewards only at the last of 3 tokens (r = 1), values [0.5, 0.6, 0.8], gamma 0.9, lambda 0.5:
    delta_3 = 1 - 0.8 = 0.2; delta_2 = 0.9 * 0.8 - 0.6 = 0.12; delta_1 = 0.9 * 0.6 - 0.5 = 0.04;
    A_3 = 0.2, A_2 = 0.12 + 0.45 * 0.2 = 0.21, A_1 = 0.04 + 0.45 * 0.21 = 0.1345; returns = A + V.
    The padding token after the response gets nothing and passes nothing back."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.8, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.1345, 0.21, 0.2, 0.0], abs=1e-6)
    assert returns[0, :3].tolist() == pytest.approx([0.6345, 0.81, 1.0], abs=1e-6)


def test_value_loss_clipped_by_hand():
    """V_old 1, V 2, R 3, clip 0.5: unclipped (2 - 3)^2 = 1, clipped V 1.5 -> (1.5 - 3)^2 = 2.25: the
    larger, 0.5 * 2.25 = 1.125, clipped. V 1.2 (inside the clip range): 0.5 * 1.8^2 = 1.62."""
    loss, clipped = value_loss(torch.tensor([2.0, 1.2]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, 3.0]), 0.5)
    assert loss.tolist() == pytest.approx([1.125, 1.62], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0]


def test_dual_clip_caps_a_negative_advantage():
    """ratio e^2 = 7.39 on A = -1: PPO's loss max(7.39, 1.2) = 7.39; the dual clip caps it at 3 * 1 = 3 and the
    token no longer pushes (zero gradient). A positive advantage is untouched."""
    logprobs = torch.tensor([[2.0, 2.0]], requires_grad=True)
    loss, clipped = policy_loss("ppo", logprobs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2),
                                0.2, 0.2, eps_clip_c=3.0)
    assert loss[0].tolist() == pytest.approx([3.0, -1.2], abs=1e-6)
    assert clipped[0].tolist() == [1.0, 1.0]
    loss.sum().backward()
    assert logprobs.grad[0].tolist() == [0.0, 0.0]
    plain, _ = policy_loss("ppo", logprobs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2)
    assert plain[0, 0].item() == pytest.approx(math.exp(2.0), abs=1e-5)


def test_gspo_sequence_ratio_is_the_geometric_mean():
    """Token log-ratios [0.1, 0.3] (and a masked 5.0): s = exp(0.2) = 1.2214 for both trained tokens; with
    eps 0.3 it is inside the clip range, so each token's gradient is -s A (A = 1) on its own logprob."""
    logprobs = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipped = policy_loss("gspo", logprobs, torch.zeros(1, 3), torch.ones(1, 3), mask, 0.3, 0.3)
    s = math.exp(0.2)
    assert (loss * mask)[0].tolist() == pytest.approx([-s, -s, 0.0], abs=1e-6)
    ((loss * mask).sum()).backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-s, -s, 0.0], abs=1e-6)
    # eps 0.1: s = 1.2214 > 1.1 for the whole sequence, clipped together
    loss, clipped = policy_loss("gspo", logprobs, torch.zeros(1, 3), torch.ones(1, 3), mask, 0.1, 0.1)
    assert (loss * mask)[0, :2].tolist() == pytest.approx([-1.1, -1.1], abs=1e-6)
    assert (clipped * mask)[0].tolist() == [1.0, 1.0, 0.0]


def test_cispo_keeps_the_gradient_with_a_clipped_weight():
    """ratio e^0.5 = 1.6487 capped at 1.2: the loss is -1.2 A log p, so d loss / d log p = -1.2 A (PPO's clip
    would give 0 here); a ratio of 1 keeps weight 1."""
    logprobs = torch.tensor([[0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0]])
    loss, clipped = policy_loss("cispo", logprobs, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-2.4, 1.0], abs=1e-6)
    assert clipped[0].tolist() == [1.0, 0.0]
    ppo, _ = policy_loss("ppo", logprobs, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2)
    assert torch.autograd.grad(ppo[0, 0], logprobs)[0][0, 0].item() == 0.0


def test_loss_aggregations_by_hand():
    """Two sequences, losses [1, 2, 3] (3 tokens) and [4] (1 token, then padding):
    token_mean (1 + 2 + 3 + 4) / 4 = 2.5; seq_mean_token_mean (2 + 4) / 2 = 3;
    seq_mean_token_sum_norm with norm 10: (6 / 10 + 4 / 10) / 2 = 0.5. Global counts can exceed this
    micro-batch's: with 8 tokens and 4 sequences in the batch the shares halve."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token_mean", 4, 2, 10.0).item() == pytest.approx(2.5)
    assert aggregate(values, mask, "seq_mean_token_mean", 4, 2, 10.0).item() == pytest.approx(3.0)
    assert aggregate(values, mask, "seq_mean_token_sum_norm", 4, 2, 10.0).item() == pytest.approx(0.5)
    assert aggregate(values, mask, "token_mean", 8, 4, 10.0).item() == pytest.approx(1.25)
    assert aggregate(values, mask, "seq_mean_token_mean", 8, 4, 10.0).item() == pytest.approx(1.5)


def test_kl_estimators_by_hand():
    """log pi = -1, log ref = -2, so d = 1: k1 = 1, k2 = 0.5, k3 = e^-1 + 1 - 1 = 0.3679. With log ref = -13,
    d = 12: k3 = e^-12 + 11 = 11.000006, which low_var_kl clamps to 10; d = -1: k1 = -1 (k1 has any sign)."""
    lp, ref = torch.tensor([-1.0, -1.0, -2.0]), torch.tensor([-2.0, -13.0, -1.0])
    assert kl_penalty("k1", lp, ref).tolist() == pytest.approx([1.0, 12.0, -1.0])
    assert kl_penalty("k2", lp, ref).tolist() == pytest.approx([0.5, 72.0, 0.5])
    assert kl_penalty("k3", lp, ref).tolist() == pytest.approx([math.exp(-1), 11 + math.exp(-12), math.e - 2], abs=1e-5)
    assert kl_penalty("low_var_kl", lp, ref).tolist() == pytest.approx([math.exp(-1), 10.0, math.e - 2], abs=1e-5)


def test_tis_weights_capped():
    """pi_old / pi_engine per token: e^0.5 = 1.6487 -> capped at 1.5; e^-1 = 0.3679 kept; a masked token 1.
    Sequence level: the product e^(0.5 - 1) = 0.6065 for every token of the row, below the cap."""
    old = torch.tensor([[0.5, -1.0, 7.0]])
    engine = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, capped = tis_weights(old, engine, mask, 1.5, "token")
    assert w[0].tolist() == pytest.approx([1.5, math.exp(-1), 1.0], abs=1e-6)
    assert capped[0].tolist() == [1.0, 0.0, 0.0]
    w, capped = tis_weights(old, engine, mask, 1.5, "sequence")
    assert w[0].tolist() == pytest.approx([math.exp(-0.5)] * 3, abs=1e-6)
    assert capped[0].tolist() == [0.0, 0.0, 0.0]
    w, capped = tis_weights(old, engine, mask, 0.5, "sequence")
    assert w[0].tolist() == pytest.approx([0.5] * 3) and capped[0].tolist() == [1.0, 1.0, 1.0]


def test_tis_mask_leaves_out_what_the_cap_would_truncate():
    """Mode "mask": e^0.5 = 1.6487 > 1.5 gives 0 (the token leaves the loss), e^-1 keeps its weight; at sequence
    level the whole row goes when the product passes the cap."""
    old = torch.tensor([[0.5, -1.0, 7.0], [0.1, 0.2, 0.0]])
    engine = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, over = tis_weights(old, engine, mask, 1.5, "token", "mask")
    assert w.flatten().tolist() == pytest.approx([0.0, math.exp(-1), 1.0, math.exp(0.1), math.exp(0.2), 1.0], abs=1e-6)
    assert over.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    w, over = tis_weights(old, engine, mask, 1.2, "sequence", "mask")
    assert w.flatten().tolist() == pytest.approx([math.exp(-0.5)] * 3 + [0.0] * 3, abs=1e-6)  # e^0.3 = 1.35 > 1.2
    with pytest.raises(ValueError, match="truncate or mask"):
        tis_weights(old, engine, mask, 1.2, "token", "drop")


def test_chunked_entropy_gradient_matches_autograd():
    torch.manual_seed(0)
    logits = torch.randn(9, 23, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 23, (9,))
    w_lp, w_h = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    want_lp = logp.gather(-1, target[:, None]).squeeze(-1)
    want_h = -(logp.exp() * logp).sum(-1)
    (want,) = torch.autograd.grad((want_lp * w_lp).sum() + (want_h * w_h).sum(), logits)
    got_lp, got_h = TokenLogprobs.apply(logits, target, 0.7, 4)
    (got,) = torch.autograd.grad((got_lp * w_lp).sum() + (got_h * w_h).sum(), logits)
    assert torch.allclose(got, want, atol=1e-6)
    got_lp, got_h = TokenLogprobs.apply(logits, target, 0.7, 4)  # the entropy alone
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    (want,) = torch.autograd.grad((-(logp.exp() * logp).sum(-1) * w_h).sum(), logits)
    (got,) = torch.autograd.grad((got_h * w_h).sum(), logits)
    assert torch.allclose(got, want, atol=1e-6)


def test_an_unknown_variant_is_refused_with_its_tables_names():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"unknown policy loss 'dapo' \(one of ppo, gspo, cispo\)"):
        policy_loss("dapo", t, t, t, torch.ones_like(t), 0.2, 0.2)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4' \(one of k1, k2, k3, low_var_kl\)"):
        kl_penalty("k4", t, t)
    with pytest.raises(ValueError, match=r"unknown TIS level 'row' \(token or sequence or geometric\)"):
        tis_weights(t, t, torch.ones_like(t), 2.0, "row")
    with pytest.raises(ValueError, match="gae is per token"):
        advantages("gae", torch.ones(2), torch.zeros(2, dtype=torch.long))
