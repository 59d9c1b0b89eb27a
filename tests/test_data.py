import dataclasses
import json

import pytest

from rl.config import ConfigError, DataConfig
from rl.data import Prompt, PromptDataset, Sample, expand_groups, read_source_rows, render_prompt
from tests.tiny import tiny_tokenizer, write_arithmetic_jsonl


def prompts(n):
    return [Prompt(text=f"p{i}", token_ids=[i], label=str(i), metadata={}) for i in range(n)]


def test_group_expansion_seed_numbers():
    groups = expand_groups(prompts(32), 8, group_start=0, index_start=0)
    assert len(groups) == 32 and all(len(g) == 8 for g in groups)
    assert [s.group_index for s in groups[0]] == [0] * 8
    assert [s.index for s in groups[0]] == list(range(8))
    assert [s.index for s in groups[31]] == list(range(248, 256))
    assert groups[31][0].group_index == 31
    groups[0][0].tokens.append(99)  # deep copies: samples never share lists
    assert groups[0][1].tokens == [0]
    source = Prompt(text="p", token_ids=[1, 2], label={"answer": [3]}, metadata={"tests": [4]}, raw=[{"content": "p"}],
                    columns={"extra": [5]})
    first, second = expand_groups([source], 2, 0, 0)[0]
    for sample in (first, second):  # nor dicts, nor what the prompt's row holds
        sample.label["answer"].append(0), sample.metadata["tests"].append(0), sample.raw_prompt[0].clear()
        sample.columns["extra"].append(0)
    assert (second.label, second.metadata, second.raw_prompt, second.columns) == (
        {"answer": [3, 0]}, {"tests": [4, 0]}, [{}], {"extra": [5, 0]})
    assert (source.label, source.metadata, source.raw, source.columns) == (
        {"answer": [3]}, {"tests": [4]}, [{"content": "p"}], {"extra": [5]})


