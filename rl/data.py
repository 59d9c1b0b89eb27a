"""Samples and prompt sources.

`Sample` carries one response through rollout, reward and training: its tokens, logprobs, masks,
reward, advantage and weight versions. `PromptDataset` reads prompts (jsonl, parquet, a reasoning-gym task, or one split of a
Hugging Face dataset folder: `save_to_disk` arrow files or the hub's file layout, read with
pyarrow alone so that `datasets` is not needed to train; "hf:" hands a folder or builder to
`datasets.load_dataset`, "python:" calls a function that returns rows),
applies the prompt template and chat template, drops over-long prompts (counted),
and hands out whole groups of `n_samples_per_prompt` copies of each prompt, whose
`group_index`/`index` count on across rollouts, so a number names one sample of the
run. Its cursor (epoch, offset, seeded shuffle) is a small dict,
so a run can resume exactly where it stopped. Every rank builds the same dataset and
draws the same groups; ranks then take their own slice.

Columns: the prompt column holds text or a list of chat messages (TRL's conversational format); a column may
hold each row's system prompt; the answer may sit inside a table column (verl's "reward_model.ground_truth")
or be absent. Every other column rides along on each Sample, for the reward functions.

The cursor also holds a fingerprint of the prompts it indexes (their number and a hash
of their text and labels). A run resumed on prompts that changed (an edited data file,
a new template or max_prompt_len) says so in one line and goes on rather than stopping:
same epoch, same position, clamped to the new end so that a shorter set ends the epoch
in progress and the next begins; epochs still advance one whole pass at a time. A cursor
saved before fingerprints existed loads as before, unchecked.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.config import ConfigError, DataConfig
from rl.parallel import print0


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS or a stop id
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cut off by the engine (e.g. a weight update)


@dataclass
class Sample:
    prompt: str  # prompt text after templates
    tokens: list[int]  # prompt + response token ids
    label: Any = None  # gold answer handed to the reward
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)  # one entry per response token
    rollout_log_probs: list[float] = field(default_factory=list)  # one entry per response token
    reward: float | None = None  # NaN: every reward function passed on it (returned None): advantage 0
    advantage: float = 0.0
    status: Status = Status.PENDING
    group_index: int = -1
    index: int = -1
    weight_version: int = 0  # of the weights that generated the last response token
    metadata: dict[str, Any] = field(default_factory=dict)  # handed to reward.user_fn
    raw_prompt: Any = None  # the prompt as its row holds it (text or chat messages): TRL-style functions' `prompts`
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for TRL-style functions
    # One entry per response token: the weight version that sampled it. A sample continued across weight
    # pushes (partial rollouts) mixes versions; its oldest token bounds its staleness.
    token_versions: list[int] = field(default_factory=list)
    turns: int = 0  # model turns of a multi-turn episode (env.fn); 0: a single response
    tool_calls: int = 0  # the environment's turns appended to it (each answers a tool call)
    logged: dict[str, Any] = field(default_factory=dict)  # what reward functions gave it with log_extra
    # Each reward function's own score (reward.functions, reward.group_fn), by name, before its weight; None where
    # it passed on the sample
    scores: dict[str, float | None] = field(default_factory=dict)
    # A mixture of experts' routing as the native engine recorded it: per MoE layer and token of `tokens`, the
    # top-k expert ids it computed that token with, (MoE layers, len(tokens), k) int16; -1 where a token was never
    # fed (the last one). None for dense models and the vLLM engine. Kept for routing replay at training time.
    routed_experts: Any = field(default=None, compare=False)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def append_response_tokens(self, tokens: list[int], log_probs: list[float], trainable: bool = True,
                               version: int = 0) -> None:
        if len(tokens) != len(log_probs):
            raise ValueError(f"sample {self.index}: {len(tokens)} tokens but {len(log_probs)} logprobs")
        self.tokens = self.tokens + list(tokens)
        self.response_length += len(tokens)
        self.loss_mask = self.loss_mask + [int(trainable)] * len(tokens)
        self.rollout_log_probs = self.rollout_log_probs + list(log_probs)
        self.token_versions = self.token_versions + [version] * len(tokens)


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]
    label: Any
    metadata: dict[str, Any]
    raw: Any = None  # the row's prompt before templates
    columns: dict[str, Any] = field(default_factory=dict)  # the row without its prompt


# ---------------------------------------------------------------------------- reading rows


@dataclass(frozen=True)
class SourceKeys:
    """The config keys that errors about a prompt set name. The eval set has its own source and task
    config but reads its rows with data's prompt and answer keys, so its errors name those as its own."""

    source: str
    prompt_key: str
    answer_key: str
    system_prompt_key: str
    task_config: str
    split: str


