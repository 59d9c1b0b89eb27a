"""The metrics file stays valid JSON Lines through NaN, a full disk, a crash mid-row and a resume; health bands."""

import errno
import json
import os
import sys
import types

import pytest

from rl.run.health import Health, RunStopped
from rl.run.metrics import MetricsLogger


def logger(tmp_path, start=0):
    return MetricsLogger(str(tmp_path), {}, use_wandb=False, project="", run_name="", start_rollout=start)


def lines(tmp_path):
    return (tmp_path / "metrics.jsonl").read_text().splitlines()


def test_non_finite_values_are_null(tmp_path):
    logger(tmp_path).log({"rollout_id": 0, "train/loss": float("nan"), "train/grad_norm": float("inf"), "x": 1.5})
    assert json.loads(lines(tmp_path)[0], parse_constant=lambda c: pytest.fail(c)) == {
        "rollout_id": 0, "train/loss": None, "train/grad_norm": None, "x": 1.5}


def test_a_failed_write_leaves_no_partial_row_and_stops(tmp_path, monkeypatch):
    log = logger(tmp_path)
    log.log({"rollout_id": 0})

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)  # the row is in the page cache, the disk refuses it
    with pytest.raises(RunStopped, match="No space left on device"):
        log.log({"rollout_id": 1, "train/loss": 0.5})
    monkeypatch.undo()
    assert lines(tmp_path) == ['{"rollout_id": 0}']
    log.log({"rollout_id": 1})
    assert [json.loads(line)["rollout_id"] for line in lines(tmp_path)] == [0, 1]


def test_a_cut_off_last_line_is_dropped_on_open(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0}\n{"rollout_id": 1, "train/lo')
    logger(tmp_path, start=1).log({"rollout_id": 1})
    assert [json.loads(line)["rollout_id"] for line in lines(tmp_path)] == [0, 1]


def test_a_resume_drops_the_rows_past_its_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"rollout_id": i}) + "\n" for i in range(5)))
    logger(tmp_path, start=3).log({"rollout_id": 3, "again": True})
    assert [json.loads(line) for line in lines(tmp_path)] == [{"rollout_id": 0}, {"rollout_id": 1}, {"rollout_id": 2},
                                                              {"rollout_id": 3, "again": True}]


def row(skipped=0, trailing=0, entropy=2.0, grad_norm=1.0, zero_std=0.0, leading=None, longest=None, **more):
    return {"train/skipped_steps": skipped, "train/trailing_skipped_steps": trailing,
            "train/leading_skipped_steps": skipped if leading is None else leading,
            "train/longest_skipped_run": max(skipped, trailing) if longest is None else longest,
            "train/entropy": entropy, "train/grad_norm": grad_norm, "train/loss": 0.1,
            "rollout/zero_std_group_frac": zero_std, **more}


def test_skipped_steps_stop_the_run_when_in_a_row_across_rollouts():
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_train(row(skipped=1, trailing=1, leading=0), steps=2)  # the good step came first
    health.after_train(row(skipped=1, trailing=0), steps=2)  # then a good one ends the streak
    assert health.bad_steps == 0
    health.after_train(row(skipped=1, trailing=1), steps=2)
    health.after_train(row(skipped=1, trailing=1, entropy=float("nan")), steps=1)
    with pytest.raises(RunStopped, match="3 optimizer steps in a row"):
        health.after_train(row(skipped=1, trailing=1), steps=1)


def test_skipped_steps_in_a_row_inside_a_rollout_or_across_its_start_stop_the_run():
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    with pytest.raises(RunStopped, match="3 optimizer steps in a row"):  # good, bad, bad, bad, good
        health.after_train(row(skipped=3, trailing=0, leading=0, longest=3), steps=5)
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_train(row(skipped=2, trailing=2, leading=0, longest=2), steps=3)  # good, bad, bad
    with pytest.raises(RunStopped, match="3 optimizer steps in a row"):  # bad, good, good
        health.after_train(row(skipped=1, trailing=0, leading=1, longest=1), steps=3)


