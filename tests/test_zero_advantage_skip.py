"""Samples of a zero-advantage group skip the train passes and leave the step's gradient as it was: the loss
still divides by every sample's tokens (or sequences), and the skip stops where a term reaches such a sample
without its advantage (the entropy bonus, the KL to the reference, GAE)."""

import pytest
import torch

from rl.config import AlgoConfig, TrainConfig
from rl.train.packing import use_packed_attention
from rl.train.step import build_schedule, skippable_samples, train_on_rollout
from tests.test_train_options import samples
from tests.tiny import tiny_model


class RecordingSGD(torch.optim.SGD):
    """Keeps the gradients each step sees (and moves nothing)."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def rollout() -> list:
    """Three groups of four; the second group's rewards were all equal, so its advantages are all 0."""
    batch = samples(12, seed=4)
    for s in batch:
        s.group_index = s.index // 4
        if s.group_index == 1:
            s.advantage = 0.0
    return batch


def step_gradients(algo: AlgoConfig, skip: frozenset[int], packing: bool = False) -> tuple[list, dict]:
    model = tiny_model(seed=1)
    if packing:
        use_packed_attention(model)
    train = TrainConfig(global_batch_size=12, micro_batch_tokens=64, clip_grad=0.0, packing=packing)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule = build_schedule(rollout(), train, 0, 1, torch.device("cpu"), skip=skip)
    out = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=train, algo=algo, temperature=1.0)
    out["rows"] = sum(len(mb.indices) for mb in schedule.steps[0])
    return optimizer.grads, out


def max_rel_err(got: list, want: list) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("packing", [False, True])
def test_skipped_zero_advantage_group_changes_no_gradient(loss_agg, packing, one_cpu_thread):
    algo = AlgoConfig(eps_clip_high=0.28, loss_agg=loss_agg, loss_agg_norm=64.0, tis_cap=2.0)
    skip = skippable_samples(rollout(), algo)
    assert skip == frozenset(range(4, 8))
    want, full = step_gradients(algo, frozenset())
    got, skipped = step_gradients(algo, skip, packing)
    assert skipped["rows"] == full["rows"] - 4  # the group ran no pass
    assert skipped["loss_sum"] == pytest.approx(full["loss_sum"], rel=1e-5)
    assert skipped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5) and full["grad_norm"] > 0
    assert max_rel_err(got, want) < 1e-5


@pytest.mark.parametrize("algo", [AlgoConfig(eps_clip_high=0.2, entropy_coef=0.01),
                                  AlgoConfig(eps_clip_high=0.2, kl_coef=0.1),
                                  AlgoConfig(eps_clip_high=0.2, kl_coef=0.1, kl_in_reward=True),
                                  AlgoConfig(eps_clip_high=0.2, advantage_estimator="gae")],
                         ids=["entropy", "kl_loss", "kl_in_reward", "gae"])
def test_no_skip_where_a_term_reaches_zero_advantage_samples(algo):
    assert skippable_samples(rollout(), algo) == frozenset()


def test_the_entropy_bonus_is_why_it_keeps_them():
    """What the rule protects: with the entropy bonus on, leaving out the zero-advantage group moves the gradient."""
    algo = AlgoConfig(eps_clip_high=0.2, entropy_coef=0.01)
    want, _ = step_gradients(algo, frozenset())
    got, _ = step_gradients(algo, frozenset(range(4, 8)))
    assert max_rel_err(got, want) > 1e-3


def test_a_step_with_every_sample_skipped_still_steps_on_zero_gradients():
    """All groups without signal: one pass of zero loss keeps every rank's collectives in step, and the
    optimizer sees zero gradients (as it would have without the skip), not missing ones."""
    algo = AlgoConfig(eps_clip_high=0.2)
    grads, out = step_gradients(algo, frozenset(range(12)))
    assert out["rows"] == 1 and out["tokens"] == 0 and out["grad_norm"] == 0
    assert all(g is not None and not g.any() for g in grads)


def test_an_odd_number_of_skippable_samples_still_splits_evenly_over_ranks():
    """A sample whose reward is its group's mean has advantage 0 alone in its group: the skippable count can be
    odd. Every rank must still take as many samples as the others, so the shortest skippable one trains after
    all (at zero advantage), and every other sample is trained exactly once."""
    batch = rollout()
    batch[0].advantage = 0.0  # 4 + 1 skippable of 12: 7 left, which 2 ranks cannot share evenly
    skip = skippable_samples(batch, AlgoConfig())
    train = TrainConfig(global_batch_size=12, micro_batch_size=2)
    trained = []
    for rank in range(2):
        steps = build_schedule(batch, train, rank, 2, torch.device("cpu"), skip=skip).steps
        trained.append([i for mb in steps[0] for i, m in zip(mb.indices, mb.loss_mask.sum(-1)) if m > 0])
    assert len(trained[0]) == len(trained[1]) == 4
    everyone = trained[0] + trained[1]
    assert sorted(set(everyone)) == sorted(everyone) and set(range(12)) - skip <= set(everyone)
