"""The column map: chat-format prompts, per-row system prompts, an optional or nested answer, and the columns
that reach the reward functions; with the length filter and the eval overlap check working on all of them."""

import json

import pytest

from rl.config import ConfigError, DataConfig, EvalConfig
from rl.data import EVAL_KEYS, expand_groups, load_prompts, read_source_rows
from rl.rollout.evaluate import load_eval_prompts
from tests.tiny import tiny_tokenizer


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(text):
    return [{"role": "user", "content": text}]


ROWS = [
    {"messages": chat("What is 1 + 2?"), "answer": "3", "system": "Be brief.", "level": 1},
    {"messages": chat("What is 2 + 2?"), "answer": "4", "system": None, "level": 2},
    {"messages": [{"role": "system", "content": "Own."}, *chat("What is 3 + 3?")], "answer": "6", "system": "Be brief.",
     "level": 3},
]


def load(tmp_path, rows=ROWS, **kw):
    cfg = DataConfig(source=str(jsonl(tmp_path / "d.jsonl", rows)), prompt_key="messages", shuffle=False, **kw)
    return load_prompts(cfg, tiny_tokenizer())


def test_chat_prompts_take_the_rows_system_prompt_and_hand_their_columns_on(tmp_path):
    prompts, dropped = load(tmp_path, system_prompt_key="system", system_prompt="Default.")
    assert dropped == 0
    assert [p.text for p in prompts] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
        # messages that open with their own system message keep it
        "<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\nWhat is 3 + 3?<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert prompts[0].raw == ROWS[0]["messages"] and prompts[0].label == "3"
    assert prompts[0].columns == {"answer": "3", "system": "Be brief.", "level": 1}  # all but the prompt
    assert prompts[0].metadata == {"system": "Be brief.", "level": 1}  # reward.user_fn's: nor the answer
    sample = expand_groups(prompts, 2, 0, 0)[0][1]
    assert (sample.raw_prompt, sample.columns) == (prompts[0].raw, prompts[0].columns)
    sample.columns["level"] = 9  # each sample owns its copy
    assert prompts[0].columns["level"] == 1


def test_a_text_prompt_takes_the_rows_system_prompt_too(tmp_path):
    rows = [{"q": "What is 1 + 2?", "answer": "3", "sys": "Be brief."}, {"q": "What is 2 + 2?", "answer": "4", "sys": ""}]
    cfg = DataConfig(source=str(jsonl(tmp_path / "d.jsonl", rows)), prompt_key="q", system_prompt_key="sys",
                     shuffle=False, apply_chat_template=False)
    assert [p.text for p in load_prompts(cfg, tiny_tokenizer())[0]] == ["Be brief.\nWhat is 1 + 2?", "What is 2 + 2?"]


def test_a_metadata_table_keeps_its_keys_at_the_top_of_user_fn_metadata(tmp_path):
    rows = [{"prompt": "What is 1 + 2?", "answer": "3", "metadata": {"task": "sum"}, "id": 7}]
    cfg = DataConfig(source=str(jsonl(tmp_path / "d.jsonl", rows)))
    (prompt,) = load_prompts(cfg, tiny_tokenizer())[0]
    assert prompt.metadata == {"task": "sum", "id": 7}
    assert prompt.columns == {"answer": "3", "metadata": {"task": "sum"}, "id": 7}


def test_no_answer_column_and_an_answer_inside_a_table(tmp_path):
    rows = [{"prompt": chat("What is 1 + 2?"), "reward_model": {"ground_truth": "3", "style": "rule"}}]
    cfg = DataConfig(source=str(jsonl(tmp_path / "v.jsonl", rows)), answer_key="")
    (prompt,) = load_prompts(cfg, tiny_tokenizer())[0]
    assert prompt.label is None and prompt.columns == {"reward_model": rows[0]["reward_model"]}
    cfg = DataConfig(source=str(tmp_path / "v.jsonl"), answer_key="reward_model.ground_truth")  # verl's layout
    assert load_prompts(cfg, tiny_tokenizer())[0][0].label == "3"
    with pytest.raises(ConfigError, match=r"v.jsonl:1: missing key 'reward_model.answer' \(data.answer_key\)"):
        read_source_rows(DataConfig(source=str(tmp_path / "v.jsonl"), answer_key="reward_model.answer"))


@pytest.mark.parametrize("system, error", [
    ("absent", r"d.jsonl:2: missing key 'system' \(data.system_prompt_key\); row keys: \['answer', 'messages'\]"),
    (["Be brief."], r"d.jsonl:2: 'system' \(data.system_prompt_key\) must be text or null, got list"),
])
def test_a_bad_system_prompt_column_names_the_key_and_row(tmp_path, system, error):
    rows = [dict(ROWS[0]), {"messages": chat("What is 2 + 2?"), "answer": "4"}]
    if system != "absent":
        rows[1]["system"] = system
    with pytest.raises(ConfigError, match=error):
        load(tmp_path, rows, system_prompt_key="system")
    with pytest.raises(ConfigError, match=r"\(data.system_prompt_key, read for eval.source\)"):
        read_source_rows(DataConfig(source=str(tmp_path / "d.jsonl"), prompt_key="messages",
                                    system_prompt_key="system"), EVAL_KEYS)


def test_chat_prompts_pass_the_length_filter_and_the_eval_overlap_check(tmp_path):
    long = {"messages": chat("What is 1 + 2? " * 40), "answer": "3"}
    training, dropped = load(tmp_path, [*ROWS, long], max_prompt_len=64)
    assert (len(training), dropped) == (3, 1)
    data = DataConfig(source=str(tmp_path / "d.jsonl"), prompt_key="messages", shuffle=False)
    evals = jsonl(tmp_path / "e.jsonl", [ROWS[1], {"messages": chat("What is 5 + 5?"), "answer": "10"}])
    held_out, overlapping = load_eval_prompts(EvalConfig(source=str(evals)), data, tiny_tokenizer(), training)
    assert overlapping == 1 and [p.label for p in held_out] == ["10"]


def test_chat_prompts_from_a_parquet_file_read_like_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{k: v for k, v in row.items() if k != "system"} for row in ROWS]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    from_parquet = load_prompts(DataConfig(source=str(tmp_path / "d.parquet"), prompt_key="messages", shuffle=False),
                                tiny_tokenizer())[0]
    assert from_parquet == load(tmp_path, rows)[0]