def test_the_seed_metric_table_bands_and_trends_warn(capsys):
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    for _ in range(11):
        health.after_train(row(**{"train/clip_frac": 0.6}), steps=1)
    out = capsys.readouterr().out
    assert "health warning: train/clip_frac = 0.6, expected <= 0.5: updates too aggressive" in out
    assert out.count("train/clip_frac") == 2 and "(11 rollouts in a row)" in out  # the first and every 10th
    assert health.metrics()["health/warnings"] == 11
    health.after_train(row(**{"perf/train_mfu": 0.12, "rollout/truncated_frac": 0.75, "train/kl_ref_seq": 64.0}),
                       steps=1)
    out = capsys.readouterr().out
    assert "perf/train_mfu = 0.12, expected >= 0.2" in out and "rollout/truncated_frac = 0.75" in out
    assert "train/kl_ref_seq = 64, expected <= 50: the policy drifts from the reference too fast" in out
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    for i, reward in enumerate([0.30, 0.31, 0.30, 0.32, 0.31, 0.33, 0.32, 0.34, 0.33, 0.35, 0.02]):
        length = 40.0 if i < 10 else 3.0  # the last rollout collapses too
        health.after_train(row(**{"rollout/reward_mean_all_scored": reward,
                                  "rollout/response_length_mean": length}), steps=1)
    out = capsys.readouterr().out
    assert out.count("health warning") == 2
    assert "rollout/reward_mean_all_scored = 0.02" in out and "training collapsing?" in out
    assert "rollout/response_length_mean = 3" in out and "collapsing" in out
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    for speed in [1000, 1010, 990, 1005, 480, 470, 460]:  # the last three all below half
        health.after_train(row(**{"perf/rollout_tokens_per_s": speed}), steps=1)
    out = capsys.readouterr().out
    assert out.count("health warning: perf/rollout_tokens_per_s") == 1


def test_a_reward_jump_is_judged_over_half_a_batch_of_scored_samples(capsys):
    """A partial rollout that ends after a few steps scores only the groups that finished in them (8 samples of a
    512-sample batch, on one H200): their mean alone is no reward jump; it is pooled with the next rollouts' until
    half a batch is scored, and the pool survives a checkpoint. Half a batch's samples with a jump is one."""
    def rollout(reward: float, scored: int) -> dict:
        return row(**{"rollout/reward_mean_all_scored": reward, "rollout/num_scored": float(scored)})

    steady = [0.20, 0.22, 0.19, 0.21, 0.20, 0.23, 0.21, 0.22, 0.20]
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100, rollout_samples=512)
    for reward in steady:
        health.after_train(rollout(reward, 512), steps=1)
    health.after_train(rollout(1.1, 8), steps=1)  # one group of 8, all right
    resumed = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100, rollout_samples=512)
    resumed.load_state_dict(health.state_dict())
    for run in (health, resumed):
        run.after_train(rollout(0.19, 512), steps=1)
        assert run.history["rollout/reward_mean_all_scored"][-2:] == [0.20, pytest.approx((8 * 1.1 + 512 * 0.19) / 520)]
    assert "health warning" not in capsys.readouterr().out
    health.after_train(rollout(1.1, 100), steps=1)
    assert "health warning" not in capsys.readouterr().out
    health.after_train(rollout(1.1, 200), steps=1)
    assert ("rollout/reward_mean_all_scored = 1.1, expected a change within 5 sigma" in (out := capsys.readouterr().out)
            and "(over the last 2 rollouts' scored samples)" in out)
    health.after_train(rollout(0.3, 512), steps=1)  # a whole batch: judged alone, the pool emptied
    assert health.history["rollout/reward_mean_all_scored"][-2:] == [1.1, 0.3]


def test_staleness_pinned_at_the_bound_or_many_dropped_warns(capsys):
    """The seed's staleness row: healthy below the bound; every trained sample at the bound for 3 rollouts in a
    row, or more than 20% of the groups dropped as too stale, is a warning."""
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100, max_staleness=2)
    for lag in [0.5, 2.0, 2.0, 1.5, 2.0, 2.0]:  # pinned twice in a row only
        health.after_train(row(**{"rollout/staleness_mean": lag, "rollout/dropped_stale_frac": 0.0}), steps=1)
    assert "health warning" not in capsys.readouterr().out
    health.after_train(row(**{"rollout/staleness_mean": 2.0, "rollout/dropped_stale_frac": 0.25}), steps=1)
    out = capsys.readouterr().out
    assert "rollout/staleness_mean = 2, expected < rollout.max_staleness = 2" in out
    assert "rollout/dropped_stale_frac = 0.25, expected <= 0.2: generation falls behind" in out
    synchronous = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    for _ in range(4):
        synchronous.after_train(row(**{"rollout/staleness_mean": 0.0}), steps=1)
    assert "health warning" not in capsys.readouterr().out


def test_the_first_train_phase_of_a_process_is_not_judged_on_speed(capsys):
    """The first rollout of a process (a fresh run's or a resumed one's) compiles and warms up: a low MFU then
    is no warning; the same value a rollout later is."""
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_train(row(**{"perf/train_mfu": 0.04, "rollout/truncated_frac": 0.75}), steps=1)
    out = capsys.readouterr().out
    assert "perf/train_mfu" not in out and "rollout/truncated_frac = 0.75" in out  # the other bands still hold
    health.after_train(row(**{"perf/train_mfu": 0.04}), steps=1)
    assert "perf/train_mfu = 0.04, expected >= 0.2" in capsys.readouterr().out
    resumed = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    resumed.load_state_dict(health.state_dict())
    resumed.after_train(row(**{"perf/train_mfu": 0.04}), steps=1)
    assert "perf/train_mfu" not in capsys.readouterr().out