def test_dataset_numbering_continues_and_cursor_resumes():
    ds = PromptDataset(prompts(10), shuffle=True, seed=3)
    first = ds.next_groups(4, 2)
    second = ds.next_groups(4, 2)
    assert second[0][0].group_index == 4 and second[0][0].index == 8
    state = ds.state_dict()
    expected = [g[0].prompt for g in ds.next_groups(6, 2)]  # crosses into epoch 1
    assert ds.epoch == 1
    resumed = PromptDataset(prompts(10), shuffle=True, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [g[0].prompt for g in resumed.next_groups(6, 2)] == expected
    seen = [g[0].prompt for g in first + second]
    assert len(set(seen)) == 8  # no repeats within an epoch


def test_a_changed_prompt_set_warns_and_goes_on_one_epoch_at_a_time(capsys):
    ds = PromptDataset(prompts(64), shuffle=True, seed=3)
    ds.next_prompts(8)
    ds.next_prompts(8)
    state = json.loads(json.dumps(ds.state_dict()))  # as the checkpoint stores it
    shrunk = PromptDataset(prompts(5), shuffle=True, seed=3)  # the file cut to 5 rows under the checkpoint
    shrunk.load_state_dict(state)
    assert capsys.readouterr().out == ("data: warning: the prompts of data.source changed since the checkpoint: "
                                       "64 then, 5 now; epoch 0 goes on from prompt 5\n")
    epochs, drawn = [state["epoch"]], []
    for _ in range(6):
        drawn += [p.text for p in shrunk.next_prompts(4)]
        epochs.append(shrunk.epoch)
    assert epochs == [0, 1, 2, 3, 4, 4, 5]
    assert all(sorted(drawn[i : i + 5]) == [f"p{j}" for j in range(5)] for i in range(0, 20, 5))  # whole passes

    relabeled = PromptDataset([dataclasses.replace(p, label="x") for p in prompts(64)], shuffle=True, seed=3)
    relabeled.load_state_dict(state)
    assert "64 then, 64 now (as many, but other text or labels); epoch 0 goes on from prompt 16" in capsys.readouterr().out
    for unchanged in [state, {k: v for k, v in state.items() if k not in ("num_prompts", "prompts_hash")}]:
        PromptDataset(prompts(64), shuffle=True, seed=3).load_state_dict(unchanged)  # the second: an older checkpoint
        assert capsys.readouterr().out == ""


def test_append_response_tokens():
    s = Sample(prompt="x", tokens=[1, 2])
    s.append_response_tokens([101, 202, 7], [-0.42, -1.10, -0.08])
    assert s.tokens == [1, 2, 101, 202, 7] and s.response_length == 3
    assert s.loss_mask == [1, 1, 1] and s.tokens[: s.prompt_length] == [1, 2] and s.tokens[s.prompt_length :] == [101, 202, 7]
    with pytest.raises(ValueError, match="logprobs"):
        s.append_response_tokens([1], [])


def test_jsonl_source_templates_and_filters(tmp_path):
    path = write_arithmetic_jsonl(tmp_path / "train.jsonl", rows=8)
    with path.open("a") as f:
        f.write(json.dumps({"question": "What is 1 + 1? " * 40, "answer": "2"}) + "\n")
    cfg = DataConfig(source=str(path), prompt_key="question", answer_key="answer", max_prompt_len=64,
                     prompt_template="{prompt} Answer with just the number.")
    ds = PromptDataset.from_config(cfg, tiny_tokenizer())
    assert len(ds.prompts) == 8 and ds.num_filtered == 1
    p = ds.prompts[0]
    assert p.text.startswith("<|im_start|>user\nWhat is") and p.text.endswith("<|im_start|>assistant\n")
    assert "Answer with just the number." in p.text and p.label == "0"


def test_bad_sources_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        read_source_rows(DataConfig(source=str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: invalid JSON"):
        read_source_rows(DataConfig(source=str(bad)))
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')  # blank lines still count
    with pytest.raises(ConfigError, match=r"missing.jsonl:3: missing key 'answer' \(data.answer_key\)"):
        read_source_rows(DataConfig(source=str(missing)))
    for line, problem in [
        ('{"prompt": 5, "answer": "1"}', r"'prompt' \(data.prompt_key\) must be text or a non-empty list"),
        ('{"prompt": "  ", "answer": "1"}', r"'prompt' \(data.prompt_key\) is empty"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}', r"'prompt' \(data.prompt_key\) message 0 must be"),
        ('{"prompt": "a", "answer": null}', r"'answer' \(data.answer_key\) is null"),
    ]:
        bad_row = tmp_path / "bad_row.jsonl"
        bad_row.write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
        with pytest.raises(ConfigError, match=r"bad_row.jsonl:2: " + problem):
            read_source_rows(DataConfig(source=str(bad_row)))
    with pytest.raises(ConfigError, match="reasoning_gym:no_such_task"):
        read_source_rows(DataConfig(source="reasoning_gym:no_such_task"))


def test_invalid_utf8_names_the_key_file_and_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "a", "answer": "1"}\n\n{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        read_source_rows(DataConfig(source=str(bad)))
    assert str(info.value) == f"data.source: {bad}:3: invalid UTF-8 (byte 0xe9 at column 16)"
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 and then not parquet")
    with pytest.raises(ConfigError, match=f"data.source: {corrupt}: not a readable parquet file"):
        read_source_rows(DataConfig(source=str(corrupt)))


def test_unknown_chat_roles_and_duplicate_keys_name_the_file_and_line(tmp_path):
    """Both would train silently: a chat template drops or mislabels a role it does not know (Qwen2.5's renders
    nothing for it), and JSON keeps only the last of two equal keys."""
    for line, problem in [
        ('{"prompt": [{"role": "hacker", "content": "hi"}], "answer": "1"}',
         "'prompt' (data.prompt_key) message 0 has role 'hacker'; chat templates know system, user, assistant, tool"),
        ('{"prompt": "a", "prompt": "b", "answer": "1"}', "duplicate key 'prompt' in one JSON object"),
        ('{"prompt": [{"role": "user", "role": "system", "content": "hi"}], "answer": "1"}',
         "duplicate key 'role' in one JSON object"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
        with pytest.raises(ConfigError) as info:
            read_source_rows(DataConfig(source=str(bad)))
        assert str(info.value).startswith(f"data.source: {bad}:3: {problem}"), str(info.value)
        assert "\n" not in str(info.value)
    path = tmp_path / "roles.parquet"  # a table names its row (0-based, as the other table errors do)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}], [{"role": "bot", "content": "x"}]],
                             "answer": ["1", "2"]}), path)
    with pytest.raises(ConfigError, match=rf"data.source: {path} row 1: 'prompt' \(data.prompt_key\) message 0 has "
                                          r"role 'bot'"):
        read_source_rows(DataConfig(source=str(path)))
    fine = tmp_path / "fine.jsonl"
    fine.write_text("".join(json.dumps({"prompt": [{"role": role, "content": "x"}, {"role": "user", "content": "y"}],
                                        "answer": "1"}) + "\n" for role in ("system", "user", "assistant", "tool")))
    assert len(read_source_rows(DataConfig(source=str(fine)))[0]) == 4


def test_reasoning_gym_source():
    cfg = DataConfig(source="reasoning_gym:basic_arithmetic", num_examples=5,
                     task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    rows, pk, ak = read_source_rows(cfg)
    assert len(rows) == 5 and rows[0][pk] and rows[0][ak] is not None


def test_parquet_source_and_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"q": ["What is 2 + 2?", "What is 1 + 5?"], "a": ["4", "6"]}), path)
    cfg = DataConfig(source=str(path), prompt_key="q", answer_key="a", system_prompt="Be brief.", shuffle=False)
    ds = PromptDataset.from_config(cfg, tiny_tokenizer())
    assert [p.label for p in ds.prompts] == ["4", "6"]
    assert ds.prompts[0].text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    messages = [{"role": "user", "content": "hi"}]
    from rl.data import render_prompt

    assert render_prompt(messages, DataConfig(), tiny_tokenizer()).startswith("<|im_start|>user\nhi")


