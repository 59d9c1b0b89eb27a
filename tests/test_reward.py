import importlib.util
import logging
import os
import pickle
import re
import subprocess
import sys
import time
import types
from fractions import Fraction

import numpy as np
import pytest
import torch

from rl.config import ConfigError, RewardConfig
from rl.env.answers import extract_answer, format_score, length_penalty, math_correct
from rl.env.reward import OUTPUT_LIMIT_BYTES, RewardInput, RewardPool, RewardResult, metrics, reduce_metrics, score_one
from rl.run.health import RunStopped


def make_input(response, label, kind="good", length=10, max_new_tokens=1000):
    return RewardInput(prompt="q", response=response, label=label, response_length=length,
                       max_new_tokens=max_new_tokens, metadata={"kind": kind})


# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed{3} and then \boxed{4", "3"),  # truncated last box: the last closed one wins
    ("she pays 3 + 4 = 7\n#### 7", "7"),
    ("#### 1,234.", "1234"),
    ("#### 5 then 99", "5 then 99"),
    ("The answer is 42.", "42"),
    ("costs 1,234,567 dollars", "1234567"),
    ("x = -3.5 at the end", "-3.5"),
    ("3-5 is not negative", "5"),
    ("first 12, then 1,2,3", "3"),
    ("value .5", ".5"),
    ("no digits here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------------------- terms


@pytest.mark.parametrize("response, label, expected", [
    (r"\boxed{12}", "12", 1.0),
    (r"\boxed{12.0}", "12", 1.0),
    ("the answer is 12.0", 12, 1.0),
    (r"\boxed{$12$}", "12", 1.0),
    ("#### 12", "$12$", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", 0.5, 1.0),
    ("total: 1,234", "1234", 1.0),
    (r"\boxed{x^2+1}", "1+x^2", 1.0),
    (r"\boxed{13}", "12", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    ("no answer", "12", 0.0),
    (r"\boxed{yes}", "yes", 1.0),
    (r"\boxed{}", "12", 0.0),
    # labels that are whole solutions: GSM8K's end in "#### <answer>", MATH's box theirs
    (r"\boxed{1,240}", "She pays 3 * 400 = 1,200 and 40 more.\n#### 1,240", 1.0),
    (r"\boxed{1200}", "She pays 3 * 400 = 1,200 and 40 more.\n#### 1,240", 0.0),
    (r"so \boxed{\frac{3}{4}}", r"Divide: $\frac{6}{8} = \boxed{\frac{3}{4}}$.", 1.0),
    (r"so \boxed{6}", r"Divide: $\frac{6}{8} = \boxed{\frac{3}{4}}$.", 0.0),
])
def test_math_correct(response, label, expected):
    assert math_correct(response, label) == expected


def test_format_score():
    assert format_score("think... \\boxed{3}", RewardConfig().format_pattern) == 1.0
    assert format_score("3", RewardConfig().format_pattern) == 0.0
    assert format_score("<think>a\nb</think> 3", r"<think>.*</think>") == 1.0  # DOTALL spans lines


@pytest.mark.parametrize("length, max_new_tokens, buffer, expected", [
    (50, 100, 20, 0.0),
    (80, 100, 20, 0.0),
    (85, 100, 20, -0.25),
    (90, 100, 20, -0.5),
    (99, 100, 20, -0.95),
    (100, 100, 20, -1.0),
    (130, 100, 20, -1.0),
    (99, 100, 0, 0.0),
    (100, 100, 0, -1.0),
])
def test_length_penalty(length, max_new_tokens, buffer, expected):
    assert length_penalty(length, max_new_tokens, buffer) == pytest.approx(expected)


def test_score_one_weighted_sum():
    cfg = RewardConfig(correct_weight=1.0, format_weight=0.5, length_penalty_weight=2.0, length_penalty_buffer=20)
    terms = score_one(make_input(r"\boxed{12}", 12, length=90, max_new_tokens=100), cfg)
    # 1.0 * 1 + 0.5 * 1 + 2.0 * -0.5
    assert terms == {"correct": 1.0, "format": 1.0, "length": -0.5, "reward": pytest.approx(0.5)}
    terms = score_one(make_input("12", 13, length=10), cfg)
    assert terms == {"correct": 0.0, "format": 0.0, "length": 0.0, "reward": 0.0}


def test_score_one_user_fn_replaces_math():
    cfg = RewardConfig(user_fn="tests.reward_fns:exact", format_weight=1.0)
    assert score_one(make_input("abc", "abc"), cfg) == {"correct": 1.0, "format": 0.0, "length": 0.0, "reward": 1.0}
    assert score_one(make_input(r"\boxed{1}", "1"), cfg)["correct"] == 0.0  # no math extraction
    with pytest.raises(TypeError, match="returned NoneType"):
        score_one(make_input("a", "a", kind="none"), RewardConfig(user_fn="tests.reward_fns:by_kind"))


@pytest.mark.parametrize("value, expected", [
    (True, 1.0), (np.bool_(True), 1.0), (np.bool_(False), 0.0), (np.float32(0.5), 0.5), (np.int64(1), 1.0),
    (np.array(0.25), 0.25), (torch.tensor(0.75), 0.75), (torch.tensor(True), 1.0), (Fraction(1, 4), 0.25),
])
def test_user_fn_may_return_any_real_number(value, expected):
    cfg = RewardConfig(user_fn="tests.reward_fns:value_of")
    inp = RewardInput(prompt="q", response="a", label="a", response_length=1, max_new_tokens=10,
                      metadata={"value": value})
    correct = score_one(inp, cfg)["correct"]
    assert correct == expected and type(correct) is float


@pytest.mark.parametrize("value, error", [
    ("1.0", "returned str '1.0', expected a float"), (np.array([0.5]), "returned ndarray array([0.5])"),
    (torch.tensor([0.5]), "returned Tensor tensor([0.5000])"), (np.str_("1"), "returned str_ np.str_('1')"),
    (1 + 2j, "returned complex"), (torch.tensor(float("nan")), "returned tensor(nan), expected a finite float"),
])
def test_user_fn_returning_no_real_number_is_refused(value, error):
    inp = RewardInput(prompt="q", response="a", label="a", response_length=1, max_new_tokens=10,
                      metadata={"value": value})
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        score_one(inp, RewardConfig(user_fn="tests.reward_fns:value_of"))


def test_reward_input_pickles():
    inp = make_input(r"\boxed{1}", 1)
    assert pickle.loads(pickle.dumps(inp)) == inp


# ---------------------------------------------------------------------------- pool


@pytest.mark.parametrize("path, fragment", [
    ("tests.no_such_module:fn", "cannot import module 'tests.no_such_module'"),
    ("tests.reward_fns:no_such_fn", "has no function 'no_such_fn'"),
    ("tests.reward_fns", "must look like 'pkg.module:function'"),
])
def test_bad_user_fn_fails_at_construction(path, fragment):
    with pytest.raises(ConfigError, match="reward.user_fn") as info:
        RewardPool(RewardConfig(user_fn=path))
    assert path in str(info.value) and fragment in str(info.value)


def test_pool_scores_math():
    cfg = RewardConfig(num_workers=2, format_weight=0.5)
    inputs = [make_input(r"\boxed{12}", "12"), make_input(r"\boxed{\frac12}", "0.5"),
              make_input("#### 7", 8), make_input("no answer", "1", length=1000)]
    with RewardPool(cfg) as pool:
        result = pool.score(inputs)
        assert pool.score([]).rewards == []
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(inputs)
    assert result.rewards == [1.5, 1.5, 0.0, 0.0]
    assert result.terms == {"correct": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0, 0.0],
                            "length": [0.0, 0.0, 0.0, -1.0]}
    assert (result.num_errors, result.num_timeouts) == (0, 0)
    assert metrics(result) == {"reward/correct_mean": 0.5, "reward/format_mean": 0.5, "reward/length_mean": -0.25,
                               "reward/num_inputs": 4.0, "reward/num_errors": 0.0, "reward/num_timeouts": 0.0}


def test_reward_function_that_raises_or_hangs_yields_zero_and_a_count(caplog):
    cfg = RewardConfig(user_fn="tests.reward_fns:by_kind", num_workers=2, timeout_s=1.0)
    kinds = ["good", "raise", "hang", "good", "die", "none", "good", "good"]
    inputs = [make_input("a", "a" if i % 2 == 0 else "b", kind=kind) for i, kind in enumerate(kinds)]
    with RewardPool(cfg) as pool:
        pool.score([make_input("a", "a")])  # workers started, so the timing below is the batch alone
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rl.env.reward"):
            result = pool.score(inputs)
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert result.terms["correct"] == result.rewards
        assert (result.num_errors, result.num_timeouts) == (3, 1)  # raise, die, none; hang
        assert elapsed < cfg.timeout_s + 5, f"batch took {elapsed:.1f} s"
        log = caplog.text
        assert "ZeroDivisionError: bad input 'a'" in log and "WorkerDied" in log and "NoneType" in log
        assert "reward.timeout_s=1" in log

        again = pool.score([make_input("a", "a"), make_input("a", "b")])  # killed worker was replaced
        assert again.rewards == [1.0, 0.0]
        assert (again.num_errors, again.num_timeouts) == (0, 0)
        assert all(w.process.poll() is None for w in pool.workers)
        workers = pool.workers
    assert all(w.process.poll() is not None for w in workers)


def test_workers_import_nothing_of_the_trainer(monkeypatch, caplog):
    # The trainer runs as `torchrun -m rl.main`: a multiprocessing spawn would re-import that main
    # module in every worker, and with it torch and transformers.
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec("rl.main")
    main.__file__ = main.__spec__.origin
    monkeypatch.setitem(sys.modules, "__main__", main)
    with (RewardPool(RewardConfig(user_fn="tests.reward_fns:trainer_modules", num_workers=1)) as pool,
          caplog.at_level(logging.WARNING, logger="rl.env.reward")):
        result = pool.score([make_input("a", "a")])
    assert result.rewards == [1.0], caplog.text


def test_input_past_the_memory_limit_scores_zero_and_is_counted(caplog):
    cfg = RewardConfig(user_fn="tests.reward_fns:allocate", num_workers=1, memory_limit_mb=256)
    sizes_mb = [1, 1024, 1, 1024, 1, 1024, 1]
    inputs = [make_input("a", "a", kind=f"{mb} MB") for mb in sizes_mb]
    for inp, mb in zip(inputs, sizes_mb):
        inp.metadata["mb"] = mb
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="rl.env.reward"):
        result = pool.score(inputs)
    # each input after a MemoryError runs in a fresh worker, never in the one that is exiting
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0], caplog.text
    assert (result.num_errors, result.num_timeouts) == (3, 0)
    assert "3 input(s) scored 0.0 after MemoryError: past reward.memory_limit_mb=256" in caplog.text