def test_a_train_phase_with_little_to_train_is_not_judged_on_speed(capsys):
    """A rollout whose groups mostly scored all alike leaves a few thousand tokens to train (6k against a median
    of 55k on one H200), too few to keep the device busy: under half the recent median of tokens, its MFU is no
    warning. The median counts every rollout's tokens, the first one's too, which is not judged on speed."""
    def phase(tokens: int, mfu: float) -> dict:
        return row(**{"train/tokens": float(tokens), "perf/train_mfu": mfu})

    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    for _ in range(3):  # the first compiles and warms up
        health.after_train(phase(100_000, 0.35), steps=1)
    health.after_train(phase(30_000, 0.10), steps=1)
    assert "health warning" not in capsys.readouterr().out
    health.after_train(phase(60_000, 0.10), steps=1)
    assert "perf/train_mfu = 0.1, expected >= 0.2" in capsys.readouterr().out


def test_a_train_phase_that_compiled_is_not_judged_on_speed(capsys):
    """A later rollout whose train phase compiled a new kind of micro-batch (model.compile) is seconds slower
    once: no MFU warning then; the same MFU without compiling is one."""
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_train(row(**{"perf/train_mfu": 0.5}), steps=1)
    health.after_train(row(**{"perf/train_mfu": 0.08, "perf/train_graphs_compiled": 2}), steps=1)
    assert "perf/train_mfu" not in capsys.readouterr().out
    health.after_train(row(**{"perf/train_mfu": 0.08, "perf/train_graphs_compiled": 0}), steps=1)
    assert "perf/train_mfu = 0.08, expected >= 0.2" in capsys.readouterr().out


def test_failed_rewards_stop_the_run_only_in_a_row():
    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_rewards(scored=8, failed=7)  # the run's first step scored one: a flaky function, not a broken one
    health.after_rewards(scored=8, failed=8)
    health.after_rewards(scored=8, failed=7)
    health.after_rewards(scored=8, failed=8)
    with pytest.raises(RunStopped, match="every reward failed in 2 steps in a row"):
        health.after_rewards(scored=8, failed=8)


def test_health_bands_warn_and_count(capsys):
    import math

    health = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    health.after_train(row(entropy=2.0), steps=1)
    assert health.metrics()["health/warnings"] == 0
    health.after_train(row(entropy=math.log(100)), steps=1)  # uniform over the vocabulary
    health.after_train(row(entropy=1e-5), steps=1)  # collapsed onto single tokens
    health.after_train(row(grad_norm=0.0), steps=1)
    health.after_train(row(grad_norm=0.0, zero_std=1.0), steps=1)  # nothing to learn: not a fault
    health.after_train(row(grad_norm=0.0), steps=1)
    health.after_train(row(grad_norm=0.0), steps=1)
    out = capsys.readouterr().out
    assert "health warning: train/entropy = 4.605" in out and "health warning: train/entropy = 1e-05" in out
    assert out.count("health warning: train/grad_norm") == 1
    assert health.metrics()["health/warnings"] == 3
    restored = Health(3, 2, 100)
    restored.load_state_dict(json.loads(json.dumps(health.state_dict())))  # as a checkpoint keeps it
    assert restored.metrics() == health.metrics()


def test_zero_std_group_frac_counts_groups_of_equal_rewards_including_groups_of_one():
    from rl.data import Sample
    from rl.rollout.collect import rollout_metrics

    def samples(rewards):
        out = []
        for r in rewards:
            s = Sample(prompt="", tokens=[1, 2])
            s.append_response_tokens([3], [-0.5])
            s.reward = r
            out.append(s)
        return out

    assert rollout_metrics(samples([1.0, 0.0, 1.0]), 1)["rollout/zero_std_group_frac"] == 1.0  # std of one is NaN
    assert rollout_metrics(samples([1.0, 1.0, 0.0, 1.0]), 2)["rollout/zero_std_group_frac"] == 0.5


def test_a_write_the_disk_refuses_leaves_the_file_whole(tmp_path, monkeypatch):
    log = logger(tmp_path)
    log.log({"rollout_id": 0})
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(RunStopped, match="No space left on device"):
        log.log({"rollout_id": 1, "train/loss": 0.5})
    monkeypatch.undo()
    assert lines(tmp_path) == ['{"rollout_id": 0}']


def test_a_resumed_run_continues_the_folders_wandb_run(tmp_path, monkeypatch):
    """wandb is replaced by a recorder of `wandb.init`'s arguments that hands out a new id per run it starts."""
    calls = []

    class Run:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            self.id = kwargs.get("id") or f"run{len(calls)}"

        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run(**kwargs)))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for start in (0, 2):  # a run, then its resume into the same folder
        MetricsLogger(str(tmp_path), {}, use_wandb=True, project="p", run_name="", start_rollout=start).close()
    assert [(c.get("id"), c["resume"]) for c in calls] == [(None, "allow"), ("run1", "allow")]
    assert (tmp_path / "wandb_run_id").read_text().strip() == "run1"