def test_prompt_template_with_literal_braces():
    cfg = DataConfig(prompt_template="{prompt} Put your final answer within \\boxed{}.", apply_chat_template=False)
    assert render_prompt("What is {x} + 1?", cfg, tiny_tokenizer()) == \
        "What is {x} + 1? Put your final answer within \\boxed{}."


def bos_tokenizer():
    """The tiny tokenizer made to open plain text with a BOS token, as Gemma's and Llama's do."""
    from tokenizers import processors
    tok = tiny_tokenizer()
    tok.bos_token = "<|pad|>"  # a token of the tiny vocabulary the chat template does not open with
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|pad|> $A", pair="<|pad|> $A $B",
                                                                  special_tokens=[("<|pad|>", bos)])
    return tok, bos


def test_a_prompt_without_a_chat_template_opens_with_the_tokenizers_bos(tmp_path):
    """Without a chat template a prompt's tokens open with the BOS token where the tokenizer opens plain text with
    one (once, also where the text writes it), as the model saw every text in pre-training; a chat template's text
    is taken as it is, and a tokenizer without a BOS (Qwen's) adds nothing."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": "4"}) for p in ["2 + 2 = ", "<|pad|>2 + 2 = "]))
    tok, bos = bos_tokenizer()
    plain = tok("2 + 2 = ", add_special_tokens=False)["input_ids"]
    raw = DataConfig(source=str(path), shuffle=False, apply_chat_template=False)
    assert [p.token_ids for p in PromptDataset.from_config(raw, tok).prompts] == [[bos] + plain] * 2
    chat = PromptDataset.from_config(dataclasses.replace(raw, apply_chat_template=True), tok).prompts[0]
    assert chat.token_ids == tok(chat.text, add_special_tokens=False)["input_ids"] and bos not in chat.token_ids
    assert PromptDataset.from_config(raw, tiny_tokenizer()).prompts[0].token_ids == plain
