"""data.source = "hf:<folder or builder>" (datasets.load_dataset, for what only `datasets` reads: a folder whose
README lists its configs, CSV files) and "python:<pkg.module:function>" (a function that returns rows, what a
loading script was before `datasets` stopped running them): each reads to the prompts of the jsonl file holding
the same rows, picks its split, keeps the length filter, the cursor and the eval/train overlap check, and fails
in one line."""

import csv
import json

import pytest

from rl.config import ConfigError, DataConfig, EvalConfig
from rl.data import EVAL_KEYS, PromptDataset, load_prompts, read_source_rows
from rl.rollout.evaluate import load_eval_prompts
from tests.data_builders import additions
from tests.tiny import tiny_tokenizer

pytest.importorskip("datasets")

ROWS = [{"question": f"What is {i} + {2 * i}?", "answer": str(3 * i)} for i in range(9)]
TRAIN, TEST = ROWS[:6], ROWS[6:]


def config(source, **kw) -> DataConfig:
    return DataConfig(**{"source": str(source), "prompt_key": "question", "shuffle": False, **kw})


def prompts_of(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(p.text, str(p.label)) for p in load_prompts(cfg, tiny_tokenizer())[0]]


def write_csv(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def card_folder(root):
    """A folder whose README.md names its data files per split (the hub's dataset card configs), in CSV: a
    layout that only `datasets` reads."""
    (root / "files").mkdir(parents=True)
    write_csv(root / "files/fit.csv", TRAIN)
    write_csv(root / "files/held.csv", TEST)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                    "    path: files/fit.csv\n  - split: test\n    path: files/held.csv\n---\n# card\n")
    return root


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_folder_with_a_dataset_card_reads_each_split_like_jsonl(tmp_path):
    folder = card_folder(tmp_path / "card")
    assert prompts_of(config(f"hf:{folder}")) == prompts_of(config(jsonl(tmp_path / "train.jsonl", TRAIN)))
    assert prompts_of(config(f"hf:{folder}", split="test")) == prompts_of(config(jsonl(tmp_path / "t.jsonl", TEST)))
    with pytest.raises(ConfigError, match=r"^data.source=hf:.*card with data.split='validation', "
                                          r"data.task_config=\{\}: ValueError: Unknown split"):
        read_source_rows(config(f"hf:{folder}", split="validation"))


def test_a_packaged_builder_reads_the_files_its_task_config_names(tmp_path):
    write_csv(tmp_path / "rows.csv", TRAIN)
    cfg = config("hf:csv", task_config={"data_files": {"train": str(tmp_path / "rows.csv")}})
    assert prompts_of(cfg) == prompts_of(config(jsonl(tmp_path / "train.jsonl", TRAIN)))


def test_hf_never_asks_the_hub_and_loading_scripts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.source=hf:someone/gsm8k: not a local folder nor one of the builders "
                                          r"of datasets \(arrow, .*csv"):
        read_source_rows(config("hf:someone/gsm8k"))  # at once, not after network retries
    (tmp_path / "scripted").mkdir()
    (tmp_path / "scripted/scripted.py").write_text("import datasets\n")
    with pytest.raises(ConfigError, match=r"^eval.source=hf:.*scripted with eval.split='train', .*RuntimeError: "
                                          r"Dataset scripts are no longer supported"):
        read_source_rows(config(f"hf:{tmp_path / 'scripted'}"), EVAL_KEYS)


def test_a_python_builder_gets_the_split_and_task_config(tmp_path):
    cfg = config("python:tests.data_builders:additions", task_config={"count": 3, "start": 5})
    assert [label for _, label in prompts_of(cfg)] == ["10", "12", "7"]
    assert [label for _, label in prompts_of(config(cfg.source, split="test"))][:2] == ["1006", "1001"]
    assert len(prompts_of(config("python:tests.data_builders:generated"))) == 2


