"""TRL-style batched reward functions and the group hook (rl/env/groups.py): how they are called, how their
values combine (weights, None), how their failures are counted, and runs scored by them."""

import json
import logging
import math

import pytest

from rl.config import ConfigError, DataConfig, RewardConfig, config_from_dict
from rl.env.groups import score_group
from rl.env.reward import RewardInput, RewardPool, TrainerState, function_names, metrics, reduce_metrics
from tests import reward_fns


def inputs_of(rows, n=2, responses=None, chat=False):
    """n inputs per row, one group per row; a row is its columns, its prompt under "prompt"."""
    out = []
    for g, row in enumerate(rows):
        columns = {k: v for k, v in row.items() if k != "prompt"}
        raw = [{"role": "user", "content": row["prompt"]}] if chat else row["prompt"]
        for k in range(n):
            response = responses[g * n + k] if responses else f"answer {g}{'9' * k}"
            out.append(RewardInput(row["prompt"], response, row.get("answer"), len(response), 100, {}, raw, columns,
                                   list(range(len(response))), g))
    return out


def test_batched_functions_are_called_as_trl_calls_them():
    reward_fns.CALLS.clear()
    rows = [{"prompt": "1 + 1?", "answer": "2", "source": "a"}]
    for chat in (False, True):
        scored = score_group(inputs_of(rows, responses=["2", "no"], chat=chat),
                             RewardConfig(functions=["tests.reward_fns:record"]))
        assert [s["functions"]["record"] for s in scored] == [1.0, 2.0]  # one per completion, by its token ids
        assert [s["correct"] for s in scored] == [1.0, 2.0]
    text, chat = reward_fns.CALLS
    for call in (text, chat):  # TRL's helpers, as TRL passes them to every function
        assert call.pop("trainer_state") == TrainerState() and callable(call.pop("log_metric"))
        assert callable(call.pop("log_extra"))
    assert text == {"prompts": ["1 + 1?"] * 2, "completions": ["2", "no"], "completion_ids": [[0], [0, 1]],
                    "answer": ["2", "2"], "source": ["a", "a"]}
    # Chat-format prompts: the prompts as the rows hold them, each completion one assistant message.
    assert chat["prompts"] == [[{"role": "user", "content": "1 + 1?"}]] * 2
    assert chat["completions"] == [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "no"}]]


def test_weights_sum_the_functions_and_none_is_left_out_as_trl_leaves_it(caplog):
    cfg = RewardConfig(functions=["tests.reward_fns:from_column", "tests.reward_fns:record"],
                       function_weights=[2.0, 0.5], format_weight=1.0, format_pattern="9")
    rows = [{"prompt": "p", "score": 1.0}, {"prompt": "q", "score": None}]
    inputs = inputs_of(rows, n=2, responses=["a", "a9", "bb", "bb9"])
    scored = [t for g in (inputs[:2], inputs[2:]) for t in score_group(g, cfg)]
    # correct = 2.0 * score + 0.5 * len(ids); None adds nothing; format adds its own weighted term
    assert [s["correct"] for s in scored] == [2.5, 3.0, 1.0, 1.5]
    assert [s["reward"] for s in scored] == [2.5, 4.0, 1.0, 2.5]
    assert [s["functions"]["from_column"] for s in scored] == [1.0, 1.0, None, None]

    with RewardPool(RewardConfig(functions=["tests.reward_fns:from_column"], num_workers=1)) as pool:
        with caplog.at_level(logging.WARNING, logger="rl.env.reward"):
            result = pool.score(inputs)
    # No function scored inputs 2 and 3 and no other term weighs: no reward at all (NaN), as TRL's NaN row.
    assert result.rewards[:2] == [1.0, 1.0] and all(math.isnan(r) for r in result.rewards[2:])
    assert result.terms["from_column"] == [1.0, 1.0, None, None] and result.terms["correct"][2:] == [0.0, 0.0]
    assert (result.num_errors, result.num_timeouts, result.num_unscored) == (0, 0, 2)
    assert ("every reward function returned None for 2 input(s) (inputs [2, 3]), left out of their groups' "
            "statistics with advantage 0") in caplog.text
    stats = metrics(result)
    assert stats["reward/from_column_mean"] == 1.0 and stats["reward/num_unscored"] == 2.0  # None left out
    # A rank on which a function passed on every input has no mean; the ranks that have one are averaged.
    other = {"reward/num_inputs": 2.0, "reward/num_errors": 0.0, "reward/num_timeouts": 0.0,
             "reward/num_unscored": 2.0}
    reduced = reduce_metrics([other, stats])
    assert reduced["reward/from_column_mean"] == 1.0 and reduced["reward/num_unscored"] == 4.0


def test_each_function_is_logged_under_its_own_name():
    cfg = RewardConfig(functions=["a.b:accuracy", "c:reward", "d:format", "e:score", "f:score"], group_fn="g:judge")
    assert function_names(cfg) == ["accuracy", "reward", "d.format", "e.score", "f.score", "judge"]


