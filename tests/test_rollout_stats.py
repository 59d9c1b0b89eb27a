"""RolloutStats (rl/rollout/stats.py): rounds add field by field, ranks combine as each field declares, and the
metrics come from the counters, against numbers worked out by hand."""

from rl.rollout.stats import RolloutStats


def test_rounds_add_every_field():
    a = RolloutStats(reward_stats=[{"reward/correct_mean": 1.0}], rollout_s=2.0, reward_s=0.5, env_s=1.0,
                     env_failures=1, tokens=10, decode_steps=4, prefill_tokens=7)
    b = RolloutStats(reward_stats=[{"reward/correct_mean": 0.0}], rollout_s=3.0, reward_s=0.25, env_s=0.5,
                     env_failures=2, tokens=5, decode_steps=1, prefill_tokens=3)
    total = a + b
    assert total == RolloutStats(reward_stats=[{"reward/correct_mean": 1.0}, {"reward/correct_mean": 0.0}],
                                 rollout_s=5.0, reward_s=0.75, env_s=1.5, env_failures=3, tokens=15,
                                 decode_steps=5, prefill_tokens=10)
    assert a.reward_stats == [{"reward/correct_mean": 1.0}]  # the operands stay as they were


def test_ranks_combine_as_each_field_says():
    # Two engines of two ranks each (tensor_parallel_size=2): an engine's ranks count its steps alike, only its
    # first rank scores, and each rank waits on its own environments.
    ranks = [RolloutStats(reward_stats=[{"reward/num_inputs": 4.0}], rollout_s=1.0, reward_s=0.1, env_s=0.5,
                          env_failures=1, tokens=8, resumed_tokens=2, decode_steps=6, decode_row_steps=18),
             RolloutStats(rollout_s=1.5, reward_s=0.0, env_s=0.25, env_failures=0, tokens=8, resumed_tokens=2,
                          decode_steps=6, decode_row_steps=18),
             RolloutStats(reward_stats=[{"reward/num_inputs": 2.0}], rollout_s=0.5, reward_s=0.3, env_s=0.75,
                          env_failures=2, tokens=4, resumed_tokens=0, decode_steps=3, decode_row_steps=6),
             RolloutStats(rollout_s=0.5, reward_s=0.0, env_s=0.0, env_failures=0, tokens=4, resumed_tokens=0,
                          decode_steps=3, decode_row_steps=6)]
    combined = RolloutStats.across_ranks(ranks, tensor_parallel_size=2)
    assert combined == RolloutStats(reward_stats=[{"reward/num_inputs": 4.0}, {"reward/num_inputs": 2.0}],
                                    rollout_s=1.5, reward_s=0.3, env_s=0.75, env_failures=3, tokens=12,
                                    resumed_tokens=2, decode_steps=9, decode_row_steps=24)


def test_metrics_from_the_counters():
    stats = RolloutStats(reward_stats=[{"reward/correct_mean": 1.0, "reward/num_inputs": 2.0}], rollout_s=2.0,
                         reward_s=0.5, env_s=1.0, env_failures=3, prompt_tokens=40, reused_tokens=10, tokens=100,
                         resumed_tokens=6, decode_steps=20, decode_row_steps=50, context_tokens=3000,
                         prefill_tokens=44)
    metrics = stats.metrics(num_engines=2, episodes=True, buffered=True)
    assert metrics == {"reward/correct_mean": 1.0, "reward/num_inputs": 2.0, "perf/rollout_s": 2.0,
                       "perf/reward_s": 0.5, "perf/rollout_tokens_per_s": 50.0, "rollout/tool_errors": 3.0,
                       "perf/env_s": 1.0, "rollout/resumed_tokens": 6.0, "rollout/decode_steps": 10.0,
                       "rollout/decode_rows_mean": 2.5, "rollout/context_mean": 30.0, "rollout/prefill_tokens": 44.0,
                       "rollout/prefill_tokens_reused_frac": 0.25}
    # Counters an engine does not keep log nothing; no environment or buffer, no metrics of theirs.
    assert RolloutStats(rollout_s=1.0, tokens=4).metrics(1, episodes=False, buffered=False) == {
        "perf/rollout_s": 1.0, "perf/reward_s": 0.0, "perf/rollout_tokens_per_s": 4.0}