TRAINING_KEYS = SourceKeys("data.source", "data.prompt_key", "data.answer_key", "data.system_prompt_key",
                           "data.task_config", "data.split")
EVAL_KEYS = SourceKeys("eval.source", "data.prompt_key, read for eval.source", "data.answer_key, read for eval.source",
                       "data.system_prompt_key, read for eval.source", "eval.task_config", "eval.split")


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key it holds twice: json.loads would keep the last value silently."""
    row = dict(pairs)
    if len(row) < len(pairs):
        seen = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return row


def _read_jsonl(path: Path, source_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of a JSONL file and, per row, where it is ("<source_key>: path:line", 1-based; blank lines skipped)."""
    rows, where = [], []
    with path.open("rb") as f:  # bytes, decoded a line at a time, so a bad byte is reported by its line
        for line_no, raw in enumerate(f, 1):
            at = f"{source_key}: {path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{at}: invalid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{at}: invalid JSON ({e.msg})") from e
            except DuplicateKey as e:
                raise ConfigError(f"{at}: duplicate key {e.key!r} in one JSON object (JSON keeps only its last "
                                  f"value); keep one") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{at}: each line must be a JSON object")
            rows.append(row)
            where.append(at)
    return rows, where


def _read_parquet(path: Path, source_key: str) -> list[dict[str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pyarrow.ArrowException as e:  # a truncated or foreign file
        raise ConfigError(f"{source_key}: {path}: not a readable parquet file ({e})") from e


def _read_arrow(path: Path, source_key: str) -> list[dict[str, Any]]:
    """Rows of one arrow file written by `datasets`' save_to_disk, which writes the IPC stream format."""
    import pyarrow
    import pyarrow.ipc

    try:
        with pyarrow.ipc.open_stream(path) as reader:
            return reader.read_all().to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise ConfigError(f"{source_key}: {path}: not a readable arrow stream ({e})") from e


def _read_file(path: Path, source_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of one .jsonl, .parquet or .arrow file and, per row, where it is for errors."""
    if path.suffix == ".jsonl":
        return _read_jsonl(path, source_key)
    rows = _read_arrow(path, source_key) if path.suffix == ".arrow" else _read_parquet(path, source_key)
    return rows, [f"{source_key}: {path} row {i}" for i in range(len(rows))]


# ---------------------------------------------------------------------------- dataset folders


def _read_index(path: Path, key: str, source: str):
    """`key` of a save_to_disk folder's JSON index (state.json, dataset_dict.json); one line when it is damaged."""
    try:
        return json.loads(path.read_text())[key]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{source}: {path} cannot be read as a save_to_disk index ({type(e).__name__}: {e}); "
                          f"save the dataset again") from None


def _saved_dataset_files(folder: Path, source: str) -> list[Path]:
    """The arrow files of a `Dataset.save_to_disk` folder, in row order as its state.json lists them."""
    entries = _read_index(folder / "state.json", "_data_files", source)
    try:
        return [folder / f["filename"] for f in entries]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{source}: {folder / 'state.json'} lists its files without names ({e!r}); save the "
                          f"dataset again") from None


def _split_name(file: Path) -> str:
    """'train' for train.parquet and for the hub's shards, train-00000-of-00002.parquet."""
    return re.sub(r"-\d+-of-\d+$", "", file.name.split(".")[0])


def _hub_layout_splits(folder: Path) -> dict[str, list[Path]]:
    """Split name -> its files in row order, for the first layout the folder uses, in the hub's order:
    data/<split>-*.parquet, then <split>.jsonl / <split>.parquet at the top, then <split>/*.parquet."""
    def data_files(d: Path) -> list[Path]:
        return sorted(f for f in d.iterdir() if f.is_file() and f.suffix in (".jsonl", ".parquet"))

    for files in (data_files(folder / "data") if (folder / "data").is_dir() else [], data_files(folder)):
        if files:
            splits: dict[str, list[Path]] = {}
            for f in files:  # sorted by name: zero-padded shard numbers keep rows in order
                splits.setdefault(_split_name(f), []).append(f)
            return splits
    subfolders = sorted(d for d in folder.iterdir() if d.is_dir() and d.name != "data")
    return {d.name: data_files(d) for d in subfolders if data_files(d)}


def _folder_split_files(folder: Path, split: str, keys: SourceKeys) -> list[Path]:
    """The files holding `split` of a dataset folder (a single saved Dataset has no splits: all of it)."""
    if (folder / "state.json").is_file():
        return _saved_dataset_files(folder, keys.source)
    if (folder / "dataset_dict.json").is_file():
        names = _read_index(folder / "dataset_dict.json", "splits", keys.source)
        files = _saved_dataset_files(folder / split, keys.source) if split in names else []
    else:
        splits = _hub_layout_splits(folder)
        names, files = list(splits), splits.get(split, [])
    if not names:
        raise ConfigError(f"{keys.source}: {folder} is a folder without a dataset: no dataset_dict.json or "
                          f"state.json (save_to_disk), nor data/<split>-*.parquet, <split>.jsonl, "
                          f"<split>.parquet or <split>/*.parquet")
    if split not in names:
        raise ConfigError(f"{keys.split}={split!r}: {folder} has splits {', '.join(names)}")
    return files


def _read_folder(folder: Path, split: str, keys: SourceKeys) -> tuple[list[dict[str, Any]], list[str]]:
    rows, where = [], []
    for file in _folder_split_files(folder, split, keys):
        file_rows, file_where = _read_file(file, keys.source)
        rows += file_rows
        where += file_where
    return rows, where


def _generate_reasoning_gym(task: str, cfg: DataConfig, keys: SourceKeys) -> list[dict[str, Any]]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=cfg.num_examples, seed=cfg.seed, **cfg.task_config)
    except Exception as e:  # reasoning-gym raises a mix of KeyError/ValueError/TypeError
        raise ConfigError(f"{keys.source}=reasoning_gym:{task} with {keys.task_config}={cfg.task_config}: {e}") from e
    return [{"prompt": item["question"], "answer": item["answer"], "metadata": item.get("metadata", {})}
            for item in dataset]