def test_a_batched_function_that_raises_hangs_or_miscounts_costs_its_group_and_is_counted(caplog):
    cfg = RewardConfig(functions=["tests.reward_fns:batched_by_kind"], num_workers=2, timeout_s=1.0)
    rows = [{"prompt": "p", "kind": kind} for kind in ("ok", "raise", "hang", "short", "ok")]
    inputs = inputs_of(rows, n=2, responses=["1", "a1", "2", "3", "4", "5", "6", "7", "89", "x"])
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="rl.env.reward"):
        result = pool.score(inputs)
        assert result.rewards == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert (result.num_errors, result.num_timeouts) == (4, 2)  # raise, short; hang: whole groups
        assert pool.score(inputs[:2]).rewards == [1.0, 0.5]  # the hung worker was replaced
    log = caplog.text
    # The function that raised is named (its config key and path) beside its error.
    assert ("2 input(s) scored 0.0 after ZeroDivisionError: bad batch of 2 (in reward.functions "
            "tests.reward_fns:batched_by_kind) (inputs [2, 3])") in log
    assert "returned 1 values for 2 completions (inputs [6, 7])" in log
    assert ("2 input(s) scored 0.0 after exceeding reward.timeout_s=1 s (inputs [4, 5]); their workers were killed "
            "and replaced (scored by reward.functions='tests.reward_fns:batched_by_kind')") in log


def test_the_group_hook_is_called_once_per_group_with_the_rows_values():
    cfg = RewardConfig(group_fn="tests.reward_fns:longest_in_group", group_weight=3.0, num_workers=2)
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}]
    inputs = inputs_of(rows, n=3, responses=["a", "bbb", "cc", "dd", "ee", "f"])
    with RewardPool(cfg) as pool:
        result = pool.score(inputs)
    assert (result.num_errors, result.num_timeouts) == (0, 0)
    assert result.terms["longest_in_group"] == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert result.rewards == [0.0, 3.0, 0.0, 3.0, 3.0, 0.0]


@pytest.mark.parametrize("reward, data, error", [
    ({"functions": ["m:f"], "function_weights": [1.0, 2.0]}, {}, "reward.function_weights has 2 weights for 1"),
    ({"functions": ["m:f"], "user_fn": "m:g"}, {}, "reward.user_fn and reward.functions / reward.group_fn"),
    ({"functions": ["m.f"]}, {}, "reward.functions must name 'pkg.module:function', got 'm.f'"),
    ({"group_fn": "m"}, {}, "reward.group_fn must name 'pkg.module:function'"),
    ({"functions": ["m:f", "m:f"]}, {}, "reward.functions names a function twice"),
    ({}, {"answer_key": ""}, "data.answer_key='' leaves the default reward (math-verify against the answer)"),
])
def test_bad_reward_function_keys_are_one_line(reward, data, error):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl", **data}, "reward": reward})
    assert error in str(info.value) and "\n" not in str(info.value)


def test_a_function_that_cannot_be_imported_fails_at_construction_naming_its_key():
    with pytest.raises(ConfigError, match=r"^reward.functions='tests.reward_fns:nothing': module 'tests.reward_fns' "
                                          r"has no function 'nothing'"):
        RewardPool(RewardConfig(functions=["tests.trl_rewards:reward", "tests.reward_fns:nothing"]))
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl", "answer_key": ""},
                            "reward": {"functions": ["tests.trl_rewards:reward"]}})
    assert cfg.data == DataConfig(source="d.jsonl", answer_key="")


# ---------------------------------------------------------------------------- runs


def chat_rows(n):
    """A conversational dataset as TRL's are: `prompt` a list of messages, with a per-row system prompt."""
    rows = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b),
                     "system": "Answer with a number." if i % 2 else None, "kind": "ok"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_chat_dataset_drives_a_two_rank_run_scored_by_trl_style_functions(tmp_path):
    from tests.test_faults import run, strict_rows
    from tests.tiny import save_tiny_model_dir

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    proc = run((save_tiny_model_dir(tmp_path / "model"), data), tmp_path / "run", "--reward.user_fn=",
               "--data.prompt_key=prompt", "--data.system_prompt_key=system",
               "--reward.functions=['tests.trl_rewards:reward', 'tests.trl_rewards:answer_in_completion']",
               "--reward.function_weights=[1.0, 0.5]", "--log.sample_interval=1", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = strict_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r["reward/num_errors"] == r["reward/num_timeouts"] == 0 for r in rows)
    assert all(r["reward/num_inputs"] == 32 and r["reward/num_unscored"] == 0 for r in rows)
    assert {"reward/reward_mean", "reward/answer_in_completion_mean"} <= set(rows[0])
    assert any(r["rollout/reward_mean"] > 0 for r in rows)
    samples = [json.loads(line) for f in sorted((tmp_path / "run").glob("samples/rollout_*.jsonl"))
               for line in f.read_text().splitlines()]
    assert len(samples) == 64
    # The chat template ran on the messages, with the row's own system prompt where it has one.
    assert all(s["prompt"].startswith("<|im_start|>") for s in samples)
    assert any("<|im_start|>system\nAnswer with a number.<|im_end|>" in s["prompt"] for s in samples)


def test_a_batched_scorer_that_raises_or_hangs_is_counted_and_the_run_goes_on(tmp_path):
    from tests.test_faults import run, strict_rows
    from tests.tiny import save_tiny_model_dir

    rows = chat_rows(16)
    for i, row in enumerate(rows):
        row["kind"] = ("raise", "hang", "ok", "ok")[i % 4]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    proc = run((save_tiny_model_dir(tmp_path / "model"), data), tmp_path / "run", "--reward.user_fn=",
               "--data.prompt_key=prompt", "--reward.functions=['tests.reward_fns:batched_by_kind']",
               "--reward.timeout_s=2", "--data.shuffle=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = strict_rows(tmp_path / "run")
    # Each rollout draws 8 prompts of 4 samples, in file order: 2 raising and 2 hanging groups per rollout.
    assert [(r["reward/num_errors"], r["reward/num_timeouts"]) for r in rows] == [(8, 8), (8, 8)]
    assert [r["weight_version"] for r in rows] == [2, 3]  # each step trained on the groups that scored