def test_a_too_small_memory_limit_stops_at_start_naming_the_key():
    with (pytest.raises(RunStopped, match=r"reward worker could not start \(reward.memory_limit_mb=30"),
          RewardPool(RewardConfig(num_workers=1, memory_limit_mb=30)) as pool):
        pool.score([make_input(r"\boxed{1}", "1")])


def test_a_worker_not_ready_within_start_timeout_stops_the_run():
    with (pytest.raises(RunStopped, match=r"did not start within reward.start_timeout_s=0.001 s"),
          RewardPool(RewardConfig(num_workers=1, start_timeout_s=0.001)) as pool):
        pool.score([make_input(r"\boxed{1}", "1")])


def test_what_workers_print_is_captured_and_capped(capfd, caplog):
    # 3 x 2000 lines on stdout and stderr, ~200 KB: past a pipe's 64 KB, so the pool must keep reading.
    cfg = RewardConfig(user_fn="tests.reward_fns:chatty", num_workers=2)
    inputs = [make_input(r, "a") for r in ("a", "b", "c")]
    for inp in inputs:
        inp.metadata["lines"] = 2000
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="rl.env.reward"):
        result = pool.score(inputs)
    assert result.rewards == [1.0, 0.0, 0.0]
    assert (result.num_errors, result.num_timeouts) == (0, 0)
    out, err = capfd.readouterr()
    assert "chatty" not in out and "chatty" not in err  # nothing reached the trainer's stdout or stderr
    printed = [r.getMessage() for r in caplog.records if "workers printed" in r.getMessage()]
    assert len(printed) == 1 and len(printed[0]) < OUTPUT_LIMIT_BYTES + 500
    assert "[input 0] chatty a stdout 0" in printed[0] or "[input 1] chatty b stdout 0" in printed[0]
    total = sum(len(f"chatty {r} stdout {i}\n") + len(f"chatty {r} stderr {i}\n") for r in "abc" for i in range(2000))
    total += sum(len(f"chatty {r} fd1\n") for r in "abc")
    assert f"workers printed {total} bytes" in printed[0]