def _load_with_datasets(target: str, cfg: DataConfig, keys: SourceKeys) -> list[dict[str, Any]]:
    """Rows of `datasets.load_dataset(target, split=<split>, **task_config)`, for what only `datasets` reads: a
    local folder whose README.md lists its configs and data files, CSV or text files, or one of its packaged
    builders ("csv", "json", ...) given `data_files` in the task config. Never the hub: a name that is neither a
    local folder nor a packaged builder is an error here, not a minute of network retries. Loading scripts are
    not read (`datasets` 4 and later refuse them); a Python function that returns rows is `python:`.
    Each process prepares its own copy in a temporary cache and keeps it in memory, so ranks never share a
    cache folder and nothing is left behind."""
    import tempfile

    at = f"{keys.source}=hf:{target}"
    try:
        import datasets
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError as e:
        raise ConfigError(f"{at} needs the datasets package (pip install datasets): {e}") from None
    if not (Path(target).is_dir() or target in _PACKAGED_DATASETS_MODULES):
        raise ConfigError(f"{at}: not a local folder nor one of the builders of datasets "
                          f"({', '.join(sorted(_PACKAGED_DATASETS_MODULES))})")
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="rl-datasets-") as cache:
        try:
            dataset = datasets.load_dataset(target, split=cfg.split, cache_dir=cache, keep_in_memory=True,
                                            **cfg.task_config)
        except Exception as e:  # datasets raises ValueError, FileNotFoundError, DatasetGenerationError, ...
            raise ConfigError(f"{at} with {keys.split}={cfg.split!r}, {keys.task_config}={cfg.task_config}: "
                              f"{type(e).__name__}: {e}"[:1000]) from None
        return dataset.to_list()