@pytest.mark.parametrize("source, message", [
    ("python:tests.data_builders:not_rows", r"^data.source=python:tests.data_builders:not_rows: row 0 is str "
                                            r"'What is 1 \+ 1\?', expected a table of columns"),
    ("python:tests.data_builders:broken", r"^data.source=python:tests.data_builders:broken with data.split='train', "
                                          r"data.task_config=\{\} raised FileNotFoundError: no train file$"),
    ("python:tests.data_builders:missing", r"^data.source='tests.data_builders:missing': module "
                                           r"'tests.data_builders' has no function 'missing'$"),
    ("python:tests.data_builders", r"^data.source must look like 'pkg.module:function'"),
])
def test_a_python_builder_that_fails_is_one_line(source, message):
    with pytest.raises(ConfigError, match=message):
        read_source_rows(config(source))


def test_rows_are_checked_the_length_filter_counts_and_the_cursor_resumes(tmp_path):
    folder = card_folder(tmp_path / "card")
    with pytest.raises(ConfigError, match=r"^data.source: hf:.*card \(data.split='train'\) row 0: missing key "
                                          r"'solution' \(data.answer_key\)"):
        read_source_rows(config(f"hf:{folder}", answer_key="solution"))
    source, sizes = "python:tests.data_builders:additions", {"count": 10, "start": 95}  # two and three digits
    lengths = [len(p.token_ids) for p in load_prompts(config(source, task_config=sizes), tiny_tokenizer())[0]]
    cut = min(lengths)
    prompts, dropped = load_prompts(config(source, task_config=sizes, max_prompt_len=cut), tiny_tokenizer())
    assert dropped == sum(n > cut for n in lengths) > 0 and len(prompts) == len(additions("train", **sizes)) - dropped
    first = PromptDataset.from_config(config(source, task_config=sizes, shuffle=True), tiny_tokenizer())
    first.next_groups(3, 2)
    again = PromptDataset.from_config(config(source, task_config=sizes, shuffle=True), tiny_tokenizer())
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [p.text for p in again.next_prompts(5)] == [p.text for p in first.next_prompts(5)]


@pytest.mark.parametrize("kind", ["hf", "python"])
def test_eval_on_the_test_split_drops_nothing_and_on_the_training_split_everything(tmp_path, kind):
    source = f"hf:{card_folder(tmp_path / 'card')}" if kind == "hf" else "python:tests.data_builders:additions"
    data = config(source)
    training = load_prompts(data, tiny_tokenizer())[0]
    held_out, dropped = load_eval_prompts(EvalConfig(source=source), data, tiny_tokenizer(), training)
    assert dropped == 0 and len(held_out) == len(TEST if kind == "hf" else training)
    same, dropped = load_eval_prompts(EvalConfig(source=source, split="train"), data, tiny_tokenizer(), training)
    assert same == [] and dropped == len(training)


def test_a_two_rank_run_trains_on_a_card_folder_and_evaluates_a_python_builder(tmp_path):
    from tests.test_faults import run, strict_rows
    from tests.tiny import save_tiny_model_dir

    rows = [{"question": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)} for i in range(40)]
    folder = tmp_path / "card"
    (folder / "files").mkdir(parents=True)
    write_csv(folder / "files/fit.csv", rows[:32])
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: files/fit.csv\n---\n")
    inputs = (save_tiny_model_dir(tmp_path / "model"), f"hf:{folder}")
    proc = run(inputs, tmp_path / "run", "--eval.source=python:tests.data_builders:additions",
               "--eval.task_config={count=8}", "--train.num_rollout=1", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 32 prompts" in proc.stdout and "eval: 8 held-out prompts (0 dropped" in proc.stdout
    assert strict_rows(tmp_path / "run")[-1]["eval/num_prompts"] == 8


def test_hf_without_the_datasets_package_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"^data.source=hf:.* needs the datasets package \(pip install datasets\)"):
        read_source_rows(config(f"hf:{card_folder(tmp_path / 'card')}"))