def test_a_hung_worker_dies_with_the_trainer():
    parent = subprocess.run([sys.executable, "-c", """
import os, time
from rl.config import RewardConfig
from rl.env.reward import RewardInput, RewardPool
pool = RewardPool(RewardConfig(user_fn="tests.reward_fns:by_kind", num_workers=1, timeout_s=1000))
pool.score([RewardInput("q", "a", "a", 1, 10)])
worker = pool.workers[0]
worker.conn.send((0, [RewardInput("q", "a", "a", 1, 10, {"kind": "hang"})]))
print(worker.process.pid, flush=True)
os._exit(0)  # as a killed trainer: no close()
"""], check=True, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    pid = int(parent.stdout)
    try:
        for _ in range(300):
            if not worker_running(pid):
                break
            time.sleep(0.1)
        assert not worker_running(pid)
    finally:
        if worker_running(pid):
            os.kill(pid, 9)


def worker_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def all_failed(stats: dict[str, float]) -> bool:
    """On `metrics` or `reduce_metrics` output: inputs were scored and every one failed, so the step's rewards
    are all 0.0 and carry no signal."""
    failed = stats["reward/num_errors"] + stats["reward/num_timeouts"]
    return stats["reward/num_inputs"] > 0 and failed == stats["reward/num_inputs"]


def test_all_failed():
    def result(n, errors, timeouts):
        terms = {key: [0.0] * n for key in ("correct", "format", "length")}
        return all_failed(metrics(RewardResult([0.0] * n, terms, num_errors=errors, num_timeouts=timeouts)))

    assert result(4, 3, 1) and result(2, 2, 0) and result(2, 0, 2)
    assert not result(4, 3, 0)
    assert not result(0, 0, 0)  # nothing scored is not a failed step

    def stats(n, errors, timeouts):
        return {"reward/num_inputs": n, "reward/num_errors": errors, "reward/num_timeouts": timeouts}

    # two ranks, 4 + 1 scored: 3 + 1 failed -> one succeeded; 4 + 1 failed -> all failed
    assert not all_failed(reduce_metrics([stats(4, 2, 1), stats(1, 1, 0)]))
    assert all_failed(reduce_metrics([stats(4, 3, 1), stats(1, 0, 1)]))
    assert all_failed(reduce_metrics([stats(4, 3, 1), stats(0, 0, 0)]))
    assert not all_failed(reduce_metrics([stats(0, 0, 0), stats(0, 0, 0)]))


def test_a_run_whose_first_scored_step_fails_every_reward_stops_there():
    from rl.run.health import Health

    health = Health(max_bad_steps=3, max_failed_steps=3, vocab_size=100)
    health.after_rewards(scored=0, failed=0)  # nothing scored (trained on groups scored before): no verdict
    with pytest.raises(RunStopped, match=r"^reward: every reward of the run's first scored step failed \(8 of 8\), so "
                                         r"the reward function is broken rather than flaky: the reward warnings above "
                                         r"name the function that failed and its error$"):
        health.after_rewards(scored=8, failed=8)
    # Once a reward has scored, a failing step is a flaky one: reward.max_failed_steps in a row stop the run.
    flaky = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    flaky.after_rewards(scored=8, failed=3)
    flaky.after_rewards(scored=8, failed=8)
    resumed = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    resumed.load_state_dict(flaky.state_dict())
    with pytest.raises(RunStopped, match="every reward failed in 2 steps in a row"):
        resumed.after_rewards(scored=8, failed=8)
    # A checkpoint written before the run kept `ever_scored` trained on rewards: not a first step.
    old = {k: v for k, v in Health(3, 2, 100).state_dict().items() if k != "ever_scored"}
    resumed = Health(max_bad_steps=3, max_failed_steps=2, vocab_size=100)
    resumed.load_state_dict(old)
    resumed.after_rewards(scored=8, failed=8)