def _call_builder(target: str, cfg: DataConfig, keys: SourceKeys) -> list[dict[str, Any]]:
    """Rows returned by `fn(split=<split>, **task_config)` for "python:pkg.module:fn": what a dataset loading
    script did before `datasets` stopped running them. Any iterable of row tables will do (a list of dicts, a
    generator, a `datasets.Dataset`). Every rank calls it and must get the same rows, as from any other source."""
    from rl.functions import load_function

    fn = load_function(target, keys.source)
    try:
        rows = list(fn(split=cfg.split, **cfg.task_config))
    except Exception as e:
        raise ConfigError(f"{keys.source}=python:{target} with {keys.split}={cfg.split!r}, "
                          f"{keys.task_config}={cfg.task_config} raised {type(e).__name__}: {e}"[:1000]) from e
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{keys.source}=python:{target}: row {i} is {type(row).__name__} {row!r:.200}, "
                              f"expected a table of columns (a dict)")
    return rows


# The roles that chat templates (Qwen2/2.5/3, Llama 3, Mistral in transformers) and TRL's conversational format
# share. A template meets any other role with an error at best; Qwen2.5's renders nothing for it, so the message
# would vanish from the prompt without a word.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _prompt_problem(raw: Any) -> str:
    """What is wrong with a row's prompt ('' if nothing): text, or chat messages with role and content."""
    if isinstance(raw, str):
        return "is empty" if not raw.strip() else ""
    if isinstance(raw, list) and raw:
        for i, m in enumerate(raw):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f"message {i} must be an object with string 'role' and 'content', got {m!r}"[:300]
            if m["role"] not in CHAT_ROLES:
                return (f"message {i} has role {m['role']!r:.50}; chat templates know {', '.join(CHAT_ROLES)} "
                        f"(TRL's conversational format)")
        return ""
    return f"must be text or a non-empty list of chat messages, got {type(raw).__name__} {raw!r}"[:300]


def read_source_rows(cfg: DataConfig, keys: SourceKeys = TRAINING_KEYS) -> tuple[list[dict[str, Any]], str, str]:
    """Returns (rows, prompt_key, answer_key) for the configured source; errors name `keys`."""
    if cfg.source.startswith("reasoning_gym:"):
        return _generate_reasoning_gym(cfg.source.split(":", 1)[1], cfg, keys), "prompt", "answer"
    kind, colon, target = cfg.source.partition(":")
    path = Path(cfg.source)
    if colon and kind in ("hf", "python"):
        rows = (_load_with_datasets if kind == "hf" else _call_builder)(target, cfg, keys)
        where = [f"{keys.source}: {cfg.source} ({keys.split}={cfg.split!r}) row {i}" for i in range(len(rows))]
    elif path.is_dir():
        rows, where = _read_folder(path, cfg.split, keys)
    elif not path.is_file():
        raise ConfigError(f"{keys.source}: file not found: {path}")
    elif path.suffix in (".jsonl", ".parquet"):  # a plain file is one split: the split key does not apply
        rows, where = _read_file(path, keys.source)
    else:
        raise ConfigError(f"{keys.source}: {path} must end in .jsonl or .parquet, be a dataset folder, "
                          f"or be reasoning_gym:<task>, hf:<folder or builder> or python:<pkg.module:function>")
    for row, at in zip(rows, where):
        _check_row(row, at, cfg, keys)
    return rows, cfg.prompt_key, cfg.answer_key


MISSING = object()


