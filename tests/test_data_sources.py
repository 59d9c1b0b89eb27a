"""Hugging Face dataset folders as data.source / eval.source: each layout reads to the same prompts as the
jsonl file holding the same rows, a split is chosen by data.split / eval.split, and errors are one line."""

import json

import pytest

from rl.config import ConfigError, DataConfig, EvalConfig
from rl.data import EVAL_KEYS, load_prompts, read_source_rows
from rl.rollout.evaluate import load_eval_prompts
from tests.tiny import tiny_tokenizer

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"What is {i} + {2 * i}?", "answer": str(3 * i)} for i in range(9)]
TRAIN, TEST = ROWS[:6], ROWS[6:]


def config(source, **kw) -> DataConfig:
    return DataConfig(source=str(source), prompt_key="question", shuffle=False, **kw)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_of(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(p.text, p.label) for p in load_prompts(cfg, tiny_tokenizer())[0]]


def hub_folder(root):
    """The hub's layout: train in two shards, test in one."""
    (root / "data").mkdir(parents=True)
    datasets.Dataset.from_list(TRAIN[:4]).to_parquet(root / "data/train-00000-of-00002.parquet")
    datasets.Dataset.from_list(TRAIN[4:]).to_parquet(root / "data/train-00001-of-00002.parquet")
    datasets.Dataset.from_list(TEST).to_parquet(root / "data/test-00000-of-00001.parquet")
    (root / "README.md").write_text("a dataset card\n")
    return root


def dict_folder(root):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(root)
    return root


def test_saved_dataset_reads_like_jsonl(tmp_path):
    datasets.Dataset.from_list(TRAIN).save_to_disk(tmp_path / "saved")
    expected = prompts_of(config(jsonl(tmp_path / "train.jsonl", TRAIN)))
    assert prompts_of(config(tmp_path / "saved")) == expected
    # A saved Dataset is one split, like a file: the split key does not apply.
    assert prompts_of(config(tmp_path / "saved", split="anything")) == expected


@pytest.mark.parametrize("make", [dict_folder, hub_folder])
def test_split_folders_read_each_split_like_jsonl(tmp_path, make):
    folder = make(tmp_path / "ds")
    assert prompts_of(config(folder)) == prompts_of(config(jsonl(tmp_path / "train.jsonl", TRAIN)))
    assert prompts_of(config(folder, split="test")) == prompts_of(config(jsonl(tmp_path / "test.jsonl", TEST)))


def test_top_level_split_files_and_split_subfolders(tmp_path):
    top = tmp_path / "top"
    top.mkdir()
    jsonl(top / "train.jsonl", TRAIN)
    datasets.Dataset.from_list(TEST).to_parquet(top / "test.parquet")
    sub = tmp_path / "sub"
    (sub / "train").mkdir(parents=True)
    datasets.Dataset.from_list(TRAIN).to_parquet(sub / "train/part-0.parquet")
    expected = prompts_of(config(jsonl(tmp_path / "train.jsonl", TRAIN)))
    assert prompts_of(config(top)) == prompts_of(config(sub)) == expected
    assert [label for _, label in prompts_of(config(top, split="test"))] == [r["answer"] for r in TEST]


@pytest.mark.parametrize("make, found", [(dict_folder, "train, test"), (hub_folder, "test, train")])
def test_a_missing_split_names_the_splits_found(tmp_path, make, found):
    folder = make(tmp_path / "ds")
    with pytest.raises(ConfigError) as info:
        read_source_rows(config(folder, split="validation"))
    assert str(info.value) == f"data.split='validation': {folder} has splits {found}"
    with pytest.raises(ConfigError, match=r"^eval.split='validation': "):
        read_source_rows(config(folder, split="validation"), EVAL_KEYS)


def test_folder_without_a_dataset_and_arrow_rows_checked_like_jsonl(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^data.source: .*empty is a folder without a dataset"):
        read_source_rows(config(tmp_path / "empty"))
    datasets.Dataset.from_list([{"question": "What is 1 + 1?", "solution": "2"}]).save_to_disk(tmp_path / "s")
    with pytest.raises(ConfigError, match=r"^data.source: .*data-00000-of-00001.arrow row 0: missing key 'answer' "
                                          r"\(data.answer_key\)"):
        read_source_rows(config(tmp_path / "s"))


@pytest.mark.parametrize("make", [dict_folder, hub_folder])
def test_eval_on_the_test_split_of_the_training_folder_drops_nothing(tmp_path, make):
    folder = make(tmp_path / "ds")
    data = config(folder)
    training = load_prompts(data, tiny_tokenizer())[0]
    held_out, dropped = load_eval_prompts(EvalConfig(source=str(folder)), data, tiny_tokenizer(), training)
    assert dropped == 0 and [p.label for p in held_out] == [r["answer"] for r in TEST]
    # The overlap check still sees rows: evaluating on the training split drops them all.
    same, dropped = load_eval_prompts(EvalConfig(source=str(folder), split="train"), data, tiny_tokenizer(), training)
    assert same == [] and dropped == len(TRAIN)


def test_a_two_rank_run_trains_on_a_hub_folder_and_evaluates_its_test_split(tmp_path):
    from tests.test_faults import run, strict_rows
    from tests.tiny import save_tiny_model_dir

    rows = [{"question": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)} for i in range(40)]
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows[:16]).to_parquet(folder / "data/train-00000-of-00002.parquet")
    datasets.Dataset.from_list(rows[16:32]).to_parquet(folder / "data/train-00001-of-00002.parquet")
    datasets.Dataset.from_list(rows[32:]).to_parquet(folder / "data/test-00000-of-00001.parquet")
    inputs = (save_tiny_model_dir(tmp_path / "model"), folder)
    proc = run(inputs, tmp_path / "run", f"--eval.source={folder}", "--eval.num_examples=8", "--train.num_rollout=1",
               nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 32 prompts" in proc.stdout and "eval: 8 held-out prompts (0 dropped" in proc.stdout
    assert strict_rows(tmp_path / "run")[-1]["eval/num_prompts"] == 8


def test_a_damaged_save_to_disk_index_is_one_line(tmp_path):
    folder = dict_folder(tmp_path / "ds")
    (folder / "dataset_dict.json").write_text('{"splits": ["train", ')  # cut off mid-write
    with pytest.raises(ConfigError, match=r"^data.source: .*dataset_dict.json cannot be read as a save_to_disk index "
                                          r"\(JSONDecodeError: "):
        read_source_rows(config(folder))
    folder = dict_folder(tmp_path / "again")
    (folder / "train" / "state.json").write_text('{"_fingerprint": "x"}')
    with pytest.raises(ConfigError, match=r"state.json cannot be read as a save_to_disk index \(KeyError: "):
        read_source_rows(config(folder))
