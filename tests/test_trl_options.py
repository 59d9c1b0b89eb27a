"""TRL's scale_rewards = "batch", mask_truncated_completions and num_iterations, against TRL's formulas written out
by hand: algo.advantage_estimator = "grpo_batch_std", algo.mask_truncated and train.num_iterations."""

import copy

import numpy as np
import pytest
import torch

from rl.config import AlgoConfig, TrainConfig
from rl.data import Status
from rl.train.algo import advantages, policy_loss
from rl.train.step import (
    build_schedule,
    fill_old_logprobs,
    mask_truncated,
    skippable_samples,
    token_logprobs,
    train_on_rollout,
)
from tests.test_train_options import samples
from tests.test_zero_advantage_skip import RecordingSGD
from tests.tiny import tiny_model

CPU = torch.device("cpu")


def test_batch_scaled_advantages_are_trls_scale_rewards_batch():
    rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1, 0.5, 0.5, 0.5, 0.5])
    groups = np.repeat([0, 1, 2], 4)
    # TRL: advantages = rewards - the group's mean, over the std of all the batch's rewards (unbiased) + eps
    means = np.array([rewards[groups == g].mean() for g in groups])
    want = (rewards - means) / (rewards.std(ddof=1) + 1e-6)
    got = advantages("grpo_batch_std", torch.tensor(rewards), torch.tensor(groups))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert got[8:].abs().max() == 0  # an all-equal group is 0, not 0 / eps


def test_batch_scaled_advantages_leave_unscored_rewards_out_of_the_std():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    scored = rewards[~rewards.isnan()]
    got = advantages("grpo_batch_std", rewards, groups)
    assert got[1] == 0
    assert got[0].item() == pytest.approx((1 - 1 / 3) / (scored.std().item() + 1e-6), rel=1e-6)


def truncated_rollout() -> list:
    """Two groups of four; samples 1, 5 and 6 hit the token limit."""
    batch = samples(8, seed=7)
    for s in batch:
        s.group_index = s.index // 4
        s.status = Status.TRUNCATED if s.index in (1, 5, 6) else Status.COMPLETED
    return batch


def gradients(batch: list, algo: AlgoConfig, packing: bool = False) -> tuple[list, dict]:
    """The gradient of one optimizer step over `batch` (the model does not move), and train_on_rollout's sums."""
    model = tiny_model(seed=1)
    train = TrainConfig(global_batch_size=len(batch), micro_batch_tokens=64, clip_grad=0.0, packing=packing)
    if packing:
        from rl.train.packing import use_packed_attention
        use_packed_attention(model)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule = build_schedule(batch, train, 0, 1, CPU, skip=skippable_samples(batch, algo))
    out = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=train, algo=algo, temperature=1.0)
    return optimizer.grads, out


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("packing", [False, True])
def test_masked_truncated_responses_leave_the_loss_as_if_they_were_not_there(loss_agg, packing, one_cpu_thread):
    """TRL zeroes a truncated completion's mask: its tokens leave the loss and its normalizer, while its reward
    has already counted in its group's advantages (computed before the mask)."""
    algo = AlgoConfig(eps_clip_high=0.28, loss_agg=loss_agg, entropy_coef=0.01)
    batch = truncated_rollout()
    assert mask_truncated(batch) == 3
    assert [i for i, s in enumerate(batch) if not any(s.loss_mask)] == [1, 5, 6]
    assert skippable_samples(batch, algo) == frozenset({1, 5, 6})  # no pass for them, even with the entropy bonus
    got, masked = gradients(batch, algo, packing)
    kept = [s for s in truncated_rollout() if s.index not in (1, 5, 6)]  # same advantages, the three left out
    want, without = gradients(kept, algo)
    assert masked["tokens"] == without["tokens"] == sum(sum(s.loss_mask) for s in kept)
    assert masked["loss_sum"] == pytest.approx(without["loss_sum"], rel=1e-5)
    assert max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True)) < 1e-5


def test_without_the_mask_truncated_responses_train():
    batch = truncated_rollout()
    algo = AlgoConfig(eps_clip_high=0.28)
    _, full = gradients(batch, algo)
    assert full["tokens"] == sum(sum(s.loss_mask) for s in batch)


def test_num_iterations_repeats_the_steps_against_the_old_logprobs_of_before_the_first(one_cpu_thread):
    """TRL's num_iterations = 2 with one step a generation: two optimizer steps over the same completions, each
    ratio taken against the policy before the first (written out here with plain autograd), whose logprobs take a
    pass of their own before the first step (train_on_rollout refuses to start without them)."""
    batch = samples(6, seed=3)
    train = TrainConfig(global_batch_size=6, micro_batch_size=6, clip_grad=0.0, num_iterations=2)
    algo = AlgoConfig(eps_clip=10.0, eps_clip_high=10.0)  # no clipping: every token's ratio is in the gradient
    model = tiny_model(seed=2)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule = build_schedule(batch, train, 0, 1, CPU)
    options = dict(dp_size=1, train=train, algo=algo, temperature=1.0)
    with pytest.raises(ValueError, match="fill_old_logprobs"):
        train_on_rollout(model, optimizer, scheduler, schedule, **options)
    fill_old_logprobs(model, schedule.micro_batches, 1.0)
    train_on_rollout(model, optimizer, scheduler, schedule, **options)
    assert scheduler.last_epoch == 2

    (mb,) = schedule.steps[0]
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    with torch.no_grad():
        old = token_logprobs(reference, mb, 1.0)[0]
    for _ in range(2):
        sgd.zero_grad()
        lp = token_logprobs(reference, mb, 1.0)[0]
        loss, _ = policy_loss("ppo", lp, old, mb.advantages, mb.loss_mask, 10.0, 10.0)
        ((loss * mb.loss_mask).sum() / mb.loss_mask.sum()).backward()
        sgd.step()
    with torch.no_grad():
        moved = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), tiny_model(seed=2).parameters()))
        diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    assert moved > 1e-3 and diff < 1e-5 * moved


def test_throughput_counts_every_pass_of_num_iterations(monkeypatch):
    """Two passes over the same samples in the same seconds are twice the tokens a second and twice the FLOPs."""
    import types

    from rl.train import learner
    monkeypatch.setattr(learner, "peak_bf16_flops", lambda device: 1e12)
    dist = types.SimpleNamespace(device=CPU, world_size=1)
    config, batch, times = tiny_model(seed=0).config, samples(4), {"perf/train_s": 2.0}
    once = learner.train_throughput(config, batch, times, dist, extra_forward=True)
    twice = learner.train_throughput(config, batch, times, dist, extra_forward=True, iterations=2)
    assert twice["perf/train_tokens_per_s"] == 2 * once["perf/train_tokens_per_s"]
    assert twice["perf/train_mfu"] == pytest.approx(once["perf/train_mfu"] * (2 + 1 / 3) / (1 + 1 / 3))


def test_masking_truncated_responses_with_the_kl_in_the_reward_is_one_line():
    from rl.config import ConfigError, config_from_dict
    algo = {"mask_truncated": True, "kl_coef": 0.1, "kl_in_reward": True}
    with pytest.raises(ConfigError, match="algo.mask_truncated with algo.kl_in_reward") as err:
        config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl"}, "algo": algo})
    assert "\n" not in str(err.value)