def column(row: dict[str, Any], key: str) -> Any:
    """row[key]; for a dotted key that names no column, the value inside nested tables, as verl's parquet files
    hold their answers ("reward_model.ground_truth"); MISSING when there is none."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _check_row(row: dict[str, Any], at: str, cfg: DataConfig, keys: SourceKeys) -> None:
    """One line naming the row and the key for a missing column, a bad prompt, a null answer or system prompt."""
    named = [(cfg.prompt_key, keys.prompt_key), (cfg.answer_key, keys.answer_key),
             (cfg.system_prompt_key, keys.system_prompt_key)]
    for key, name in named:
        if key and column(row, key) is MISSING:
            raise ConfigError(f"{at}: missing key {key!r} ({name}); row keys: {sorted(row)}")
    problem = _prompt_problem(column(row, cfg.prompt_key))
    if problem:
        raise ConfigError(f"{at}: {cfg.prompt_key!r} ({keys.prompt_key}) {problem}")
    if cfg.answer_key and column(row, cfg.answer_key) is None:
        raise ConfigError(f"{at}: {cfg.answer_key!r} ({keys.answer_key}) is null")
    system = column(row, cfg.system_prompt_key) if cfg.system_prompt_key else None
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{at}: {cfg.system_prompt_key!r} ({keys.system_prompt_key}) must be text or null, "
                          f"got {type(system).__name__} {system!r}"[:300])


# ---------------------------------------------------------------------------- templating


def render_prompt(raw: Any, cfg: DataConfig, tokenizer, system_prompt: str | None = None) -> str:
    """Raw prompt (text or chat messages) -> the text the engine continues. `system_prompt`: the row's own,
    which replaces data.system_prompt; chat messages that open with a system message keep theirs."""
    if isinstance(raw, list):  # already chat messages: the template is for text prompts
        messages = [dict(m) for m in raw]
    else:
        # Plain replacement, not str.format: templates hold literal braces ("\\boxed{}").
        messages = [{"role": "user", "content": cfg.prompt_template.replace("{prompt}", raw)}]
    system_prompt = system_prompt or cfg.system_prompt
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not cfg.apply_chat_template:
        return "\n".join(m["content"] for m in messages)
    if tokenizer.chat_template is None:
        raise ConfigError("data.apply_chat_template=true but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def opening_bos(tokenizer) -> list[int]:
    """[the BOS id] where the tokenizer opens plain text with its BOS token (Gemma, Llama), else [] (Qwen). A
    prompt without a chat template gets it as the tokenizer's own call would, and nothing else that call adds
    (an EOS at the end of a prompt would end it): without it Gemma 3 270M, trained with a BOS before every
    text, answered 1 of 60 held-out eight-shot additions greedily, against 29 with it."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    return [bos] if tokenizer("1", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def tokenize_prompts(rows, prompt_key, answer_key, cfg: DataConfig, tokenizer) -> tuple[list[Prompt], list[int]]:
    """Templated, tokenized prompts and the token lengths of those dropped for exceeding max_prompt_len."""
    prompts, dropped = [], []
    bos = [] if cfg.apply_chat_template else opening_bos(tokenizer)  # a chat template writes its own
    for row in rows:
        system_prompt = column(row, cfg.system_prompt_key) if cfg.system_prompt_key else None
        text = render_prompt(column(row, prompt_key), cfg, tokenizer, system_prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if bos and ids[:1] != bos:
            ids = bos + ids
        if len(ids) > cfg.max_prompt_len:
            dropped.append(len(ids))
            continue
        prompts.append(Prompt(text=text, token_ids=list(ids), label=column(row, answer_key) if answer_key else None,
                              metadata=user_fn_metadata(row, prompt_key, answer_key), raw=column(row, prompt_key),
                              columns={k: v for k, v in row.items() if k != prompt_key}))
    return prompts, dropped


def user_fn_metadata(row: dict[str, Any], prompt_key: str, answer_key: str) -> dict[str, Any]:
    """reward.user_fn's `metadata`: the row's columns other than the prompt and the answer, and the keys of a
    "metadata" column holding a table (as reasoning-gym rows do) at the top level, where they always were."""
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    if isinstance(row.get("metadata"), dict):
        metadata.update(metadata.pop("metadata"))
    return metadata


def load_prompts(cfg: DataConfig, tokenizer, keys: SourceKeys = TRAINING_KEYS) -> tuple[list[Prompt], int]:
    """The source's templated, tokenized prompts (at least one) and how many max_prompt_len dropped."""
    rows, prompt_key, answer_key = read_source_rows(cfg, keys)
    prompts, dropped = tokenize_prompts(rows, prompt_key, answer_key, cfg, tokenizer)
    if not prompts and not dropped:
        raise ConfigError(f"{keys.source} yields no prompts: it has no rows")
    if not prompts:
        shortest = ", ".join(map(str, sorted(dropped)[:10])) + (", ..." if len(dropped) > 10 else "")
        raise ConfigError(f"{keys.source} yields no prompts: all {len(dropped)} are longer than data.max_prompt_len="
                          f"{cfg.max_prompt_len} tokens with the template (their lengths, shortest first: {shortest}; "
                          f"the longest {max(dropped)})")
    return prompts, len(dropped)


# ---------------------------------------------------------------------------- dataset


def expand_groups(prompts: list[Prompt], n_samples_per_prompt: int, group_start: int, index_start: int
                  ) -> list[list[Sample]]:
    """Each prompt becomes a group of n copies; groups and samples are numbered on from `group_start` and
    `index_start`, so that numbers are unique over the run."""
    groups, index = [], index_start
    for g, prompt in enumerate(prompts):
        # Each sample its own copy of everything; the token ids (ints) by a list copy, which a deepcopy of the
        # whole sample made element by element (~0.03 s of a 256-sample rollout on two cores).
        fields = dict(label=prompt.label, metadata=prompt.metadata, raw_prompt=prompt.raw, columns=prompt.columns)
        group = []
        for _ in range(n_samples_per_prompt):
            group.append(Sample(prompt=prompt.text, tokens=list(prompt.token_ids), group_index=group_start + g,
                                index=index, **copy.deepcopy(fields)))
            index += 1
        groups.append(group)
    return groups


class PromptDataset:
    """Prompts in a seeded order that changes every epoch; `state_dict` is the resumable cursor."""

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int, num_filtered: int = 0):
        if not prompts:
            raise ValueError("PromptDataset needs at least one prompt")  # else next_prompts never returns
        self.prompts = prompts
        self.prompts_hash = fingerprint(prompts)
        self.shuffle = shuffle
        self.seed = seed
        self.num_filtered = num_filtered
        self.epoch = 0
        self.offset = 0
        self.next_group_index = 0
        self.next_sample_index = 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer) -> PromptDataset:
        prompts, dropped = load_prompts(cfg, tokenizer)
        return cls(prompts, cfg.shuffle, cfg.seed, num_filtered=dropped)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_prompts(self, count: int) -> list[Prompt]:
        out = []
        while len(out) < count:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), len(self._order) - self.offset)
            out.extend(self.prompts[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def next_groups(self, count: int, n_samples_per_prompt: int) -> list[list[Sample]]:
        groups = expand_groups(self.next_prompts(count), n_samples_per_prompt,
                               self.next_group_index, self.next_sample_index)
        self.next_group_index += count
        self.next_sample_index += count * n_samples_per_prompt
        return groups

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index, "seed": self.seed,
                "num_prompts": len(self.prompts), "prompts_hash": self.prompts_hash}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ConfigError(f"data.seed={self.seed} differs from the checkpoint's {state['seed']}")
        # Past the end of a shorter set the epoch in progress is over; the next draw starts the next one.
        self.epoch, self.offset = state["epoch"], min(state["offset"], len(self.prompts))
        self.next_group_index, self.next_sample_index = state["next_group_index"], state["next_sample_index"]
        self._order = self._permutation(self.epoch)
        if "num_prompts" in state:  # absent from cursors saved before fingerprints
            self._warn_if_changed(state["num_prompts"], state["prompts_hash"])

    def _warn_if_changed(self, num_prompts: int, prompts_hash: int) -> None:
        if (num_prompts, prompts_hash) == (len(self.prompts), self.prompts_hash):
            return
        same_count = " (as many, but other text or labels)" if num_prompts == len(self.prompts) else ""
        print0(f"data: warning: the prompts of data.source changed since the checkpoint: {num_prompts} then, "
               f"{len(self.prompts)} now{same_count}; epoch {self.epoch} goes on from prompt {self.offset}")


def fingerprint(prompts: list[Prompt]) -> int:
    """A 63-bit hash of the prompts' text and labels in order: a JSON-safe int that any change alters."""
    digest = hashlib.blake2b(digest_size=8)
    for prompt in prompts:
        digest.update(json.dumps([prompt.text, prompt.label], default=str).encode())
        digest.update(b"\n")
    return int.from_bytes(digest.digest(), "little") >> 1
