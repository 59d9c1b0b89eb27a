"""Where README says "TRL's", the numbers are TRL's: its CISPO loss, its advantages for a response that every reward
function passes on, and its documented reward-function conventions (async functions, `trainer_state`, `log_metric`,
`log_extra`, factories) run through the reward pool as a run runs them. TRL's formulas are written out here by hand
(TRL itself is not a dependency)."""

import math

import pytest
import torch

from rl.algo import advantages, aggregate, policy_loss


# ---------------------------------------------------------------------------- CISPO


def trl_cispo_loss(logprobs, old_logprobs, adv, mask, epsilon_high):
    """TRL's CISPO (loss_type="cispo"): the ratio capped at epsilon_high itself (no lower bound), detached, times
    -A log p, summed over the batch's tokens and divided by their number."""
    weight = torch.exp(logprobs - old_logprobs).clamp(max=epsilon_high).detach()
    return ((-weight * adv * logprobs) * mask).sum() / mask.sum()


def rl_cispo_loss(logprobs, old_logprobs, adv, mask, eps_clip_high):
    per_token, _ = policy_loss("cispo", logprobs, old_logprobs, adv, mask, eps_clip=1.0, eps_clip_high=eps_clip_high)
    return aggregate(per_token, mask, "token_mean", float(mask.sum()), 1.0, 1.0)


def test_cispo_maps_epsilon_high_to_eps_clip_high_plus_one():
    # Ratios e^0.5 = 1.649, 1 and e^-0.5 = 0.607, advantage 1.
    logprobs = torch.tensor([[-0.5, -1.0, -2.0]])
    old = torch.tensor([[-1.0, -1.0, -1.5]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    # TRL with epsilon_high = 1.3: weights 1.3, 1, 0.607 -> (1.3 * 0.5 + 1 * 1 + 0.607 * 2) / 3
    by_hand = (1.3 * 0.5 + 1.0 + math.exp(-0.5) * 2.0) / 3
    assert by_hand == pytest.approx(0.95436, abs=1e-5)
    assert trl_cispo_loss(logprobs, old, adv, mask, 1.3).item() == pytest.approx(by_hand, rel=1e-6)
    # README's mapping: eps_clip_high = epsilon_high - 1.
    assert rl_cispo_loss(logprobs, old, adv, mask, 0.3).item() == pytest.approx(by_hand, rel=1e-6)
    # The off-by-one mapping (eps_clip_high = epsilon_high) caps at 2.3 and keeps the 1.649: another loss.
    assert rl_cispo_loss(logprobs, old, adv, mask, 1.3).item() == pytest.approx((math.exp(0.5) * 0.5 + 1 + math.exp(
        -0.5) * 2) / 3, rel=1e-6)
    # The gradient is the same too: every token keeps it, weighted by the capped ratio.
    for loss in (trl_cispo_loss, rl_cispo_loss):
        lp = logprobs.clone().requires_grad_()
        loss(lp, old, adv, mask, 1.3 if loss is trl_cispo_loss else 0.3).backward()
        assert lp.grad.tolist()[0] == pytest.approx([-1.3 / 3, -1 / 3, -math.exp(-0.5) / 3], rel=1e-6)


def test_readme_maps_cispo_epsilon_high_minus_one():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith('| `loss_type="cispo"`'))
    assert "`epsilon_high` - 1" in row, row


# ---------------------------------------------------------------------------- None: every function passed


NAN = math.nan


def test_a_response_every_function_passes_on_is_left_out_of_its_group_as_trl_leaves_it():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0, 2.0, 2.0, NAN, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # TRL, group [1, None, 0, 0]: mean over the three scored 1/3, unbiased std sqrt(1/3) = 0.577;
    # (1 - 1/3) / 0.577 = 1.155, (0 - 1/3) / 0.577 = -0.577, and 0 for the unscored one.
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    grpo = advantages("grpo", rewards, groups)
    assert grpo[:4].tolist() == pytest.approx([(2 / 3) / std, 0.0, -(1 / 3) / std, -(1 / 3) / std], abs=1e-5)
    assert grpo[:4].tolist() == pytest.approx([1.155, 0.0, -0.577, -0.577], abs=1e-3)
    # group [2, 2, None, 0]: mean 4/3, std sqrt(4/3) = 1.155
    std = math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2)
    assert grpo[4:].tolist() == pytest.approx([(2 / 3) / std, (2 / 3) / std, 0.0, -(4 / 3) / std], abs=1e-5)
    # Without the std (TRL's scale_rewards="none"): centred on the scored mean.
    assert advantages("dr_grpo", rewards, groups).tolist() == pytest.approx(
        [2 / 3, 0.0, -1 / 3, -1 / 3, 2 / 3, 2 / 3, 0.0, -4 / 3], abs=1e-6)
    # RLOO: the mean of the other scored ones, G / (G - 1) x centred with G = 3 scored.
    assert advantages("rloo", rewards, groups).tolist() == pytest.approx(
        [1.0, 0.0, -0.5, -0.5, 1.0, 1.0, 0.0, -2.0], abs=1e-6)


def test_unscored_responses_are_left_out_of_the_batch_whitening():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    # REINFORCE++: the three scored rewards whitened alone: mean 1/3, unbiased var 1/3.
    rpp = advantages("reinforce_plus_plus", rewards, groups)
    assert rpp.tolist() == pytest.approx([(2 / 3) / math.sqrt(1 / 3), 0.0, -(1 / 3) / math.sqrt(1 / 3),
                                          -(1 / 3) / math.sqrt(1 / 3)], abs=1e-5)
    # With the group baseline: group 0 has one scored reward (centred to 0), group 1 two zeros: all 0.
    assert advantages("reinforce_plus_plus_baseline", rewards, groups).tolist() == [0.0, 0.0, 0.0, 0.0]
    # A group every function passed on has no signal at all.
    assert advantages("grpo", torch.tensor([NAN, NAN, 1.0, 0.0]), groups)[:2].tolist() == [0.0, 0.0]


def test_gae_counts_an_unscored_response_as_reward_zero():
    from rl.algo import gae

    mask = torch.ones(1, 2)
    nan_adv, nan_ret = gae(torch.tensor([[0.0, NAN]]), torch.tensor([[0.5, 0.25]]), mask, 1.0, 1.0)
    zero_adv, zero_ret = gae(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 0.25]]), mask, 1.0, 1.0)
    assert nan_adv.tolist() == zero_adv.tolist() == [[-0.5, -0.25]] and nan_ret.tolist() == zero_ret.tolist()


def test_rollout_metrics_and_the_dynamic_filter_leave_unscored_responses_out():
    from rl.collect import keep_group, rollout_metrics
    from rl.data import Sample

    def group(*rewards):
        return [Sample("p", [0, 1], reward=r, response_length=1) for r in rewards]

    assert not keep_group(group(1.0, NAN, NAN, 1.0), "nonzero_std")  # one distinct scored reward: no signal
    assert keep_group(group(1.0, NAN, 0.0, 0.0), "nonzero_std")
    stats = rollout_metrics(group(1.0, NAN, 0.0, 0.0) + group(NAN, NAN, NAN, NAN), 4)
    assert stats["rollout/reward_mean"] == pytest.approx(1 / 3) and stats["rollout/zero_std_group_frac"] == 0.5
