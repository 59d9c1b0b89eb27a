import math

import pytest
import torch

from rl.algo import approx_kl_k3, can_reuse_old_logprobs, grpo_advantages, ppo_clip_loss
from rl.config import AlgoConfig, TrainConfig
from rl.train import ChunkedLogprobs


def test_grpo_seed_group():
    rewards = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.float)
    adv = grpo_advantages(rewards, torch.zeros(8, dtype=torch.long))
    expected = 0.5 / (math.sqrt(8 * 0.25 / 7) + 1e-6)  # unbiased std 0.5345 -> 0.9354
    assert expected == pytest.approx(0.9354, abs=1e-4)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected,
                                          expected, -expected, expected, -expected], abs=1e-6)


def test_grpo_groups_are_independent_and_toggle():
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups)
    assert adv[:2].tolist() == [0.0, 0.0]  # all-equal group carries no signal
    assert adv[2].item() == pytest.approx(-1.0 / (math.sqrt(2) + 1e-6))
    assert adv[4].item() == 0.0  # a group of one is only centred
    plain = grpo_advantages(rewards, groups, std_normalization=False)
    assert plain.tolist() == [0.0, 0.0, -1.0, 1.0, 0.0]


def test_ppo_clip_hand_values():
    e = math.e
    logprobs = torch.tensor([[1.0, 1.0, math.log(0.5), math.log(0.5), 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    loss, clipped = ppo_clip_loss(logprobs, old, adv, eps_clip=0.2, eps_clip_high=0.2)
    # ratio e, A=+1: max(-e, -1.2) = -1.2, clipped; ratio e, A=-1: max(e, 1.2) = e
    # ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5; ratio 0.5, A=-1: max(0.5, 0.8) = 0.8, clipped; ratio 1: -A
    assert loss[0].tolist() == pytest.approx([-1.2, e, -0.5, 0.8, -2.0], abs=1e-6)
    assert clipped[0].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_ppo_clip_higher():
    loss, clipped = ppo_clip_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                                  eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert clipped.item() == 1.0


def test_ppo_gradient_when_ratio_is_one():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, logprobs.detach(), torch.tensor([[0.9354, -0.9354]]), 0.2, 0.2)
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
    got_lp, got_entropy = ChunkedLogprobs.apply(logits, target, temperature, 4)  # 3 chunks, the last short
    (got_grad,) = torch.autograd.grad((got_lp * weights).sum(), logits)
    assert torch.allclose(got_lp.double(), want_lp, atol=1e-6)
    assert torch.allclose(got_entropy.double(), want_entropy, atol=1e-5)
    assert torch.allclose(got_grad, want_grad, atol=1e-6)
