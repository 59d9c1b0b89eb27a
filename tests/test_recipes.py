"""The recipes in configs/recipes/: each loads and validates, sets what its name promises, and its reward reads
the answers of the data it names (generated offline, or a small folder laid out as its comments say)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from rl.config import load_config
from rl.data import load_prompts, read_source_rows
from rl.env.answers import math_correct
from tests.tiny import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs/recipes").glob("*.toml"))


def recipe(name):
    return load_config(["--config", str(ROOT / f"configs/recipes/{name}.toml")])


def test_every_recipe_loads_validates_and_is_in_the_readme():
    assert {p.stem for p in RECIPES} == {"gsm8k_boxed", "math_verify", "dapo", "dr_grpo", "code_tests"}
    readme = (ROOT / "README.md").read_text()
    for path in RECIPES:
        cfg = load_config(["--config", str(path)])
        assert cfg.model.path and cfg.data.source and cfg.log.output_dir == f"runs/{path.stem}"
        text = path.read_text()  # the figure it reached here, or that it has none yet
        assert "Not yet measured here" in text or re.search(r"Measured on one H200 .* -> ", text, re.DOTALL)
        assert f"configs/recipes/{path.name}" in readme


def test_each_recipe_sets_what_its_name_promises():
    dapo = recipe("dapo")
    assert dapo.rollout.dynamic_filter == "nonzero_std" and dapo.rollout.over_sampling_batch_size > 64
    assert dapo.algo.eps_clip_high > dapo.algo.eps_clip and dapo.algo.loss_agg == "token_mean"
    assert dapo.reward.length_penalty_weight > 0 and dapo.algo.kl_coef == 0
    dr = recipe("dr_grpo")
    assert dr.algo.advantage_estimator == "dr_grpo" and dr.algo.loss_agg == "seq_mean_token_sum_norm"
    assert dr.algo.loss_agg_norm == dr.rollout.max_new_tokens
    for name in ("gsm8k_boxed", "math_verify"):
        cfg = recipe(name)
        assert "\\boxed{}" in cfg.data.prompt_template
        assert not (cfg.reward.user_fn or cfg.reward.functions or cfg.reward.group_fn)  # math-verify


@pytest.mark.parametrize("name", ["gsm8k_boxed", "dr_grpo"])
def test_the_offline_recipes_generate_prompts_their_reward_can_check(name):
    pytest.importorskip("reasoning_gym")
    cfg = recipe(name)
    for data in (dataclasses.replace(cfg.data, num_examples=4),
                 dataclasses.replace(cfg.data, source=cfg.eval.source, seed=cfg.eval.seed, num_examples=4)):
        rows, prompt_key, answer_key = read_source_rows(data)
        assert all(math_correct(f"so \\boxed{{{row[answer_key]}}}", row[answer_key]) == 1.0 for row in rows)
        assert all("\\boxed{}" in data.prompt_template.replace("{prompt}", row[prompt_key]) for row in rows)


def write_parquet_folder(folder, rows):
    datasets = pytest.importorskip("datasets")
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(folder / "data/train-00000-of-00001.parquet")
    return folder


def test_the_folder_recipes_read_the_columns_their_comments_describe(tmp_path):
    math = write_parquet_folder(tmp_path / "math", [
        {"problem": "Simplify 6/8.", "solution": "Divide by 2: $\\frac{6}{8} = \\boxed{\\frac{3}{4}}$.", "level": "1"}])
    verl = write_parquet_folder(tmp_path / "dapo", [
        {"prompt": [{"role": "user", "content": "What is 2 + 3?\nAnswer: <n>"}], "data_source": "math",
         "reward_model": {"ground_truth": "5", "style": "rule"}}])
    for name, folder, response in (("math_verify", math, "so \\boxed{0.75}"), ("dapo", verl, "Answer: 5")):
        data = dataclasses.replace(recipe(name).data, source=str(folder))
        (prompt,) = load_prompts(data, tiny_tokenizer())[0]
        assert math_correct(response, prompt.label) == 1.0, (name, prompt.label)
        assert json.dumps(prompt.columns)  # the row's other columns ride along for reward functions


def test_the_readme_path_from_rows_and_a_reward_function_to_a_run_holds_together(tmp_path, monkeypatch):
    import re
    import sys

    from rl.data import expand_groups
    from rl.env.groups import score_group
    from rl.env.reward import RewardInput

    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Your own data and reward")
    section = readme[start:readme.index("\n## ", start)]
    (row_json, reward_py, run_toml) = [body for _, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S)[:3]]
    (tmp_path / "data").mkdir()
    (tmp_path / "data/my_rows.jsonl").write_text(json.dumps(json.loads(row_json)) + "\n")
    (tmp_path / "my_rewards.py").write_text(reward_py)
    (tmp_path / "my_run.toml").write_text(run_toml)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    cfg = load_config(["--config", "my_run.toml"])
    (prompt,) = load_prompts(cfg.data, tiny_tokenizer())[0]
    assert "Be brief." in prompt.text  # the row's system prompt
    samples = expand_groups([prompt], 2, 0, 0)[0]
    inputs = [RewardInput(s.prompt, response, s.label, 2, 8, s.metadata, s.raw_prompt, s.columns, [1, 2], 0)
              for s, response in zip(samples, [prompt.columns["answer"], "no idea"])]
    assert [t["reward"] for t in score_group(inputs, cfg.reward)] == [1.0, 0.0]


def test_the_code_recipe_reads_the_built_rows_and_runs_their_tests_inside_the_workers_limits(tmp_path):
    import gzip

    from rl.env.code_reward import MEMORY_MB, TIMEOUT_S
    from rl.env.code_tasks import main as build
    from rl.env.code_tasks import reference_response
    from rl.env.reward import RewardInput, score_one
    from tests.test_code_reward import fake_humaneval

    cfg = recipe("code_tests")
    assert cfg.reward.user_fn == "rl.env.code_reward:all_tests_pass" and cfg.data.answer_key == ""
    # The sandbox's limits sit inside the worker's: a hang scores 0 in the sandbox before the worker is killed
    # (a few seconds for the interpreter to start), and the program's memory fits in the worker's.
    assert cfg.reward.timeout_s >= TIMEOUT_S + 5 and cfg.reward.memory_limit_mb > MEMORY_MB
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(p) + "\n" for p in
                                                                      fake_humaneval()).encode()))
    build(["--out", str(tmp_path / "code"), "--from", str(tmp_path / "HumanEval.jsonl.gz")])
    data = dataclasses.replace(cfg.data, source=str(tmp_path / "code"))
    held_out = dataclasses.replace(data, split=cfg.eval.split)
    assert cfg.eval.source == cfg.data.source and cfg.eval.split == "test"
    prompts = load_prompts(data, tiny_tokenizer())[0] + load_prompts(held_out, tiny_tokenizer())[0]
    assert len(prompts) == 8
    for prompt, problem in zip(sorted(prompts, key=lambda p: int(p.columns["task_id"].split("/")[1])),
                               fake_humaneval()):
        inp = RewardInput(prompt.text, reference_response(problem), prompt.label, 10, cfg.rollout.max_new_tokens,
                          prompt.metadata)
        assert score_one(inp, cfg.reward)["reward"] == 1.0


def test_the_gemma_addition_config_holds_out_sums_its_reward_checks():
    """configs/gemma3_270m.toml (docs/engines.md#gemma-3-270m-learns): 600 two-digit plus one-digit sums to train on
    and the other 210 held out, each row's answer the sum its prompt asks for, scored right and wrong as the model
    writes it (the sum and its newline)."""
    from rl.rollout.evaluate import load_eval_prompts

    cfg = load_config(["--config", str(ROOT / "configs/gemma3_270m.toml")])
    tokenizer = tiny_tokenizer()
    training, dropped = load_prompts(cfg.data, tokenizer)
    held_out, overlapping = load_eval_prompts(cfg.eval, cfg.data, tokenizer, training)
    assert (len(training), dropped, len(held_out), overlapping) == (600, 0, 210, 0)
    asked = set()
    for p in training + held_out:
        a, b = re.fullmatch(r"(\d\d) \+ (\d) = ", p.text.rsplit("\n", 1)[1]).groups()
        assert p.label == str(int(a) + int(b))
        asked.add((a, b))
    assert len(asked) == 810  # every such sum once
    assert math_correct(f"{training[0].label}\n", training[0].label) == 1.0
    assert math_correct(f"{int(training[0].label) - 2}\n", training[0].label) == 0.0
