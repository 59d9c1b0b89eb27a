"""Per-rank statistics reduced to one step's metrics, against sums worked out by hand."""

import pytest

from rl.env.reward import reduce_metrics
from rl.train.step import SUM_KEYS, train_metrics


def rank_stats(**values: float) -> dict[str, float]:
    """One rank's outputs of train_on_rollout: its sums (SUM_KEYS) and the rest it returns, zero unless given."""
    keys = (*SUM_KEYS, "grad_norm", "lr", "skipped_steps", "leading_skipped_steps", "trailing_skipped_steps",
            "longest_skipped_run", "router_aux_coef")
    return {key: 0.0 for key in keys} | values


def test_train_metrics_are_token_means_over_all_ranks():
    """Two ranks, two optimizer steps. `loss_sum` is each rank's share of every step's global token-mean loss
    (already divided by the step's global token count), so the ranks' sums add up to the sum of the step
    losses: 0.3 - 0.1 = 0.2 over 2 steps -> 0.1. The per-token metrics divide the summed numerators by the
    summed tokens (8 + 4 = 12), not by the ranks: a mean of the rank means would give (2/8 + 2/4) / 2 = 0.375
    clip and (10/8 + 2/4) / 2 = 0.875 entropy instead of 4/12 and 12/12."""
    per_rank = [
        rank_stats(loss_sum=0.3, clipped_tokens=2, entropy_sum=10, tokens=8, mismatch_abs_sum=0.4,
                   mismatch_abs_max=0.2, mismatch_k3_sum=0.02, mismatch_k3_max=0.01, mismatch_tokens=8,
                   grad_norm=1.5, lr=1e-6),
        rank_stats(loss_sum=-0.1, clipped_tokens=2, entropy_sum=2, tokens=4, mismatch_abs_sum=0.2,
                   mismatch_abs_max=0.5, mismatch_k3_sum=0.04, mismatch_k3_max=0.03, mismatch_tokens=4,
                   grad_norm=1.5, lr=1e-6),
    ]
    m = train_metrics(per_rank, num_steps=2)
    assert m["train/loss"] == pytest.approx(0.1)
    assert m["train/clip_frac"] == pytest.approx(4 / 12)
    assert m["train/entropy"] == pytest.approx(1.0)
    assert m["train/tokens"] == 12
    assert m["train/grad_norm"] == 1.5 and m["train/lr"] == 1e-6  # the same on every rank: taken once
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(0.6 / 12)
    assert m["rollout/logprob_abs_diff_max"] == 0.5
    assert m["rollout/logprob_k3_kl"] == pytest.approx(0.06 / 12)
    assert m["rollout/logprob_k3_kl_max"] == 0.03  # the largest over the ranks


def test_train_metrics_without_loss_tokens_are_zero():
    m = train_metrics([rank_stats(grad_norm=0.0), rank_stats(grad_norm=0.0)], num_steps=1)
    assert m["train/clip_frac"] == m["train/entropy"] == m["rollout/logprob_k3_kl"] == 0.0


def test_reward_metrics_average_the_means_and_sum_the_counts():
    """Equal shares of samples per rank: the means average over ranks, the error and timeout counts add."""
    per_rank = [
        {"reward/correct_mean": 0.5, "reward/format_mean": 1.0, "reward/length_mean": -0.2,
         "reward/num_errors": 1.0, "reward/num_timeouts": 0.0},
        {"reward/correct_mean": 0.25, "reward/format_mean": 0.5, "reward/length_mean": 0.0,
         "reward/num_errors": 2.0, "reward/num_timeouts": 3.0},
    ]
    m = reduce_metrics(per_rank)
    assert m == pytest.approx({"reward/correct_mean": 0.375, "reward/format_mean": 0.75, "reward/length_mean": -0.1,
                               "reward/num_errors": 3.0, "reward/num_timeouts": 3.0})


def test_derived_seeds_do_not_collide():
    from rl.rollout import derive_seed

    # the sampling seeds of 4 rollouts x 3 rounds x 8 engines, and 300 per-request seeds under each of them
    calls = [derive_seed(0, r, k, e) for r in range(4) for k in range(1, 4) for e in range(8)]
    requests = [derive_seed(c, i) for c in calls for i in range(300)]
    assert len(set(calls)) == len(calls) and len(set(requests)) == len(requests)
    assert all(0 <= s < 2**31 for s in requests) and derive_seed(1, 2) == derive_seed(1, 2)


def test_skipped_runs_count_the_start_the_end_and_the_longest_run():
    from rl.train.step import skipped_runs

    assert skipped_runs([True, False, True, True, True, False, True]) == {
        "skipped_steps": 5, "leading_skipped_steps": 1, "trailing_skipped_steps": 1, "longest_skipped_run": 3}
    assert skipped_runs([True, True]) == {"skipped_steps": 2, "leading_skipped_steps": 2, "trailing_skipped_steps": 2,
                                          "longest_skipped_run": 2}
    assert skipped_runs([False])["longest_skipped_run"] == 0
